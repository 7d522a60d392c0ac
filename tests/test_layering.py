"""The C++ layers call down only: no include points up a layer, and no two folders include each other.

Layers, top to bottom (a file may include its own folder and any folder below it):
    testing/                      the in-process harness and its bindings (_C.testing; test builds only)
    python/                       the bindings
    backend/                      the c10d surface
    strategies/, cuda/, runtime/  allreduce algorithms; everything CUDA: the device unit (cuda/device.h),
                                  the CUDA transports and kernels; the engine that runs ops (Work, the
                                  worker, the watchdog; device-agnostic: it and cuda/ never meet)
    comm/, buffers/               transports; a device's staging buffers and how bytes move there (Scratch)
    kernels/                      packing, casting, reduction, the codes
    types.h, topology.h, phase.h  the vocabulary every layer shares (and a phase's span and counters)
    os/                           the operating system's helpers (waits that spin or sleep, thread names,
                                  processes, std::terminate's report, the clock ops read)

torch's heavy headers (ATen, torch/, c10d, pybind11: 2.6 s to 5 s of compiling each, against 0.4 s for c10's
util and core headers) are kept to the folders that meet torch; elsewhere only the adapters named in
TORCH_ADAPTERS may include them, so the list cannot grow unnoticed.
"""

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
LEVEL = {
    "os": 0,
    "": 1,
    "kernels": 2,
    "comm": 3,
    "buffers": 3,
    "strategies": 4,
    "cuda": 4,
    "runtime": 4,
    "backend": 5,
    "python": 6,
    "testing": 7,
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
LINE_LIMIT = 700  # files are cut by what they do; this only guards against one file growing into many
# A preprocessor test of the CUDA build: only in csrc/cuda/ and the backend's one door to it.
CUDA_CONDITION = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif)\b.*CHAINERMN_WITH_CUDA", re.MULTILINE)
CUDA_DOOR = {"backend/device_context.cpp"}
TORCH_HEADER = re.compile(r"^\s*#\s*include\s+<(ATen|torch|pybind11)/", re.MULTILINE)
# The c10d surface and bindings, the in-process harness, the engine (its Work is a c10d::Work), the CUDA
# adapters, and a device's staging buffers (at::Tensor storage).
TORCH_FOLDERS = {"python", "backend", "testing", "runtime", "cuda", "buffers"}
TORCH_ADAPTERS = {
    "comm/gloo.h": "Gloo is torch's own c10d::Backend",
    "comm/shm.h": "the segment's name is agreed through the c10d::Store",
    "comm/shm_segment.h": "the same",
    "topology.cpp": "hostnames are exchanged through the c10d::Store",
    "kernels/code_checks.h": "the codes' argument checks for the torch operators (at::Tensor)",
    "phase.cpp": "a phase (phase.h, torch-free) is recorded as torch's profiler's at::RecordFunction",
}


def folder_of(path: str) -> str:
    parts = Path(path).parts
    return parts[0] if len(parts) > 1 else ""


# Every kind of C++ and CUDA source; the headers are the ones a unit's .cpp or .cu includes.
HEADERS = (".h", ".hpp", ".cuh")
SOURCES = HEADERS + (".cpp", ".cc", ".cu")


def sources():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in SOURCES)


def test_every_file_under_csrc_is_a_source_these_rules_read():
    """A file of another kind (csrc/cuda/block_scale.cuh, once) would escape every rule below."""
    unread = sorted(str(p.relative_to(CSRC)) for p in CSRC.rglob("*") if p.is_file() and p.suffix not in SOURCES)
    assert unread == []


def test_every_folder_has_a_layer():
    assert {folder_of(str(p.relative_to(CSRC))) for p in sources()} <= set(LEVEL)


def test_no_include_points_up_or_sideways():
    wrong = []
    for path in sources():
        here = folder_of(str(path.relative_to(CSRC)))
        for included in INCLUDE.findall(path.read_text()):
            there = folder_of(included)
            if there != here and LEVEL[there] >= LEVEL[here]:
                wrong.append(f"{path.relative_to(CSRC)} includes {included}")
    assert wrong == []


def test_no_source_file_is_long():
    long = [
        f"{p.relative_to(CSRC)}: {n} lines" for p in sources() if (n := len(p.read_text().splitlines())) > LINE_LIMIT
    ]
    assert long == []


def test_cuda_is_tested_for_only_in_its_home():
    outside = [
        str(p.relative_to(CSRC))
        for p in sources()
        if folder_of(str(p.relative_to(CSRC))) != "cuda" and CUDA_CONDITION.search(p.read_text())
    ]
    assert sorted(outside) == sorted(CUDA_DOOR)


