#!/usr/bin/env python3
"""Keep a copy of the checkout's sources (what git tracks or would track) in another folder, for a build
that must not touch the checkout's own in-place module.

    python3 tools/mirror_tree.py DEST

Used by `make test-torch` (a build against another torch: its _C.cpython-*.so has the same name as the
default torch's in torch_chainermn/, so each torch builds and tests in a tree of its own) and
tools/check_cuda_build.sh. Only files whose content differs are copied, with a fresh modification time,
so ninja in DEST recompiles exactly what changed (copying the checkout's older times would let ninja
keep objects of other contents). Files copied by an earlier run that the checkout no longer has are
removed (a deleted test must not run on); DEST's builds and environments are left alone.
"""

import filecmp
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
MANIFEST = ".mirrored-files"


def sources():
    listed = subprocess.run(
        ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    return sorted(path for path in listed.split("\0") if path and (ROOT / path).is_file())


def mirror(dest):
    dest = pathlib.Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    files = sources()
    copied = 0
    for path in files:
        source, target = ROOT / path, dest / path
        if target.is_file() and filecmp.cmp(source, target, shallow=False):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        shutil.copymode(source, target)
        copied += 1
    manifest = dest / MANIFEST
    before = set(manifest.read_text().splitlines()) if manifest.exists() else set()
    for gone in sorted(before - set(files)):
        (dest / gone).unlink(missing_ok=True)
    manifest.write_text("\n".join(files) + "\n")
    print(f"mirror_tree: {dest}: {copied} of {len(files)} files copied, {len(before - set(files))} removed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__.strip().splitlines()[2].strip())
    mirror(sys.argv[1])
