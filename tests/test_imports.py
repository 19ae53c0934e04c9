"""The package's layers read top-down: no module imports another that imports it back, directly or
through others, at the top of the file or inside a function (Python resolves a lazy import at call
time, but the two modules still depend on each other). The graph is read from the source with
`ast`, nothing imported."""

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
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


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


def test_nothing_edits_the_import_path():
    """Code finds the package as installed (editable or from the wheel), never by editing sys.path."""
    edits = [f"{path.relative_to(ROOT)}:{number}"
             for folder in ("orchestrate", "hydra_plugins", "tests", "benchmarks", "scripts")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if ("sys.path." + "insert") in line or ("sys.path." + "append") in line]
    assert not edits, f"sys.path edited at {', '.join(edits)}"


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
