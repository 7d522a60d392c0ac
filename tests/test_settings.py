"""The one table of environment variables (torch_chainermn/settings.py) against the sources and the
docs: a variable read anywhere is in the table, and docs/settings.md's table says exactly what it says."""

import re
from pathlib import Path

import pytest

from torch_chainermn import options, settings

REPO = Path(__file__).resolve().parents[1]
# Compile-time macros, not environment variables.
MACROS = {"CHAINERMN_WITH_CUDA", "CHAINERMN_WITH_MPI", "CHAINERMN_WITH_TESTING"}


def names_in_sources() -> set[str]:
    files = [*REPO.glob("csrc/**/*.[ch]*"), *REPO.glob("torch_chainermn/**/*.py"), REPO / "setup.py"]
    found = set()
    for path in files:
        found |= set(re.findall(r"\bCHAINERMN_[A-Z][A-Z_]*[A-Z]\b", path.read_text(errors="replace")))
    return found - MACROS


def documented_rows() -> dict:
    """environment variable -> (field, default) from docs/settings.md's table of variables."""
    rows = {}
    for line in (REPO / "docs" / "settings.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`[A-Z_]+`", cells[0]) and cells[0] != "`environment`":
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_every_variable_the_sources_read_is_in_the_table():
    missing = names_in_sources() - set(settings.BY_NAME)
    assert not missing, f"not in torch_chainermn/settings.py: {sorted(missing)}"


def test_the_documented_table_is_the_table():
    rows = documented_rows()
    assert set(rows) == set(settings.BY_NAME), set(rows) ^ set(settings.BY_NAME)
    for variable in settings.VARIABLES:
        field, default = rows[variable.name]
        assert field == (f"`{variable.field}`" if variable.scope == "group" else f"({variable.scope})"), variable
        assert default == (
            f"`{variable.default}`" if variable.default else ("None" if variable.scope == "group" else "-")
        ), variable


def test_options_take_their_defaults_from_the_table():
    assert options.ENVIRONMENT == {v.field: (v.name, v.default) for v in settings.VARIABLES if v.scope == "group"}


def test_the_cpp_backend_reads_none_of_them():
    """C++ is handed the values (GroupSetup, discover_topology's node name): it reads no variable of the table."""
    readers = [
        str(path.relative_to(REPO))
        for path in REPO.glob("csrc/**/*.[ch]*")
        if re.search(r'getenv\("(CHAINERMN|TORCH)_', path.read_text(errors="replace"))
    ]
    assert readers == []


def test_the_node_name_and_the_chunk(monkeypatch):
    monkeypatch.delenv("CHAINERMN_HOSTNAME", raising=False)
    monkeypatch.setenv("CHAINERMN_RANKS_PER_NODE", "2")
    assert [settings.node_name(r) for r in range(4)] == ["simulated-node-0"] * 2 + ["simulated-node-1"] * 2
    monkeypatch.setenv("CHAINERMN_HOSTNAME", "node7")
    assert settings.node_name(3) == "node7"
    monkeypatch.delenv("CHAINERMN_HOSTNAME")
    monkeypatch.setenv("CHAINERMN_RANKS_PER_NODE", "0")
    with pytest.raises(ValueError, match="CHAINERMN_RANKS_PER_NODE must be a positive integer"):
        settings.node_name(0)
    monkeypatch.delenv("CHAINERMN_SHM_CHUNK_BYTES", raising=False)
    assert settings.shm_chunk_bytes() == 1 << 20
    monkeypatch.setenv("CHAINERMN_SHM_CHUNK_BYTES", "100")
    with pytest.raises(ValueError, match="at least 4096"):
        settings.shm_chunk_bytes()


def test_only_the_table_s_module_reads_them_in_python():
    """Every CHAINERMN_* variable is read in torch_chainermn/settings.py (options.py reads the group ones
    through its table): a module that reads one itself would escape the table."""
    readers = [
        str(path.relative_to(REPO))
        for path in REPO.glob("torch_chainermn/**/*.py")
        if path.name != "settings.py"
        and re.search(r'(environ\.get\(|environ\[|getenv\()\s*"CHAINERMN_', path.read_text(errors="replace"))
    ]
    assert readers == []
