"""The code style holds (pyproject.toml's ruff, .clang-format): what `make lint` checks, in the suite.
The tools come with setup.py's "lint" extra, which the "test" extra includes; `make format` applies
the style."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the suite's environment, where the "lint" extra installed the tools
CXX = sorted(p for pattern in ("*.cpp", "*.h", "*.cu", "*.cuh") for p in (REPO / "csrc").rglob(pattern))


def check(*command) -> None:
    tool = BIN / command[0]
    assert tool.exists(), f"{tool} is missing: pip install -e .[lint] (make lint installs it)"
    done = subprocess.run([str(tool), *command[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    output = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"`{' '.join(command[:3])} ...` failed (`make format` fixes the style):\n{output}"


def test_ruff_lint():
    check("ruff", "check", "--output-format", "concise", ".")


def test_ruff_format():
    check("ruff", "format", "--check", ".")


def test_clang_format():
    assert CXX
    check("clang-format", "--dry-run", "-Werror", *map(str, CXX))
