"""A newcomer reads a function on one screen: none of the package's is longer than LIMIT lines
(docstring and comments included); a longer one is split along its own numbered parts."""

import ast

from tests.conftest import ROOT

LIMIT = 80


def test_no_function_is_longer_than_the_limit():
    long = [f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for package in ("orchestrate", "hydra_plugins") for path in sorted((ROOT / package).rglob("*.py"))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LIMIT]
    assert not long, f"functions over {LIMIT} lines: {long}"
