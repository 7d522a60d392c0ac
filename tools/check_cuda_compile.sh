#!/usr/bin/env bash
# Compile-check (no link, no run) the CUDA build of torch_chainermn._C on a machine without a GPU
# or a CUDA torch: every .cpp and .cu that setup.py would build with CUDA is compiled with -c
# against the headers of a CUDA build of torch and of NCCL, with the flags BuildExtension uses.
# tools/check_cuda_build.sh is the full check (setup.py's real build, compile and link, against a
# CUDA torch installed from PyPI); this one needs only unzipped headers.
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
# The files are the CUDA build's, from tools/build_sources.py (the list setup.py and CMake use).
# Objects go to build/cuda-check/ under the names BuildExtension gives them (ignored); the script
# exits non-zero if any file fails.
# ONLY="csrc/a.cpp csrc/b.cu" compiles just those files.
# --dry-run prints what would be compiled ("would compile SRC -> OBJ") and needs no headers.
#   PYTHON          the python that runs tools/build_sources.py (default python3; no torch needed)
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
for arg in "$@"; do
  case $arg in
    --dry-run) dry_run=1 ;;
    *) echo "usage: $0 [--dry-run]" >&2; exit 2 ;;
  esac
done

list_flags=(--cuda --testing)  # every file a test build compiles
[[ "${MPI:-0}" == 1 ]] && list_flags+=(--mpi)
sources=$("${PYTHON:-python3}" tools/build_sources.py "${list_flags[@]}")  # fails on a clash
mapfile -t cu < <(grep '\.cu$' <<< "$sources" || true)
mapfile -t cpp < <(grep -v '\.cu$' <<< "$sources" || true)
if [[ -n "${ONLY:-}" ]]; then
  read -r -a cpp <<< "$ONLY"
  cu=()
fi
OUT=build/cuda-check
if [[ $dry_run == 1 ]]; then
  for src in "${cu[@]}" "${cpp[@]}"; do echo "would compile $src -> $OUT/${src%.*}.o"; done
  echo "${#cu[@]} .cu and ${#cpp[@]} .cpp files (MPI=${MPI:-0})"
  exit 0
fi

: "${TORCH_INCLUDE:?set TORCH_INCLUDE to the torch/include of a CUDA torch}"
: "${NCCL_INCLUDE:?set NCCL_INCLUDE to the directory holding nccl.h}"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
PYTHON_INCLUDE=${PYTHON_INCLUDE:-$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')}
CXX=${CXX:-g++}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
find "$OUT" -name '*.log' -delete

test -f "$TORCH_INCLUDE/c10/cuda/CUDAStream.h" || { echo "no c10/cuda headers under $TORCH_INCLUDE"; exit 2; }
test -f "$NCCL_INCLUDE/nccl.h" || { echo "no nccl.h under $NCCL_INCLUDE"; exit 2; }

defines=(-DCHAINERMN_WITH_CUDA=1 -DCHAINERMN_WITH_TESTING=1 -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H -D_GLIBCXX_USE_CXX11_ABI=1)
includes=(-Icsrc -I"$TORCH_INCLUDE" -I"$TORCH_INCLUDE/torch/csrc/api/include" -I"$NCCL_INCLUDE"
          -I"$CUDA_HOME/include" -I"$PYTHON_INCLUDE")
cxxflags=(-O3 -std=c++17 -Wall -Wno-unused-parameter -fPIC)
mpi_flags=()
if [[ "${MPI:-0}" == 1 ]]; then
  defines+=(-DCHAINERMN_WITH_MPI=1 -DOMPI_SKIP_MPICXX=1 -DMPICH_SKIP_MPICXX=1)
  read -r -a mpi_flags <<< "$(mpicc --showme:compile)"
fi
# What torch.utils.cpp_extension passes nvcc (COMMON_NVCC_FLAGS, -fPIC, an arch; H100 = sm_90).
nvccflags=(-O3 -std=c++17 -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
           -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr
           --compiler-options -fPIC -gencode=arch=compute_90,code=sm_90)

compile() {
  local src=$1 obj="$OUT/${1%.*}.o"  # BuildExtension's object name: only the suffix changes
  local rc=0
  mkdir -p "$(dirname "$obj")"
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
while IFS= read -r log; do
  if [[ -s "$log" ]] && grep -q "warning" "$log"; then
    echo "--- warnings in ${log#"$OUT"/}:"; grep -A3 "warning" "$log" | head -20
  fi
done < <(find "$OUT" -name '*.log' | sort)
if [[ $status == 0 ]]; then
  echo "all ${#cu[@]} .cu and ${#cpp[@]} .cpp files compile with CHAINERMN_WITH_CUDA"
else
  echo "some files failed to compile"
fi
exit $status
