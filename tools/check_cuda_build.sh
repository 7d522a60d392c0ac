#!/usr/bin/env bash
# Build the CUDA torch_chainermn._C for real on a machine without a GPU: setup.py build_ext with
# CUDAExtension (the build pip runs), compiling AND linking against a CUDA torch from PyPI, then
# import it (importing needs no GPU) and check it is the CUDA build. It needs nvcc (a CUDA toolkit of
# torch's CUDA major version) and the internet the first time (torch + its nvidia-* wheels, ~4 GB).
#
#   VENV        the CUDA venv (default /tmp/cudavenv); created and filled when it has no torch
#   PYTHON      the interpreter that creates it (default python3)
#   TORCH       the torch to install (default torch==2.13.0: PyPI's Linux wheel, CUDA 13.0; torch==2.14.1
#               for the newest supported, with VENV=/tmp/cudavenv-2.14)
#   CUDA_HOME   the toolkit with nvcc (default /usr/local/cuda)
#   ARCH        TORCH_CUDA_ARCH_LIST (e.g. 9.0 = H100, the quick check); unset: setup.py's default
#               without a GPU, every architecture the installed torch was built for
#   JOBS        ninja jobs, MAX_JOBS (default 2)
#   BUILD_DIR   where the working tree is copied and built (default /tmp/chainermn-cuda-build), so
#               the checkout's in-place CPU module is left alone; a second run rebuilds only changes
#
# Checked on a GPU-less machine (2 cores, nvcc 13.0, torch 2.13.0+cu130, nvidia-nccl-cu13 2.29.7):
# every source compiles, the module links (-lc10_cuda -ltorch_cuda -lcudart -l:libnccl.so.2) and
# imports with cuda_built True. On a GPU machine, `python3 setup.py build_ext --inplace` is enough.
# tools/check_cuda_compile.sh is the lighter check: it compiles (no link) against unzipped headers.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-/tmp/cudavenv}
TORCH=${TORCH:-torch==2.13.0}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# No ARCH: setup.py's default without a GPU, the architectures the installed torch was built for.
if [ -n "${ARCH:-}" ]; then export TORCH_CUDA_ARCH_LIST=$ARCH; else unset TORCH_CUDA_ARCH_LIST; fi
export MAX_JOBS=${JOBS:-2}
BUILD_DIR=${BUILD_DIR:-/tmp/chainermn-cuda-build}

test -x "$CUDA_HOME/bin/nvcc" || { echo "no nvcc under CUDA_HOME=$CUDA_HOME" >&2; exit 2; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PYTHON:-python3}" -m venv "$VENV"
  # PyPI only: a local find-links dir or pip.conf (a CPU torch of the same version, constraints)
  # would otherwise win over PyPI's CUDA wheel.
  env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null \
    "$VENV/bin/python" -m pip install "$TORCH" numpy ninja setuptools wheel
fi
"$VENV/bin/python" -c "import torch, sys; print('torch', torch.__version__); sys.exit(torch.version.cuda is None)" \
  || { echo "$VENV has a CPU-only torch" >&2; exit 2; }

# Only what differs is copied, with a fresh mtime, so ninja rebuilds exactly the changed sources.
python3 "$repo/tools/mirror_tree.py" "$BUILD_DIR"
cd "$BUILD_DIR"
CHAINERMN_TESTING=1 "$VENV/bin/python" setup.py build_ext --inplace  # the test build

cd /  # import the built module, not a source tree's
PYTHONPATH="$BUILD_DIR" "$VENV/bin/python" -c "
import torch_chainermn._C as c
assert c.cuda_built, 'built without CUDA'
print('torch_chainermn._C: cuda_built', c.cuda_built, 'mpi_built', c.mpi_built,
      'nccl', c.nccl_version(), 'transports', c.cuda_transports)"
