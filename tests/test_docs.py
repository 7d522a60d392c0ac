"""The docs name what is there: every repository path that README.md and docs/*.md name exists
(docs/settings.md's table is checked in tests/test_settings.py)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The folders whose paths a doc writes from the repository's root (csrc/kernels/codes.h) ...
TOP = ("benchmarks", "csrc", "docs", "examples", "tests", "tools", "torch_chainermn")
# ... and csrc's own, which the C++ pages write from csrc/ (backend/agreement.cpp).
CSRC = tuple(sorted(p.name for p in (REPO / "csrc").iterdir() if p.is_dir()))
# Written by the benchmarks when they run, ignored by git: named as where to look, not as a file here.
GENERATED = ("benchmarks/results",)

_TAIL = r"[\w./{},*<>-]*[\w}*]"  # a path's characters; braces for alternatives, * for a glob
FROM_ROOT = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOP)})/{_TAIL})")
FROM_CSRC = re.compile(rf"(?<![\w/.-])((?:{'|'.join(CSRC)})/{_TAIL})")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)")  # [text](target#anchor): relative to the page


def alternatives(path: str) -> list:
    """`kernels/quantize.{h,cpp}` -> both paths."""
    braces = re.search(r"\{([^}]*)\}", path)
    if not braces:
        return [path]
    return [full for alternative in braces.group(1).split(",")
            for full in alternatives(path[:braces.start()] + alternative + path[braces.end():])]


def found(base: Path, path: str) -> bool:
    """Whether `path` names something under `base`: a file or folder, a glob's match, or a stem
    (`backend/transport_plan`: its .h and .cpp)."""
    if "*" in path:
        return any(base.glob(path))
    return (base / path).exists() or ("." not in Path(path).name and any(base.glob(path + ".*")))


def named_paths(doc: Path):
    """(path, where it is looked for) for every repository path the page names."""
    text = doc.read_text()
    for pattern, base in ((FROM_ROOT, REPO), (FROM_CSRC, REPO / "csrc")):
        for match in pattern.finditer(text):
            yield match.group(1), base
    for match in LINK.finditer(text):
        target = match.group(1)
        if "://" not in target and not target.startswith("mailto:"):
            yield target, doc.parent


def test_every_path_the_docs_name_exists():
    assert all((REPO / top).is_dir() for top in TOP)
    missing = []
    for doc in DOCS:
        for path, base in named_paths(doc):
            if "<" in path or path.rstrip("/").startswith(GENERATED):  # a placeholder (kernels/<code>.h)
                continue
            missing += [f"{doc.relative_to(REPO)}: {path}" for one in alternatives(path) if not found(base, one)]
    assert not missing, "named in the docs, not in the repository:\n" + "\n".join(missing)
