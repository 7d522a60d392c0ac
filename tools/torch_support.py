#!/usr/bin/env python3
"""The torch releases torch_chainermn builds for, and what each asks of the build.

One place for the rules every build description follows (setup.py imports this module; CMakeLists.txt
and the Makefile run it). It needs nothing but the standard library and takes torch's version as text,
so it can answer before torch is imported, and about a torch that is not installed.

- SUPPORTED: the torch minor releases the suite runs on (`make test-torch TORCH=...`). A build against
  any other release stops before compiling, with a message that says which are supported and how to
  try anyway (CHAINERMN_UNSUPPORTED_TORCH=1), rather than with a compiler error deep in ATen's headers.
- The C++ standard: torch 2.14's headers refuse anything below C++20 (ATen.h: "C++20 or later
  compatible compiler is required"); 2.12 and 2.13 need C++17 and are built with it, the standard
  their own wheels were built with.
- The local version label a build's distribution carries (0.1.0+torch2.14, 0.1.0+torch2.14.cu130),
  so that a wheel's name says which torch (and CUDA) it is for, as torch extensions' wheels do.

    python3 tools/torch_support.py cxx-standard 2.14.1+cu130     # 20
    python3 tools/torch_support.py check 2.11.0                  # exits 2 with the message
"""

import os
import re
import sys

# (major, minor) of the supported releases, oldest first: the newest three the package registry serves.
SUPPORTED = ((2, 12), (2, 13), (2, 14))
# The first release whose headers require C++20.
CXX20_SINCE = (2, 14)
OVERRIDE = "CHAINERMN_UNSUPPORTED_TORCH"


class UnsupportedTorch(RuntimeError):
    """The installed torch is not one this project builds for."""


def release(version):
    """(major, minor) of a torch version string such as '2.14.1+cu130' or '2.13.0'."""
    match = re.match(r"^(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(match.group(1)), int(match.group(2))


def _name(minor_release):
    return "%d.%d" % minor_release


def check(version, environ=os.environ):
    """Raise UnsupportedTorch, saying what to do, unless `version` is a supported release (or the
    override is set, for a user who wants to try a newer torch at their own risk)."""
    if release(version) in SUPPORTED or environ.get(OVERRIDE) == "1":
        return
    supported = ", ".join(_name(r) for r in SUPPORTED)
    raise UnsupportedTorch(
        f"torch-chainermn builds against torch {supported}; the installed torch is {version}. "
        f"Install one of those (pip install 'torch=={_name(SUPPORTED[-1])}.*'), or set {OVERRIDE}=1 "
        f"to build against torch {version} anyway (untested: its C++ API may differ)."
    )


def cxx_standard(version):
    """The C++ standard (17 or 20) to compile against torch `version` with."""
    return 20 if release(version) >= CXX20_SINCE else 17


def local_version(version, cuda_version=None):
    """The local version label of a build against torch `version`: 'torch2.14', or 'torch2.14.cu130'
    for a CUDA build against CUDA `cuda_version` ('13.0')."""
    label = "torch" + _name(release(version))
    if cuda_version:
        label += ".cu" + cuda_version.replace(".", "")
    return label


def main(argv):
    if len(argv) != 3 or argv[1] not in ("cxx-standard", "check"):
        print("usage: torch_support.py cxx-standard|check TORCH_VERSION", file=sys.stderr)
        return 2
    try:
        check(argv[2])
    except UnsupportedTorch as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if argv[1] == "cxx-standard":
        print(cxx_standard(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
