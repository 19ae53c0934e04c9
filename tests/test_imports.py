"""The package's layers read top-down: no module imports another that imports it back, directly or
through others, at the top of the file or inside a function (Python resolves a lazy import at call
time, but the two modules still depend on each other). The graph is read from the source with
`ast`, nothing imported: import statements, and imports by name (`by_name`: a module of the
package named in a string that is imported or run, `importlib.import_module("...")`, a command's
table), which count the same."""

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("orchestrate", "hydra_plugins")


def modules() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (`from a import b` counts as an
    import of a.b when that is a module, else of a)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[:len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= resolved(targets, name, known)
    return found | by_name(name, path, known)


def resolved(targets, name: str, known: set[str]) -> set[str]:
    """Each target as the package module it is in (`a.b.c` -> `a.b` where a.b.c is no module)."""
    found = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def by_name(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports by name: a string, other than a docstring, that is a
    module of the package (`"orchestrate.app"`), a module and an attribute (`"orchestrate.commands.up:main_down"`),
    or an f-string that begins with one and a dot (`f"orchestrate.backends.{m}"`: that package)."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    # A logger's name is a module's name, and imports nothing.
    loggers = {id(node.args[0]) for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args
               and getattr(node.func, "attr", getattr(node.func, "id", "")) == "getLogger"}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings | loggers:
            word = node.value.partition(":")[0]
            if word in known and word not in PACKAGES:  # "orchestrate" alone is an experiment's, a logger's name
                words.add(word)
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            prefix = str(node.values[0].value)
            if prefix.endswith(".") and prefix[:-1] in known:
                words.add(prefix[:-1])
    return resolved(words, name, known)


def by_name_graph() -> dict[str, list[str]]:
    known = modules()
    found = {name: sorted(by_name(name, path, set(known))) for name, path in known.items()}
    return {name: targets for name, targets in found.items() if targets}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def test_no_module_imports_in_a_circle():
    g = graph()
    found = cycles(g)
    described = ["; ".join(f"{m} -> {', '.join(sorted(g[m] & set(c)))}" for m in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_lower_layers_do_not_import_upper_ones():
    """The job, tracking and the leaves import no backend, sweep or entry point (arrows point down)."""
    upper = ("orchestrate.backends", "orchestrate.sweeps", "orchestrate.app", "orchestrate.cli", "orchestrate.commands")
    lower = ("orchestrate.job", "orchestrate.tracking", "orchestrate.parallel", "orchestrate.meter",
             "orchestrate.schema", "orchestrate.checkpoints")
    g = graph()
    wrong = {m: sorted(t for t in targets if t.startswith(upper))
             for m, targets in g.items() if m.startswith(lower)}
    assert not {m: t for m, t in wrong.items() if t}


# Imports by name, each a decision: the entry's command table, and the backends the warm pool is
# told to import (by `up`, above it). Nothing below names a module above it (the pool learns what to
# import from `up`; a sweep's warm-up imports the app by a statement).
BY_NAME = {
    "orchestrate.__main__": ["orchestrate.commands.doctor", "orchestrate.commands.server",
                             "orchestrate.commands.slurm_ray", "orchestrate.commands.sync", "orchestrate.commands.up"],
    "orchestrate.commands.up": ["orchestrate.backends"],
    "orchestrate.cluster.warm": ["orchestrate.cluster.pool_process"],  # `up` starts the pool as a program
}


def test_imports_by_name_are_the_ones_listed():
    assert by_name_graph() == BY_NAME


def test_a_by_name_import_is_seen(tmp_path):
    """The reader itself, on a deliberate violation: a lower module naming an upper one in a string."""
    known = {"orchestrate.cluster.pool", "orchestrate.app", "orchestrate.backends"}
    source = tmp_path / "pool.py"
    source.write_text('"""Names orchestrate.app in its docstring only."""\nimport importlib\n'
                      'BASE = ("torch", "orchestrate.app")\n'
                      'def f(m):\n    importlib.import_module(f"orchestrate.backends.{m}")\n')
    assert imports("orchestrate.cluster.pool", source, known) == {"orchestrate.app", "orchestrate.backends"}


def test_the_cluster_layer_imports_nothing_above_it():
    """orchestrate.cluster (Ray, the warm stack, the pool) runs programs above it and names none
    of them, by statement or by name."""
    above = ("orchestrate.app", "orchestrate.cli", "orchestrate.backends", "orchestrate.sweeps", "orchestrate.commands",
             "orchestrate.launch", "orchestrate.__main__")
    g = graph()
    wrong = {m: sorted(t for t in targets if t.startswith(above)) for m, targets in g.items()
             if m.startswith("orchestrate.cluster")}
    assert not {m: t for m, t in wrong.items() if t}


CORE = ("orchestrate.app", "orchestrate.job", "orchestrate.backends", "orchestrate.meter", "orchestrate.tracking")
# What knows the warm stack (its record, its pool, whether a process is a fork): the entry's to ask.
WARM_STACK = ("orchestrate.cluster.warm", "orchestrate.cluster.pool", "orchestrate.cluster.pool_process")
# What the core takes of orchestrate.cluster: the runtime's value, and Ray's joining and placement,
# which knows the warm stack only by that value.
CORE_TAKES = {"orchestrate.cluster.runtime", "orchestrate.cluster.ray_cluster", "orchestrate.cluster.ports"}


def reachable(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in g.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_core_knows_how_it_started_only_by_the_runtime_handed_to_it():
    """The app, the job, the backends, the meter and tracking import nothing of orchestrate.cluster
    but the runtime's value and Ray's plumbing, and reach nothing, through any chain of imports,
    that reads the warm stack's record or asks whether the process is a fork: the entry asks, once."""
    g = graph()
    core = [m for m in g if m.startswith(CORE)]
    direct = {m: sorted(t for t in g[m] if t.startswith("orchestrate.cluster.") and t not in CORE_TAKES) for m in core}
    assert not {m: t for m, t in direct.items() if t}
    reached = {m: sorted(t for t in reachable(g, m) if t.startswith(WARM_STACK)) for m in core}
    assert not {m: t for m, t in reached.items() if t}


def sys_path_edits(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function) of every change to sys.path in the file: an assignment to it or
    to a slice of it, an augmented assignment, or a call of a list method that changes it."""
    tree = ast.parse(path.read_text(), str(path))
    changing = {"insert", "append", "extend", "remove", "pop", "clear", "sort", "reverse", "__setitem__", "__iadd__"}

    def is_sys_path(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name) \
            and node.value.id == "sys"

    found: dict[int, str] = {}  # line -> the innermost function around it ("": the module)
    # ast.walk yields outer functions before the ones inside them: the innermost is written last.
    for function in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        for node in ast.walk(function):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            hit = any(is_sys_path(t) or (isinstance(t, ast.Subscript) and is_sys_path(t.value)) for t in targets)
            hit = hit or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                          and node.func.attr in changing and is_sys_path(node.func.value))
            if hit:
                found[node.lineno] = getattr(function, "name", "")
    return sorted(found.items())


def test_nothing_edits_the_import_path():
    """Code finds the package as installed (editable or from the wheel), never by editing sys.path
    (in any form: an insert, an assignment, a slice), the warm pool's forks included (they keep the
    pool's, and a command whose PYTHONPATH names other folders runs cold: orchestrate.cluster.pool_process)."""
    edits = [f"{path.relative_to(ROOT)}:{line} ({function or 'module'})"
             for folder in ("orchestrate", "hydra_plugins", "tests", "benchmarks", "scripts")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for line, function in sys_path_edits(path)]
    assert not edits, f"sys.path edited at {', '.join(edits)}"


def test_the_path_guard_sees_every_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import sys\nsys.path.insert(0, 'a')\nsys.path = ['b']\ndef f():\n    sys.path[:] = []\n"
                      "    sys.path += ['c']\n    sys.path.extend(['d'])\nprint(sys.path)\n")
    assert sys_path_edits(source) == [(2, ""), (3, ""), (5, "f"), (6, "f"), (7, "f")]


def test_the_commands_that_do_not_train_import_no_torch():
    """`orchestrate server|sync|up|down|slurm-ray` start in a fraction of torch's import: their
    modules (and the boundary they run under) import neither torch nor MLflow nor Ray at import."""
    import subprocess
    import sys

    code = ("import sys; import orchestrate.commands.server, orchestrate.commands.sync, orchestrate.commands.up, "
            "orchestrate.commands.slurm_ray; print(sorted(m for m in ('torch', 'mlflow', 'ray') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
