"""The user guide as the tests read it: README.md, then every page of docs/ (sorted by name).

What the guide says is checked where it now lives: tests/test_readme.py runs its commands and
bad-input examples and writes its project files, tests/commands/test_doctor.py compares its sample
`orchestrate doctor` output, tests/launch/test_slurm.py submits its sbatch script, and
benchmarks/readme_timings.py keeps its "about N seconds" figures. A section moved between the
README and a page is still found, and a new page's commands are read without a list to edit.
Plain pathlib: benchmarks import it too, without pytest or the package.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pages() -> list[Path]:
    """README.md, then docs/*.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def texts() -> list[str]:
    """Each page's text, in `pages()` order (fenced blocks are read page by page: one page's
    unclosed fence cannot swallow the next page)."""
    return [page.read_text() for page in pages()]


def text() -> str:
    """The whole guide as one text, for what is looked up by its words."""
    return "\n".join(texts())
