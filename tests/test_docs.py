"""The docs are true as written. Every repository path, link and anchor that README.md and docs/*.md
name exists (docs/settings.md's table is checked in tests/test_settings.py), and every code block
says what it is and runs:

- a block is ```python, ```sh (commands) or ```text (output, layouts: not code);
- the line before a python or sh block says whether the suite runs it: `<!-- run: 2 ranks -->` (a
  Python snippet, on the 2 ranks of one torchrun job, as 2 simulated nodes), `<!-- run -->` (commands),
  `<!-- run: expect "TEXT" ... -->` (commands whose output holds each TEXT: what the page says they
  print or write) or `<!-- not run: why -->` (a fragment, a GPU, a cluster, an install, minutes of
  training: the reason is there for the reader too).

A page's Python snippets run in order in one namespace, as a reader would run them
(tests/support/doc_snippets.py); every runnable snippet shares one launch. Each block of commands
runs on its own in bash (`set -euo pipefail`), as a reader would paste it at the repository's root:
from a temporary folder whose entries link to the root's (a command reads the repository, and what it
writes there, a picture or a checkpoint folder, stays in the temporary folder), with the suite's venv
first on PATH, this checkout first on PYTHONPATH, and what the machine needs that a reader's does not
in the environment (mpiexec as root, torchrun's port), under a timeout; it must exit 0. A failure names
the page and line of the block that broke. The counts, and every reason not to run, are in pytest's
summary."""

import collections
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests.support.harness import free_port, job_environment, launch, torchrun

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The folders whose paths a doc writes from the repository's root (csrc/kernels/codes.h) ...
TOP = ("benchmarks", "csrc", "docs", "examples", "tests", "tools", "torch_chainermn")
# ... and csrc's own, which the C++ pages write from csrc/ (backend/agreement.cpp).
CSRC = tuple(sorted(p.name for p in (REPO / "csrc").iterdir() if p.is_dir()))
# What the benchmarks write when they run (git-ignored) is named as where to look, not as a file here;
# the dated records of past runs there (benchmarks/results/2026-...) are files and must exist.
GENERATED = "benchmarks/results/"

_TAIL = r"[\w./{},*<>-]*[\w}*]"  # a path's characters; braces for alternatives, * for a glob
FROM_ROOT = re.compile(rf"(?<![\w/.-])((?:{'|'.join(TOP)})/{_TAIL})")
FROM_CSRC = re.compile(rf"(?<![\w/.-])((?:{'|'.join(CSRC)})/{_TAIL})")
LINK = re.compile(r"\]\(([^)\s#]*)(?:#([^)\s]*))?\)")  # [text](target#anchor): relative to the page

FENCE = re.compile(r"^```(\S*)\s*$")
MARKER = re.compile(r'^<!-- (run: 2 ranks|run(?:: expect(?: "[^"]+")+)?|not run: .+) -->$')
LANGUAGES = ("python", "sh", "text")
RUN = {"python": "<!-- run: 2 ranks -->", "sh": '<!-- run --> or <!-- run: expect "TEXT" -->'}
COMMANDS_TIMEOUT_S = 180  # one block of commands; the slowest (3 launches) takes about 25 s on the 2-core VM

Snippet = collections.namedtuple("Snippet", "doc line language marker code")


def alternatives(path: str) -> list:
    """`kernels/quantize.{h,cpp}` -> both paths."""
    braces = re.search(r"\{([^}]*)\}", path)
    if not braces:
        return [path]
    return [
        full
        for alternative in braces.group(1).split(",")
        for full in alternatives(path[: braces.start()] + alternative + path[braces.end() :])
    ]


def found(base: Path, path: str) -> bool:
    """Whether `path` names something under `base`: a file or folder, a glob's match, or a stem
    (`backend/transport_plan`: its .h and .cpp)."""
    if "*" in path:
        return any(base.glob(path))
    return (base / path).exists() or ("." not in Path(path).name and any(base.glob(path + ".*")))


def generated(path: str) -> bool:
    return path.startswith(GENERATED) and not Path(path).name.startswith("20")


def prose(doc: Path) -> str:
    """The page without its code blocks (a layout map or a command is checked as a path elsewhere)."""
    out, inside = [], False
    for line in doc.read_text().splitlines():
        if FENCE.match(line):
            inside = not inside
            continue
        out.append("" if inside else line)
    return "\n".join(out)


def named_paths(doc: Path):
    """(path, where it is looked for) for every repository path the page names."""
    text = doc.read_text()
    for pattern, base in ((FROM_ROOT, REPO), (FROM_CSRC, REPO / "csrc")):
        for match in pattern.finditer(text):
            yield match.group(1), base
    for match in LINK.finditer(text):
        target = match.group(1)
        if target and "://" not in target and not target.startswith("mailto:"):
            yield target, doc.parent


