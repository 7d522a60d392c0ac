#!/usr/bin/env bash
# Compile-check (no link, no run) the CUDA build of torch_chainermn._C on a machine without a GPU
# or a CUDA torch: every .cpp and .cu that setup.py would build with CUDA is compiled with -c
# against the headers of a CUDA build of torch and of NCCL, with the flags BuildExtension uses.
#
#   TORCH_INCLUDE   torch/include of a CUDA torch wheel (has c10/cuda, ATen/cuda); required
#   NCCL_INCLUDE    dir holding nccl.h (nvidia/nccl/include of nvidia-nccl-cu13); required
#   CUDA_HOME       CUDA toolkit (default /usr/local/cuda)
#   PYTHON_INCLUDE  dir holding Python.h (default: this python3's)
#   CXX             host compiler (default g++)
#   MPI=1           also define CHAINERMN_WITH_MPI and compile comm/mpi.cpp (needs mpicc)
#   JOBS            parallel compiles (default: nproc)
#
# Getting the headers without a GPU machine (PyPI only; the default Linux torch wheel is a CUDA build):
#   pip download --no-deps torch==2.11.0 -d /tmp/cudatorch --python-version 3.12 \
#       --only-binary=:all: --platform manylinux_2_28_x86_64
#   (cd /tmp/cudatorch && unzip -q -o torch-2.11.0-*.whl 'torch/include/*')
#   pip download --no-deps nvidia-nccl-cu13==2.28.9 -d /tmp/cudatorch/nccl --python-version 3.12 \
#       --only-binary=:all: --platform manylinux_2_18_x86_64
#   (cd /tmp/cudatorch/nccl && unzip -q -o nvidia_nccl_cu13-*.whl 'nvidia/nccl/include/*')
#   TORCH_INCLUDE=/tmp/cudatorch/torch/include NCCL_INCLUDE=/tmp/cudatorch/nccl/nvidia/nccl/include \
#       tools/check_cuda_compile.sh
# Objects go to build/cuda-check/ (ignored); the script exits non-zero if any file fails.
# ONLY="csrc/a.cpp csrc/b.cu" compiles just those files.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${TORCH_INCLUDE:?set TORCH_INCLUDE to the torch/include of a CUDA torch}"
: "${NCCL_INCLUDE:?set NCCL_INCLUDE to the directory holding nccl.h}"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PYTHON_INCLUDE=${PYTHON_INCLUDE:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')}
CXX=${CXX:-g++}
JOBS=${JOBS:-$(nproc)}
OUT=build/cuda-check
mkdir -p "$OUT"
rm -f "$OUT"/*.log

test -f "$TORCH_INCLUDE/c10/cuda/CUDAStream.h" || { echo "no c10/cuda headers under $TORCH_INCLUDE"; exit 2; }
test -f "$NCCL_INCLUDE/nccl.h" || { echo "no nccl.h under $NCCL_INCLUDE"; exit 2; }

defines=(-DCHAINERMN_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1)
includes=(-Icsrc -I"$TORCH_INCLUDE" -I"$TORCH_INCLUDE/torch/csrc/api/include" -I"$NCCL_INCLUDE"
          -I"$CUDA_HOME/include" -I"$PYTHON_INCLUDE")
cxxflags=(-O3 -std=c++17 -Wall -Wno-unused-parameter -fPIC)
mpi_flags=()
exclude='comm/mpi\.cpp$'
if [[ "${MPI:-0}" == 1 ]]; then
  defines+=(-DCHAINERMN_WITH_MPI=1 -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1)
  read -r -a mpi_flags <<< "$(mpicc --showme:compile)"
  exclude='^$'
fi
# What torch.utils.cpp_extension passes nvcc (COMMON_NVCC_FLAGS, -fPIC, an arch; H100 = sm_90).
nvccflags=(-O3 -std=c++17 -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
           -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
           --compiler-options -fPIC -gencode=arch=compute_90,code=sm_90)

mapfile -t cpp < <(find csrc -name '*.cpp' | sort | grep -Ev "$exclude")
mapfile -t cu < <(find csrc -name '*.cu' | sort)
if [[ -n "${ONLY:-}" ]]; then
  read -r -a cpp <<< "$ONLY"
  cu=()
fi

compile() {
  local src=$1 obj="$OUT/$(echo "$1" | tr / _).o"
  local rc=0
  # (|| rc=$?: under set -e a failing compiler would otherwise end this subshell without a word)
  if [[ $src == *.cu ]]; then
    "$CUDA_HOME/bin/nvcc" -c "$src" -o "$obj" "${defines[@]}" "${includes[@]}" "${nvccflags[@]}" 2> "$obj.log" || rc=$?
  else
    "$CXX" -c "$src" -o "$obj" "${defines[@]}" "${includes[@]}" "${mpi_flags[@]}" "${cxxflags[@]}" 2> "$obj.log" || rc=$?
  fi
  if [[ $rc == 0 ]]; then
    if [[ -s "$obj.log" ]]; then echo "ok (warnings) $src"; else echo "ok   $src"; fi
  else
    echo "FAIL $src"; cat "$obj.log"
  fi
  return $rc
}
export -f compile
export OUT CUDA_HOME CXX
export defines_s="${defines[*]}"

status=0
running=0
pids=()
names=()
for src in "${cu[@]}" "${cpp[@]}"; do
  compile "$src" &
  pids+=($!)
  names+=("$src")
  running=$((running + 1))
  if (( running >= JOBS )); then
    wait "${pids[0]}" || status=1
    pids=("${pids[@]:1}")
    running=$((running - 1))
  fi
done
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
for log in "$OUT"/*.log; do
  if [[ -s "$log" ]] && grep -q "warning" "$log"; then
    echo "--- warnings in $(basename "$log" .o.log):"; grep -A3 "warning" "$log" | head -20
  fi
done
if [[ $status == 0 ]]; then
  echo "all ${#cu[@]} .cu and ${#cpp[@]} .cpp files compile with CHAINERMN_WITH_CUDA"
else
  echo "some files failed to compile"
fi
exit $status
