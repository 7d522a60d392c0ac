"""The wheel a cluster installs (tools/build_wheel.py, `make wheel`): built for this interpreter's torch,
named for it, manylinux-tagged, carrying none of torch's, CUDA's or MPI's libraries, and working in a
fresh environment that has only that torch: a 2-rank torchrun job there, outside the checkout."""

import re
import subprocess
import sys
import zipfile

import torch

from tests.support.harness import REPO


def test_the_wheel_installs_into_a_fresh_environment_and_runs_two_ranks(tmp_path):
    out = tmp_path / "dist"
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "build_wheel.py"), "--out", str(out), "--check"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # The job's rank 0 printed where it imported the module from: the fresh environment.
    assert re.search(r"wheel ok: \S*/venv/lib/python[\d.]+/site-packages/torch_chainermn/", result.stdout), (
        result.stdout[-2000:]
    )

    (wheel,) = out.glob("*.whl")
    major, minor = torch.__version__.split(".")[:2]
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    # torch_chainermn-0.1.0+torch2.13-cp311-cp311-manylinux_2_28_x86_64.whl: pip takes it from an index.
    assert re.fullmatch(
        rf"torch_chainermn-[\d.]+\+torch{major}\.{minor}(\.cu\d+)?-{tag}-{tag}-manylinux_\d+_\d+_x86_64\.whl",
        wheel.name,
    ), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert f"Requires-Dist: torch=={major}.{minor}.*" in requires, requires
    grafted = [n for n in names if ".libs/" in n]
    assert not [n for n in grafted if re.search(r"/lib(torch|c10|cudart|nccl|mpi)[^/]*\.so", n)], grafted
    assert not [n for n in names if "testing" in n.split("/")[-1]], "a user's wheel holds test code"
