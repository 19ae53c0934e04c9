"""orchestrate.thirdparty holds every use of another library's internals. Each private name it
lists exists in the installed (pinned) versions, so that a pin that moves and drops one fails
here first, naming the function that needs it; and no other module of the package reaches into a
private module, or reads, calls or assigns a private attribute of another library's object."""

import ast
import importlib
import inspect
import re

import pytest

from orchestrate import thirdparty
from tests.conftest import ROOT

# The one module besides thirdparty that imports a private module, and why (thirdparty's docstring).
EXCEPTIONS = {"hydra_plugins/orchestrate_grid_sweeper/grid_sweeper.py": "hydra._internal.core_plugins.basic_sweeper"}


# Private-looking names that are public: documented in their library's reference.
PUBLIC = {"os._exit"}

# Names read only where ORT's training build runs: the current stack has none.
ORT_ONLY = {"ortmodule_session_options", "standard_symbolics", "ortmodule_logger", "ort_c_value"}


@pytest.mark.parametrize("internal", [pytest.param(i, marks=[pytest.mark.ort] if i.used_by in ORT_ONLY else [])
                                      for i in thirdparty.INTERNALS], ids=lambda i: f"{i.module}:{i.name}")
def test_each_private_name_exists_in_the_pinned_versions(internal):
    module = importlib.import_module(internal.module)
    assert hasattr(thirdparty, internal.used_by), f"{internal.used_by}: not in orchestrate.thirdparty"
    if not internal.name:
        return
    *owners, last = internal.name.split(".")
    target = module
    for part in owners:
        target = getattr(target, part)
    if internal.instance:  # set by each instance: the attribute's assignment is in the class's source
        source = inspect.getsource(target if owners else module)
        assert re.search(rf"self\.{re.escape(last)}\s*[:=]", source), \
            f"{internal.module}.{internal.name} is no longer set (used by thirdparty.{internal.used_by})"
    else:
        assert hasattr(target, last), f"{internal.module}.{internal.name} is gone (used by thirdparty.{internal.used_by})"


def test_every_private_module_the_package_imports_is_listed():
    listed = {i.module for i in thirdparty.INTERNALS}
    for name in set(re.findall(r'from ([\w.]+) import|import ([\w.]+)', inspect.getsource(thirdparty))):
        module = next(filter(None, name))
        if re.search(r"\._\w", module):
            assert any(m == module or m.startswith(f"{module}.") for m in listed), \
                f"thirdparty imports {module}, which INTERNALS does not list"


def is_private(attribute: str) -> bool:
    """`_name`, not `__dunder__` nor a Hydra config key (`_target_`, `_partial_`)."""
    return attribute.startswith("_") and not attribute.startswith("__") and not attribute.endswith("_")


def private_uses(path) -> list[str]:
    """Imports of a private module (a dotted part that starts with `_`), and reads, calls and
    assignments of a private attribute of an object that is not `self` or `cls`, in the file at
    `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and is_private(node.attr) \
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")) \
                and ast.unparse(node) not in PUBLIC:
            found.append(f"line {node.lineno}: reads {ast.unparse(node)}")
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for t in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if (isinstance(t, ast.Attribute) and t.attr.startswith("_") and not t.attr.startswith("__")
                            and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls", "self_"))):
                        found.append(f"line {node.lineno}: assigns .{t.attr}")
            continue
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] not in ("orchestrate", "hydra_plugins", "tests") and any(p.startswith("_") for p in parts[1:]):
                found.append(f"line {node.lineno}: imports {name}")
                break
    return found


def test_no_other_module_reaches_into_a_private_name():
    offenders = {}
    for package in ("orchestrate", "hydra_plugins"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative == "orchestrate/thirdparty.py":
                continue
            uses = [u for u in private_uses(path) if EXCEPTIONS.get(relative, "\0") not in u]
            if uses:
                offenders[relative] = uses
    assert not offenders, f"private names used outside orchestrate/thirdparty.py: {offenders}"


def test_the_check_catches_reads_calls_and_assignments_of_private_names(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("study._storage.get_trial(1)\nerror = ret._return_value\nobj._level = 1\n"
                      "self._mine = cls._ours\ncfg._target_\nos._exit(0)\nfrom ray._private import worker\n")
    assert sorted(private_uses(sample)) == ["line 1: reads study._storage", "line 2: reads ret._return_value",
                                            "line 3: assigns ._level", "line 7: imports ray._private"]
