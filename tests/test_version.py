"""torch_chainermn.__version__: written once (torch_chainermn/_version.py), the version setup.py builds
and the installed distribution's metadata carry."""

import importlib.metadata
import re
import runpy
import sys

import setuptools
import torch

import torch_chainermn
from tests.support.harness import REPO

# PEP 440's public versions, in short: 1.2.3, 1.2.3rc1, 1.2.3.post1, 1.2.3.dev4
PEP_440 = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")


def test_version_is_setup_pys_and_the_installed_metadata(monkeypatch):
    version = torch_chainermn.__version__
    assert PEP_440.match(version), version

    captured = {}
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", list(sys.path))  # setup.py prepends tools/
    monkeypatch.setenv("CHAINERMN_NO_CUDA", "1")
    monkeypatch.setenv("CHAINERMN_NO_MPI", "1")
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(REPO / "setup.py"), run_name="__main__")
    # The distribution adds a local label naming the torch it is built for (tools/torch_support.py).
    major, minor = torch.__version__.split(".")[:2]
    assert captured["version"] == f"{version}+torch{major}.{minor}"

    # What pip recorded at install (make install: pip install -e .); stale after a version change
    # until the next install.
    installed = importlib.metadata.version("torch-chainermn")
    assert installed.split("+")[0] == version, "reinstall: pip install --no-build-isolation -e ."
