"""docs/architecture.md's map of modules (the table under "## The pieces") matches the tree:
every package and top-level module of extproc/ has a row, each package's row names its
modules (the harness, bench/, is described as a whole), and every file a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXTPROC = ROOT / "extproc"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
# The package's own entry points, not modules of the map.
NOT_MAPPED = {"__init__.py", "__main__.py"}
# A file or folder named in backticks: `phases.py`, `replay/fleet.py`, `bench/`.
NAMED_PATH = re.compile(r"`([\w./]+(?:\.py|/))`")


def _table() -> list[tuple[list[str], str]]:
    """The map's rows: the names in each row's first cell and the row's whole text."""
    rows = []
    for line in ARCHITECTURE.read_text().splitlines():
        if line.startswith("| `extproc/"):
            first_cell = line.split("|")[1]
            rows.append((NAMED_PATH.findall(first_cell), line))
    return rows


def _row_folder(first: list[str]) -> Path:
    """The folder a row's bare names are relative to: its package for a package's row
    (`extproc/adapter/`), extproc/ itself for a row of top-level modules."""
    head = ROOT / first[0]
    return head if first[0].endswith("/") else EXTPROC


def _mapped() -> set[Path]:
    """Every package and module the first column names, a bare name in a row that starts
    with an extproc/ path being relative to extproc/ (`metrics.py` in the errors.py row)."""
    names = set()
    for first, _ in _table():
        for name in first:
            path = ROOT / name if name.startswith("extproc/") else EXTPROC / name
            names.add(path.resolve())
    return names


def test_the_map_has_rows():
    assert len(_table()) >= 10


def test_every_package_and_top_level_module_has_a_row():
    mapped = _mapped()
    packages = {p.parent.resolve() for p in EXTPROC.glob("*/__init__.py")}
    modules = {p.resolve() for p in EXTPROC.glob("*.py") if p.name not in NOT_MAPPED}
    missing = sorted(str(p.relative_to(ROOT)) for p in (packages | modules) - mapped)
    assert not missing, f"docs/architecture.md's module map does not name {missing}"


def test_every_nested_package_is_named_in_its_parents_row():
    rows = {str(_row_folder(first)): line for first, line in _table()}
    for init in EXTPROC.glob("*/*/__init__.py"):
        nested, parent = init.parent, init.parent.parent
        row = rows.get(str(parent))
        assert row is not None, f"no row for {parent.relative_to(ROOT)}"
        named = {f"`{nested.name}/`", f"`{nested.relative_to(EXTPROC)}/`"}
        assert any(name in row for name in named), (
            f"the {parent.relative_to(ROOT)}/ row of docs/architecture.md does not name "
            f"{nested.relative_to(ROOT)}/"
        )


def _resolve(name: str, folder: Path) -> Path:
    """A name in a row: a bare name is in the row's folder, a path with a folder in it is
    relative to extproc/ (`replay/fleet.py`, `cli/bench/`) or to the repository
    (`extproc/...`, `tests/...`)."""
    if name.startswith(("extproc/", "tests/")):
        return ROOT / name
    if "/" in name.rstrip("/"):
        return EXTPROC / name
    return folder / name


@pytest.mark.parametrize(("first", "line"), _table(), ids=[first[0] for first, _ in _table()])
def test_every_file_a_row_names_exists(first, line):
    folder = _row_folder(first)
    absent = [name for name in NAMED_PATH.findall(line) if not _resolve(name, folder).exists()]
    assert not absent, f"docs/architecture.md's row for {first[0]} names absent {absent}"


def test_every_module_path_in_the_architecture_exists():
    """Outside the table too: a path with a folder in it (`index/prefix.py`,
    `extproc/stack/bootstrap.py`, `tests/cli/test_cli.py`) names a file that exists."""
    named = {
        name
        for name in NAMED_PATH.findall(ARCHITECTURE.read_text())
        if name.endswith(".py") and "/" in name
    }
    absent = sorted(name for name in named if not _resolve(name, EXTPROC).exists())
    assert not absent, f"docs/architecture.md names absent files {absent}"


# The harness's folder is described as a whole (its modules are benchmarks, one per
# workload); every other package's row names each of its modules.
DESCRIBED_WHOLE = {EXTPROC / "bench"}


def test_every_module_of_a_package_is_named_in_its_row():
    rows = {_row_folder(first): line for first, line in _table()}
    missing = []
    for folder, line in rows.items():
        if folder == EXTPROC or folder in DESCRIBED_WHOLE:
            continue
        named = {_resolve(name, folder) for name in NAMED_PATH.findall(line)}
        missing += [
            str(module.relative_to(ROOT))
            for module in sorted(folder.glob("*.py"))
            if module.name not in NOT_MAPPED and module not in named
        ]
    assert not missing, f"docs/architecture.md's rows do not name {missing}"
