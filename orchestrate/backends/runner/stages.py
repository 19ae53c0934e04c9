"""Cutting a model into pipeline stages (trainer.pipeline_parallel_size): where it can be cut, where
it is cut, and each stage as a module of its own.

The model's forward is traced with torch.fx down to its units: its own children, and inside a
container (nn.Sequential, nn.ModuleList) the container's children, e.g. `tok, pos, blocks.0,
blocks.1, ln_f, head` for the character transformer, `net.0 ... net.4` for the MLP. A stage
begins at a unit, and a place is a cut only where one tensor alone crosses it (what the previous
stage sends the next): a skip connection across it (a residual, the input used again later) makes
it no cut. The stages are the traced graph cut there, each an fx GraphModule that holds the same
submodule objects under the same names as the model (`blocks.1.attn.qkv.weight`), so a stage's
state_dict is the model's restricted to it: checkpoints, resume and the logged model stay the
whole model's.
"""

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from orchestrate.schema import ConfigError

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


@dataclass
class Cuts:
    """The traced model and the places it can be cut: `units` (the units' names in the order the
    forward calls them), `at` (the unit name -> its node's position for every unit a stage can
    begin at) and each unit's parameter count."""

    graph: torch.fx.Graph
    units: list[str]
    at: dict[str, int]
    params: dict[str, int]

    def choose(self, stages: int, names: list[str] | None) -> list[str]:
        """The units where stages 2..P begin: `names` checked, or the cut that balances the stages'
        parameter counts best (the largest stage as small as it can be)."""
        if names is not None:
            return self._checked(stages, names)
        if len(self.at) < stages - 1:
            raise ConfigError(f"trainer.pipeline_parallel_size={stages}: the model can be cut in {len(self.at)} "
                              f"place(s) ({self.cuttable()}); allowed: pipeline_parallel_size up to {len(self.at) + 1}")
        return self._balanced(stages)

    def _balanced(self, stages: int) -> list[str]:
        """The P-1 places whose largest stage has the fewest parameters: over the places in forward
        order, best[s][j] is the best cut of the units before place j into s stages (a linear
        partition: P x places^2 steps, whatever the model's size)."""
        order = {name: i for i, name in enumerate(self.units)}
        before = list(itertools.accumulate([0] + [self.params[u] for u in self.units]))  # params before unit i
        bounds = [0, *(order[name] for name in self.at), len(self.units)]  # unit indices: start, places, end
        names = [None, *self.at, None]
        best = {(1, j): (before[bounds[j]], ()) for j in range(1, len(bounds))}
        for s in range(2, stages + 1):
            for j in range(s, len(bounds)):
                best[s, j] = min(((max(best[s - 1, i][0], before[bounds[j]] - before[bounds[i]]),
                                   (*best[s - 1, i][1], names[i])) for i in range(s - 1, j)), key=lambda c: c[0])
        return list(best[stages, len(bounds) - 1][1])

    def _checked(self, stages: int, names: list[str]) -> list[str]:
        if len(names) != stages - 1:
            raise ConfigError(f"trainer.pipeline_split={list(names)}: {len(names)} name(s) for "
                              f"pipeline_parallel_size={stages}; allowed: {stages - 1} names, where stages 2..{stages} "
                              f"begin ({self.cuttable()})")
        for name in names:
            if name not in self.at:
                why = "a skip connection or a second value crosses there" if name in self.units else \
                    "the model has no such unit"
                raise ConfigError(f"trainer.pipeline_split: {name!r} is no place to cut ({why}); {self.cuttable()}")
        if [self.at[n] for n in names] != sorted({self.at[n] for n in names}):
            raise ConfigError(f"trainer.pipeline_split={list(names)}: name the places in the order the forward "
                              f"reaches them, each once ({self.cuttable()})")
        return list(names)

    def cuttable(self) -> str:
        return f"the places a stage can begin: {', '.join(self.at) or 'none'}"


def trace(model: nn.Module) -> Cuts:
    """The model's units and the places it can be cut; ConfigError when torch.fx cannot trace its
    forward (control flow that depends on the data) or its output is not one tensor."""

    class Units(torch.fx.Tracer):
        proxy_buffer_attributes = True  # a buffer read in forward (positions[:T]) is a node, not a constant

        def is_leaf_module(self, m: nn.Module, name: str) -> bool:
            return not isinstance(m, CONTAINERS)

    try:
        graph = Units().trace(model)
    except Exception as e:  # noqa: BLE001 - fx says why in its own words
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"trainer.pipeline_parallel_size: {type(model).__name__}'s forward cannot be traced to cut "
                          f"it into stages ({reason[:200]}); a model whose forward is a sequence of submodules can be") from None
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    if not isinstance(output.args[0], torch.fx.Node):
        raise ConfigError(f"trainer.pipeline_parallel_size: {type(model).__name__}'s forward returns "
                          f"{type(output.args[0]).__name__}, not one tensor; pipeline stages need one")
    modules = dict(model.named_modules())
    units = [n.target for n in nodes if n.op == "call_module"]
    params = {u: sum(p.numel() for p in modules[u].parameters()) for u in units}
    at = {}
    for node in nodes:
        if node.op != "call_module" or node.target == units[0] or node.target in at:
            continue
        k = position[node]
        crossing = {n for n in nodes[:k] if n.op != "get_attr" and any(position[u] >= k for u in n.users)}
        if len(crossing) == 1:
            at[node.target] = k
    return Cuts(graph, units, at, params)


def cut(model: nn.Module, stages: int, names: list[str] | None = None) -> list[torch.fx.GraphModule]:
    """The model as `stages` modules, each taking the previous one's output (the first the model's
    input) and the last returning the model's output. A parameter or buffer used on both sides of
    a cut (tied weights) is refused: each stage updates its own."""
    cuts = trace(model)
    begins = [0, *(cuts.at[n] for n in cuts.choose(stages, names)), len(cuts.graph.nodes) - 1]
    nodes = list(cuts.graph.nodes)
    owner = {}
    parts = []
    for s, (a, b) in enumerate(zip(begins, begins[1:])):
        graph, env = torch.fx.Graph(), {}
        if s == 0:
            env[nodes[0]] = graph.placeholder("input")
        else:
            (sent,) = {n for n in nodes[:a] if n.op != "get_attr" and any(u in nodes[a:] for u in n.users)}
            env[sent] = graph.placeholder("input")
        for node in nodes[a:b]:
            if node.op in ("placeholder", "get_attr"):
                continue
            for used in node.all_input_nodes:  # a parameter or buffer read directly, copied where it is read
                if used.op == "get_attr" and used not in env:
                    env[used] = graph.node_copy(used)
            env[node] = graph.node_copy(node, env.__getitem__)
        last = nodes[b] if b == len(nodes) - 1 else next(n for n in nodes[:b] if n in env and
                                                         any(u in nodes[b:] for u in n.users) and n.op != "get_attr")
        graph.output(env[last.args[0]] if last.op == "output" else env[last])
        part = torch.fx.GraphModule(model, graph)
        for name, tensor in itertools.chain(part.named_parameters(), part.named_buffers()):
            if owner.setdefault(id(tensor), s) != s:
                raise ConfigError(f"trainer.pipeline_parallel_size={stages}: {name} is used on both sides of a cut "
                                  f"(tied weights); cut elsewhere ({cuts.cuttable()})")
        parts.append(part)
    return parts
