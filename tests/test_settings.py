"""The one table of environment variables (torch_chainermn/settings.py) against the sources and the
README: a variable read anywhere is in the table, and the README's table says exactly what it says."""
import re
from pathlib import Path

from torch_chainermn import options, settings

REPO = Path(__file__).resolve().parents[1]
# Compile-time macros, not environment variables.
MACROS = {"CHAINERMN_WITH_CUDA", "CHAINERMN_WITH_MPI"}


def names_in_sources() -> set[str]:
    files = [*REPO.glob("csrc/**/*.[ch]*"), *REPO.glob("torch_chainermn/**/*.py"), REPO / "setup.py"]
    found = set()
    for path in files:
        found |= set(re.findall(r"\bCHAINERMN_[A-Z][A-Z_]*[A-Z]\b", path.read_text(errors="replace")))
    return found - MACROS


def readme_rows() -> dict:
    """environment variable -> (field, default) from the README's table of variables."""
    rows = {}
    for line in (REPO / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"`[A-Z_]+`", cells[0]) and cells[0] != "`environment`":
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def test_every_variable_the_sources_read_is_in_the_table():
    missing = names_in_sources() - set(settings.BY_NAME)
    assert not missing, f"not in torch_chainermn/settings.py: {sorted(missing)}"


def test_the_readme_table_is_the_table():
    rows = readme_rows()
    assert set(rows) == set(settings.BY_NAME), set(rows) ^ set(settings.BY_NAME)
    for variable in settings.VARIABLES:
        field, default = rows[variable.name]
        assert field == (f"`{variable.field}`" if variable.scope == "group" else f"({variable.scope})"), variable
        assert default == (f"`{variable.default}`" if variable.default else ("None" if variable.scope == "group" else "-")), variable


def test_options_take_their_defaults_from_the_table():
    assert options.ENVIRONMENT == {v.field: (v.name, v.default) for v in settings.VARIABLES if v.scope == "group"}
