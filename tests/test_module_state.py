"""Module state: each mutable store at a module's top level of the package (a dict, list or set
that calls fill, a lock, a ContextVar, or a name a function rebinds with `global`) says, in the
comment right above it that begins "Module state:", why it must outlive a call and how a run leaves
it as found (the house's rule: state is passed, not parked, unless it must be)."""

import ast

from tests.conftest import ROOT

MUTABLE_CALLS = {"dict", "list", "set", "Lock", "RLock", "Event", "ContextVar", "deque", "defaultdict", "OrderedDict",
                 "WeakValueDictionary", "WeakKeyDictionary", "local"}
MUTATING = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "add", "setdefault", "discard"}


def mutated(tree) -> set[str]:
    """Names changed in place somewhere in the module: `NAME.append(...)`, `NAME[key] = ...`, `del NAME[key]`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING \
                and isinstance(node.func.value, ast.Name):
            names.add(node.func.value.id)
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else []
        names |= {t.value.id for t in targets if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)}
    return names


def stores(path) -> list[tuple[str, int]]:
    """(name, line) of each mutable module-level store in the file at `path`: a name a function
    rebinds (`global`), a lock, ContextVar or container made by a call, an empty literal, or a
    literal the module changes in place. (A table written out whole and only read is a constant.)"""
    tree = ast.parse(path.read_text())
    rebound = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    changed = mutated(tree)
    found = []
    for node in tree.body:
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        value = node.value
        called = isinstance(value, ast.Call) and ast.unparse(value.func).rsplit(".", 1)[-1] in MUTABLE_CALLS
        literal = isinstance(value, (ast.Dict, ast.List, ast.Set))
        empty = literal and not (value.keys if isinstance(value, ast.Dict) else value.elts)
        for name in (t.id for t in targets if isinstance(t, ast.Name)):
            if name in rebound or called or empty or (literal and name in changed):
                found.append((name, node.lineno))
    return found


def test_each_module_level_store_says_why_it_outlives_a_call():
    unexplained = []
    for path in sorted((ROOT / "orchestrate").rglob("*.py")) + sorted((ROOT / "hydra_plugins").rglob("*.py")):
        lines = path.read_text().splitlines()
        for name, line in stores(path):
            above = line - 2  # the comment block right above the store (or the stores listed with it)
            while above >= 0 and not lines[above].startswith("#") and lines[above].startswith(("_", name)):
                above -= 1
            block = []
            while above >= 0 and lines[above].startswith("#"):
                block.insert(0, lines[above])
                above -= 1
            if not block or not block[0].startswith("# Module state:"):
                unexplained.append(f"{path.relative_to(ROOT)}:{line} {name}")
    assert not unexplained, f"module-level stores without a '# Module state:' comment: {unexplained}"


def test_the_check_finds_stores_and_leaves_constants(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import threading\nLIMITS = {'a': 1}\n_CACHE = {}\nLOCK = threading.Lock()\n_seen = None\n"
                      "STACK = [1]\nNAMES = frozenset({'a'})\ndef f():\n    global _seen\n    _seen = 1\n"
                      "    STACK.append(2)\n")
    assert stores(sample) == [("_CACHE", 3), ("LOCK", 4), ("_seen", 5), ("STACK", 6)]
