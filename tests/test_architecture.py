"""docs/architecture.md's module map stays true: every Python module of orchestrate/ and
hydra_plugins/ (by its dotted name; a package by its name, for its `__init__.py`) has a row in the
tables of its "Module map" section, and every row names a module that exists. Files are read with
pathlib: nothing is imported, so a module that moved or was renamed fails here in milliseconds,
naming what to add or drop."""

import re

from tests.guide import ROOT

PACKAGES = ("orchestrate", "hydra_plugins")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def modules() -> set[str]:
    """The dotted name of every .py file under PACKAGES (`orchestrate.backends` for its __init__)."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def module_map() -> list[str]:
    """The modules the map's rows name (`| `dotted.name` | what it holds |`), in order, from the
    "## Module map" heading to the next `## ` heading."""
    text = ARCHITECTURE.read_text()
    assert "\n## Module map\n" in text, "docs/architecture.md has no '## Module map' section"
    section = re.split(r"^## ", text.split("\n## Module map\n", 1)[1], flags=re.M)[0]
    return re.findall(r"^\|\s*`([\w.]+)`\s*\|\s*\S", section, re.M)


def test_the_module_map_names_every_module_and_no_other():
    rows = module_map()
    twice = sorted({m for m in rows if rows.count(m) > 1})
    missing = sorted(modules() - set(rows))
    gone = sorted(set(rows) - modules())
    assert not (twice or missing or gone), "docs/architecture.md's module map: " + "; ".join(
        f"{what}: {', '.join(names)}" for what, names in [
            ("no row (add one, with a line from its docstring)", missing),
            ("no such module (drop or rename its row)", gone),
            ("two rows", twice)] if names)