def test_only_the_test_harnesses_include_them():
    """csrc/testing/ is compiled in a test build only (tools/build_sources.py): no file of a user's
    build may include it (the harness registers _C.testing itself: tests/test_build.py)."""

    def harness(path: str) -> bool:
        return path.startswith("testing/")

    wrong = []
    for path in sources():
        here = str(path.relative_to(CSRC))
        if harness(here):
            continue
        wrong += [f"{here} includes {included}" for included in INCLUDE.findall(path.read_text()) if harness(included)]
    assert wrong == []


def test_no_two_units_include_each_other():
    """A unit is a header and the .cpp of the same name: device_context.cpp including transports.h while
    transports.h included device_context.h was a cycle no folder rule sees. A header that only .cpp
    files include (worker_state.h, the worker's private state) is part of what includes it: a .cpp's
    include of it is no edge."""

    def unit(path: str) -> str:
        return str(Path(path).with_suffix(""))

    includes = {str(p.relative_to(CSRC)): INCLUDE.findall(p.read_text()) for p in sources()}
    public = {i for path, found in includes.items() if path.endswith(HEADERS) for i in found}
    edges = {}
    for path, found in includes.items():
        edges.setdefault(unit(path), set()).update(
            unit(i) for i in found if unit(i) != unit(path) and (path.endswith(HEADERS) or i in public)
        )
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(trail[trail.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_torch_headers_stay_where_torch_is_met():
    outside = {
        str(p.relative_to(CSRC))
        for p in sources()
        if folder_of(str(p.relative_to(CSRC))) not in TORCH_FOLDERS and TORCH_HEADER.search(p.read_text())
    }
    assert outside == set(TORCH_ADAPTERS)


def registered_code_names() -> list[str]:
    from torch_chainermn import _C

    return [code["name"] for code in _C.codes.registered()]


def test_each_code_is_named_in_its_own_files_only():
    """A code's name (its string) stands only in the files that register it: its CPU kernel file
    (kernels/<code>.cpp, a CodeRegistration) and its CUDA kernel file (cuda/<code>_kernels.cu, a
    CudaCodeRegistration). Every other file reaches a code through the registry (codeNamed), so no
    table or switch over codes can grow anywhere else, and adding a code touches its own files."""
    names = registered_code_names()
    quoted = re.compile('"(' + "|".join(map(re.escape, names)) + ')"')
    registers = re.compile(r"\b(Cuda)?CodeRegistration\b")
    where = {}
    for path in sources():
        code_lines = "\n".join(re.sub(r"(^|\s)//.*$", "", line) for line in path.read_text().splitlines())
        for name in quoted.findall(code_lines):
            where.setdefault(name, set()).add(str(path.relative_to(CSRC)))
        if quoted.search(code_lines):
            assert registers.search(code_lines), f"{path.relative_to(CSRC)} names a code but registers none"
    assert set(where) == set(names)  # every code is registered by name somewhere
    for name, files in where.items():
        kernels = {f for f in files if f.startswith("kernels/")}
        cuda = {f for f in files if f.startswith("cuda/")}
        assert len(kernels) == 1 and len(cuda) <= 1 and files == kernels | cuda, (name, sorted(files))
    switch = re.compile(r"switch\s*\([^)]*\bcode\b", re.IGNORECASE)
    assert [str(p.relative_to(CSRC)) for p in sources() if switch.search(p.read_text())] == []


def test_python_holds_no_list_of_code_names():
    """torch_chainermn derives every list of codes from the backend's registry (torch_chainermn.codes):
    no tuple, list, set or dict literal of the package holds two code names."""
    import ast

    names = set(registered_code_names())
    package = CSRC.parent / "torch_chainermn"
    lists = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and items:
                named = [item.value for item in items if isinstance(item, ast.Constant) and item.value in names]
                if len(named) >= 2:
                    lists.append(f"{path.relative_to(package)}:{node.lineno} {named}")
    assert lists == []


def test_only_the_mean_resolver_tests_for_a_compression_type():
    """What a user passed as `compression=` becomes a mean in torch_chainermn/_means.py alone: no other
    module of the package asks whether something is a GradientCompression (isinstance, issubclass or
    a type() comparison), so a new kind of mean is taught to one place."""
    package = CSRC.parent / "torch_chainermn"
    # (a CompressionSpec is a value, not a kind of mean: torch_chainermn.codes checks for one)
    test = re.compile(
        r"(isinstance|issubclass)\([^)]*Compression(State)?\b(?!Spec)|"
        r"type\([^)]*\)\s*(is|==)\s*\w*Compression\b"
    )
    asking = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if test.search(p.read_text()))
    assert asking == ["_means.py"]
