# torch-chainermn: set-up, demo, tests.
#
#   make demo   train the MNIST example on 4 processes with torchrun (sets everything up first)
#   make test   run the test suite (sets everything up first)
#
# `make install` is idempotent and quick when nothing changed: it creates .venv with the pinned CPU
# torch (found through PIP_FIND_LINKS, which must stay in the environment), installs Open MPI from
# Debian when mpicc is missing, Slurm (for tests/test_slurm.py's one-node cluster) when srun is and
# iproute2 (for the network namespaces of tests/test_network_faults.py) when ip is, and builds the
# extension in place.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
TORCH_SPEC := torch==2.13.0
# tqdm: the examples' progress bars. expecttest: torch.testing._internal (the upstream test cases) needs it.
# lightning, accelerate, transformers (its Trainer), deepspeed (ZeRO): the tested recipes (examples/recipes/).
# torchft: torch_chainermn.torchft's tests (it takes the installed torch: torch>=2.7); parameterized: torchft's own
# test modules, which tests/test_torchft_upstream.py runs on chainermn, need it. deepspeed comes as an
# sdist only: it builds in pip's usual isolation (its setup.py does without torch there) and pre-compiles
# no op (DS_BUILD_OPS is 0 on Linux by default), so it needs no flags here; see the deps rule for its op.
PY_PACKAGES := $(TORCH_SPEC) numpy pytest scikit-learn ninja tqdm expecttest lightning accelerate torchft==0.2.0 \
	parameterized==0.9.0 transformers==5.24.0 deepspeed==0.19.8
SOURCES := setup.py pyproject.toml tools/build_sources.py $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu')
EXTENSION_STAMP := $(VENV)/.extension-built
MPI_STAMP := $(VENV)/.mpi-checked
SLURM_STAMP := $(VENV)/.slurm-checked
IPROUTE_STAMP := $(VENV)/.iproute-checked
DEPS_STAMP := $(VENV)/.deps-installed
NPROC ?= 4

BENCH_STAMP := $(VENV)/.bench-deps-installed

.PHONY: install demo test bench clean

install: $(EXTENSION_STAMP) $(SLURM_STAMP) $(IPROUTE_STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)

# On CPU every DeepSpeed process group compiles DeepSpeed's shared-memory op (deepspeed_shm_comm, which only its
# inference all_reduce uses) the first time, into ~/.cache/torch_extensions: about 100 s of CPU (torch's headers),
# which would fall on the first DeepSpeed test. Compiled here instead, once (a no-op when cached).
$(DEPS_STAMP): $(PY) Makefile
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(PY_PACKAGES)
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
$(EXTENSION_STAMP): $(DEPS_STAMP) $(MPI_STAMP) $(SOURCES)
	CHAINERMN_TESTING=1 $(PY) -m pip install -q --no-build-isolation -e .
	touch $@

demo: install
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) examples/mnist/train_mnist.py

test: install
	$(PY) -m pytest -q

# all_reduce bandwidth against gloo and MPI (mpi4py), under mpiexec and torchrun; table + plot.
bench: install $(BENCH_STAMP)
	$(PY) benchmarks/allreduce.py --launch both --configs 2 4 2x2 --plot benchmarks/results/allreduce.png

$(BENCH_STAMP): $(DEPS_STAMP)
	$(PY) -m pip install -q mpi4py matplotlib
	touch $@

clean:
	rm -rf build $(VENV) torch_chainermn/_C*.so *.egg-info
