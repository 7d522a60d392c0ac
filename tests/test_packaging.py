"""What a user's install requires and what the test suite's extra holds, read from setup.py without building.

A user's `pip install .` (and the wheel `make wheel` builds) requires torch, pinned to the minor release the
extension is compiled against, and what the package and the examples import; the test suite's companions
are the "test" extra, which `make test` installs.
"""
import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import torch
from packaging.requirements import Requirement

from tests.test_build import setup_py_arguments

ROOT = Path(__file__).resolve().parent.parent
PROJECT_MODULES = {"tests", "torch_chainermn", "torch_chainermn_autoload", "setup"}


def requirement_names(requirements) -> set:
    return {Requirement(r).name.lower() for r in requirements}


def imported_distributions(folder: Path) -> dict:
    """distribution name -> the files of `folder` that import it, for every absolute import of a module that
    is neither the standard library's, the project's, nor a script of the repository's own (benchmarks put
    their folder on sys.path)."""
    local = {p.stem for scripts in ("tests", "benchmarks", "examples") for p in (ROOT / scripts).rglob("*.py")}
    owners = importlib.metadata.packages_distributions()
    found = {}
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in PROJECT_MODULES or top in local:
                    continue
                for dist in owners.get(top, [top]):
                    found.setdefault(dist.lower(), set()).add(str(path.relative_to(ROOT)))
    return found


def test_a_user_install_requires_no_test_or_benchmark_package(monkeypatch, tmp_path):
    arguments = setup_py_arguments(monkeypatch, tmp_path, testing=False)
    required = requirement_names(arguments["install_requires"])
    assert required == {"torch", "numpy", "tqdm"}
    for extra in ("test", "bench"):
        assert not required & requirement_names(arguments["extras_require"][extra]), extra


def test_the_wheel_pins_the_torch_it_is_built_for(monkeypatch, tmp_path):
    for version, built_for, other in (
            (torch.__version__, torch.__version__.split("+")[0], None),
            ("2.11.0+cu130", "2.11.3", "2.12.0"),  # a CUDA torch: any 2.11 release, not 2.12
            ("2.9.1", "2.9.0", "2.10.0")):
        monkeypatch.setattr(torch, "__version__", version)
        (pin,) = [Requirement(r) for r in setup_py_arguments(monkeypatch, tmp_path, testing=False)["install_requires"]
                  if Requirement(r).name == "torch"]
        assert pin.specifier.contains(built_for), (version, str(pin))
        major, minor = map(int, built_for.split(".")[:2])
        for neighbour in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.0", other):
            if neighbour is not None:
                assert not pin.specifier.contains(neighbour), (version, str(pin), neighbour)


def test_the_test_extra_holds_what_the_suite_imports(monkeypatch, tmp_path):
    arguments = setup_py_arguments(monkeypatch, tmp_path)
    available = requirement_names(arguments["install_requires"]) | requirement_names(arguments["extras_require"]["test"])
    imported = imported_distributions(ROOT / "tests")
    assert "torchft" in imported and "pytest" in imported  # the scan sees the suite's imports
    missing = {dist: sorted(files) for dist, files in imported.items()
               if re.sub(r"[-_.]+", "-", dist) not in {re.sub(r"[-_.]+", "-", a) for a in available}}
    assert missing == {}


def test_the_benchmarks_extra_holds_what_the_benchmarks_plot_with(monkeypatch, tmp_path):
    arguments = setup_py_arguments(monkeypatch, tmp_path)
    bench = requirement_names(arguments["extras_require"]["bench"])
    assert {"matplotlib", "mpi4py"} <= bench
    assert {"matplotlib", "mpi4py"} <= set(imported_distributions(ROOT / "benchmarks"))
