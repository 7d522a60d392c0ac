"""What a user's install requires and what the test suite's extra holds, read from setup.py without building.

A user's `pip install .` (and the wheel `make wheel` builds) requires torch, pinned to the minor release the
extension is compiled against, and what the package and the examples import; the test suite's companions
are the "test" extra, which `make test` installs, and the benchmarks' the "bench" extra (`make bench`).
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


def imports_of(path: Path) -> list:
    """(top-level module, optional) for every absolute import in `path`; optional: made inside a `try`
    that catches ImportError (the script goes on without it)."""
    found = []

    def visit(node, optional):
        if isinstance(node, ast.Try):
            catches = {getattr(h.type, "id", None) for h in node.handlers} | {
                getattr(e, "id", None) for h in node.handlers if isinstance(h.type, ast.Tuple) for e in h.type.elts
            }
            guarded = optional or bool(catches & {"ImportError", "ModuleNotFoundError"})
            for child in node.body:
                visit(child, guarded)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, optional)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name.split(".")[0], optional) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module.split(".")[0], optional))
        for child in ast.iter_child_nodes(node):
            visit(child, optional)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def imported_distributions(folder: Path, required_only: bool = False) -> dict:
    """distribution name -> the files of `folder` that import it, for every absolute import of a module that
    is neither the standard library's, the project's, nor a script of the repository's own (benchmarks put
    their folder on sys.path). `required_only`: leave out the imports a file can do without (imports_of)."""
    local = {p.stem for scripts in ("tests", "benchmarks", "examples") for p in (ROOT / scripts).rglob("*.py")}
    owners = importlib.metadata.packages_distributions()
    found = {}
    for path in folder.rglob("*.py"):
        for top, optional in imports_of(path):
            if top in sys.stdlib_module_names or top in PROJECT_MODULES or top in local or (optional and required_only):
                continue
            for dist in owners.get(top, [top]):
                found.setdefault(dist.lower(), set()).add(str(path.relative_to(ROOT)))
    return found


def undeclared(imported: dict, declared: set) -> dict:
    """The distributions of `imported` (imported_distributions) that no name in `declared` covers."""
    normal = {re.sub(r"[-_.]+", "-", name) for name in declared}
    return {dist: sorted(files) for dist, files in imported.items() if re.sub(r"[-_.]+", "-", dist) not in normal}


def test_a_user_install_requires_no_test_or_benchmark_package(monkeypatch, tmp_path):
    arguments = setup_py_arguments(monkeypatch, tmp_path, testing=False)
    required = requirement_names(arguments["install_requires"])
    assert required == {"torch", "numpy", "tqdm"}
    for extra in ("test", "bench"):
        assert not required & requirement_names(arguments["extras_require"][extra]), extra


def test_the_wheel_pins_the_torch_it_is_built_for(monkeypatch, tmp_path):
    for version, built_for, other in (
        (torch.__version__, torch.__version__.split("+")[0], None),
        ("2.12.1+cu130", "2.12.3", "2.13.0"),  # a CUDA torch: any 2.12 release, not 2.13
        ("2.14.1", "2.14.0", "2.15.0"),
    ):
        monkeypatch.setattr(torch, "__version__", version)
        (pin,) = [
            Requirement(r)
            for r in setup_py_arguments(monkeypatch, tmp_path, testing=False)["install_requires"]
            if Requirement(r).name == "torch"
        ]
        assert pin.specifier.contains(built_for), (version, str(pin))
        major, minor = map(int, built_for.split(".")[:2])
        for neighbour in (f"{major}.{minor + 1}.0", f"{major}.{minor - 1}.0", other):
            if neighbour is not None:
                assert not pin.specifier.contains(neighbour), (version, str(pin), neighbour)


def test_the_test_extra_holds_what_the_suite_imports(monkeypatch, tmp_path):
    arguments = setup_py_arguments(monkeypatch, tmp_path)
    available = requirement_names(arguments["install_requires"]) | requirement_names(
        arguments["extras_require"]["test"]
    )
    imported = imported_distributions(ROOT / "tests")
    assert "torchft" in imported and "pytest" in imported  # the scan sees the suite's imports
    assert undeclared(imported, available) == {}


def test_the_benchmarks_extra_holds_what_the_benchmarks_import(monkeypatch, tmp_path):
    """Every package a benchmark needs is a user's install's or the bench extra's; the benchmarks that
    drive the test suite's own code (tests.support: torchft_kills.py) run where the test extra is
    installed, so theirs may be the test extra's. An import with a fallback (gpu.py's torchvision) is
    no requirement."""
    arguments = setup_py_arguments(monkeypatch, tmp_path)
    extras = arguments["extras_require"]
    available = requirement_names(arguments["install_requires"]) | requirement_names(extras["bench"])
    assert {"matplotlib", "mpi4py"} <= requirement_names(extras["bench"])
    with_the_suite = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "benchmarks").rglob("*.py")
        if any(top == "tests" for top, _ in imports_of(path))
    }
    imported = imported_distributions(ROOT / "benchmarks", required_only=True)
    assert {"matplotlib", "mpi4py", "torch"} <= set(imported)  # the scan sees the benchmarks' imports
    with_the_test_extra = available | requirement_names(extras["test"])
    missing = {
        dist: files
        for dist, files in undeclared(imported, available).items()
        if not set(files) <= with_the_suite or undeclared({dist: files}, with_the_test_extra)
    }
    assert missing == {}