def anchors(page: Path) -> set:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, a
    repeated one numbered."""
    seen, out = collections.Counter(), set()
    for line in prose(page).splitlines():
        heading = re.match(r"^#{1,6} (.+)$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            out.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return out


def test_every_path_the_docs_name_exists():
    assert all((REPO / top).is_dir() for top in TOP)
    missing = []
    for doc in DOCS:
        for path, base in named_paths(doc):
            if "<" in path or generated(path):  # a placeholder (kernels/<code>.h)
                continue
            missing += [f"{doc.relative_to(REPO)}: {path}" for one in alternatives(path) if not found(base, one)]
    assert not missing, "named in the docs, not in the repository:\n" + "\n".join(missing)


def test_every_link_to_a_heading_finds_it():
    broken = []
    for doc in DOCS:
        for match in LINK.finditer(prose(doc)):
            target, anchor = match.groups()
            page = (doc.parent / target).resolve() if target else doc
            if anchor is None or page.suffix != ".md" or not page.is_file():
                continue
            if anchor not in anchors(page):
                broken.append(f"{doc.relative_to(REPO)}: {target}#{anchor}")
    assert not broken, "links to headings that are not there:\n" + "\n".join(broken)


def snippets() -> list:
    """Every code block of the docs, with the marker on the line before it."""
    found_ = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            marker = MARKER.match(before.strip())
            found_.append(
                Snippet(
                    str(doc.relative_to(REPO)),
                    i + 2,
                    fence.group(1),
                    marker.group(1) if marker else None,
                    "\n".join(lines[i + 1 : end]) + "\n",
                )
            )
            i = end + 1
    return found_


def runner(marker: str):
    """What runs a block with this marker: "python" (2 ranks), "sh" (bash), or None (not run)."""
    if marker.startswith("not run"):
        return None
    return "python" if marker == "run: 2 ranks" else "sh"


def test_every_code_block_says_what_it_is_and_whether_it_runs(request):
    wrong = []
    for s in snippets():
        where = f"{s.doc}:{s.line}"
        if s.language not in LANGUAGES:
            wrong.append(f"{where}: a ```{s.language} block: say ```python, ```sh or ```text")
        elif s.language == "text" and s.marker:
            wrong.append(f"{where}: a text block is not run: no marker")
        elif s.language != "text" and not s.marker:
            wrong.append(f"{where}: say on the line before it {RUN[s.language]} or <!-- not run: why -->")
        elif s.language != "text" and runner(s.marker) not in (None, s.language):
            wrong.append(f"{where}: a ```{s.language} block runs with {RUN[s.language]}")
    assert not wrong, "\n".join(wrong)
    code = [s for s in snippets() if s.language != "text"]
    not_run = [s for s in code if s.marker.startswith("not run")]
    report = [f"docs: {len(code) - len(not_run)} of {len(code)} code blocks run, {len(not_run)} not run:"]
    report += [f"  {s.doc}:{s.line} {s.marker}" for s in not_run]
    request.config.docs_snippets_report = "\n".join(report)


def test_python_snippets_run_on_two_ranks(tmp_path):
    selected = [s for s in snippets() if s.language == "python" and s.marker == "run: 2 ranks"]
    assert selected
    path = tmp_path / "snippets.json"
    path.write_text(json.dumps([s._asdict() for s in selected]))
    env = job_environment({"CHAINERMN_RANKS_PER_NODE": "1"})  # 2 ranks as 2 nodes: the codes between them run
    done = launch(
        torchrun(2) + [str(REPO / "tests/support/doc_snippets.py"), str(path)],
        env,
        timeout=300,
        cwd=tmp_path,
        what="the docs' snippets",
        merged=True,
    )
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert done.returncode == 0, f"{failed[0] if failed else 'the job failed'}:\n{done.stdout[-6000:]}"
    ran = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert ran == [f"{s.doc}:{s.line}" for s in selected], done.stdout[-3000:]


def commands():
    return [s for s in snippets() if s.language == "sh" and s.marker and runner(s.marker) == "sh"]


@pytest.mark.parametrize("block", commands(), ids=lambda s: f"{s.doc}:{s.line}")
def test_commands_run(block, tmp_path):
    for entry in REPO.iterdir():  # the root as the reader's: what a command writes stays here
        if entry.name not in (".git", ".venv"):
            (tmp_path / entry.name).symlink_to(entry)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # .venv/bin/python: the suite's (make test-torch's too)
    env = job_environment({"PET_MASTER_PORT": str(free_port())})  # torchrun's --master-port, off 29500
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(OMPI_MCA_rmaps_base_oversubscribe="1")  # mpiexec -n 2 on a machine of fewer slots
    if os.geteuid() == 0:  # the suite's machine, not a reader's: mpiexec refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    done = launch(
        ["bash", "-c", "set -euo pipefail\n" + block.code],
        env,
        timeout=COMMANDS_TIMEOUT_S,
        cwd=tmp_path,
        what=f"{block.doc}:{block.line}'s commands",
        merged=True,
    )
    where = f"{block.doc}:{block.line}"
    assert done.returncode == 0, f"{where} exited with {done.returncode}:\n{done.stdout[-6000:]}"
    missing = [text for text in re.findall(r'"([^"]+)"', block.marker) if text not in done.stdout]
    assert not missing, f"{where} did not print {missing}:\n{done.stdout[-6000:]}"
