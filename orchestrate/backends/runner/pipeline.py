"""Pipeline stages on the runner's workers (trainer.pipeline_parallel_size = P): the model cut into
P stages (stages.py), one per worker, D = num_workers / P data-parallel replicas of each. Rank r
runs stage r // D of replica r % D: a stage's replicas are neighbours in rank order (so
backend.placement_strategy=PACK packs them), and rank 0 is stage 0 of replica 0, which logs.

A step is ORT's pipelined TrainingRunner step: the replica's gradient_accumulation_steps micro-
batches go through the stages in the order the schedule gives (`SCHEDULES`), activations sent
forward and their gradients back with plain point-to-point send and receive (torch.distributed on
gloo or NCCL), then each stage's gradients are averaged over its D replicas alone. The schedules
are orchestrate's own, as ORT's PipelineScheduler was its own: torch.distributed.pipelining's
1F1B hangs on gloo in torch 2.6 (the ORT stack) and its GPipe sums rather than averages there
(measured, docs/pipeline.md), while plain send and receive behave the same in every torch.

Every rank keeps the whole model object, its other stages' weights emptied (`hollow`): the model
is whole again on rank 0 (`assemble`) only where the loop needs it whole, at evaluation,
checkpoint and export steps, from the other stages' replica 0, and emptied again after.
"""

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from orchestrate.backends.runner.collective import Workers
from orchestrate.meter import nonfinite


def gpipe(stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """Fill-drain (GPipe): every micro-batch's forward, then every backward. Idle share
    (P-1)/(M+P-1); every micro-batch's activations held at once."""
    return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]


def one_f_one_b(stage: int, stages: int, micro: int) -> list[tuple[str, int]]:
    """1F1B (PipeDream-flush): P-1-stage forwards to fill the pipeline, then one forward and one
    backward in turn, then the remaining backwards. The same idle share as GPipe; a stage holds at
    most P-stage micro-batches' activations instead of M."""
    warm = min(stages - 1 - stage, micro)
    order = [("F", i) for i in range(warm)]
    for i in range(warm, micro):
        order += [("F", i), ("B", i - warm)]
    return order + [("B", i) for i in range(micro - warm, micro)]


SCHEDULES: dict[str, Callable[[int, int, int], list[tuple[str, int]]]] = {"gpipe": gpipe, "1f1b": one_f_one_b}
NEEDS_STAGES = {"1f1b"}  # schedules whose steady phase needs at least P micro-batches


def check(job, engine) -> None:
    """The pipeline's settings against the run and the model: one line each, before Ray starts."""
    from orchestrate.backends.runner import stages
    from orchestrate.schema import ConfigError

    t = job.trainer
    P, M = t.pipeline_parallel_size, t.gradient_accumulation_steps
    if t.pipeline_schedule not in SCHEDULES:
        raise ConfigError(f"trainer.pipeline_schedule={t.pipeline_schedule!r}: allowed: {', '.join(SCHEDULES)}")
    if P == 1:
        return
    if t.num_workers % P:
        raise ConfigError(f"trainer.pipeline_parallel_size={P} does not divide trainer.num_workers={t.num_workers}: "
                          f"the workers are {P} stages x the data-parallel replicas; allowed: num_workers="
                          f"{P}, {2 * P}, {3 * P}, ...")
    if t.pipeline_schedule in NEEDS_STAGES and M < P:
        raise ConfigError(f"trainer.gradient_accumulation_steps={M}: trainer.pipeline_schedule={t.pipeline_schedule} "
                          f"runs at least as many micro-batches as stages (pipeline_parallel_size={P}); allowed: "
                          f"gradient_accumulation_steps={P} or more, or pipeline_schedule=gpipe")
    if t.elastic:
        raise ConfigError(f"trainer.min_workers={t.min_workers} with trainer.pipeline_parallel_size={P}: an elastic "
                          "run changes its worker count, and every stage needs its worker; drop ~trainer.min_workers")
    if not getattr(engine, "stages", False) and not engine.chooses:  # auto: its candidates train stages
        from orchestrate.backends.base import backends

        raise ConfigError(f"backend.engine={engine.name} with trainer.pipeline_parallel_size={P}: its loop cannot run "
                          f"a stage of the model; allowed engines: {', '.join(backends('stages'))}")
    if t.precision.value != "fp32":
        raise ConfigError(f"trainer.precision={t.precision.value} with trainer.pipeline_parallel_size={P}: stages "
                          "train in fp32; allowed: trainer.precision=fp32")
    stages.cut(job.model, P, t.pipeline_split)


class Stages(Workers):
    """The parallel context of one rank of a pipelined run: its stage, its replica, the ranks
    beside it, and the step that runs the schedule."""

    def __init__(self, rank: int, world_size: int, device: torch.device, stages: int, schedule: str,
                 split: list[str] | None, check_replicas: bool = True, cores: float | None = None):
        super().__init__(rank, world_size, device, check_replicas=check_replicas, cores=cores)
        self.stages, self.schedule, self.split = stages, schedule, split
        self.stage = rank // self.replicas
        self.first, self.last = self.stage == 0, self.stage == stages - 1
        self.before = rank - self.replicas  # the same replica's previous stage
        self.after = rank + self.replicas
        # Each stage's replicas average their gradients among themselves; every rank makes every
        # group, in the same order (torch.distributed's rule).
        for s in range(stages):
            group = dist.new_group(list(range(s * self.replicas, (s + 1) * self.replicas)))
            if s == self.stage:
                self.group = group
        self.parts: list[torch.nn.Module] = []
        self.shapes: list[tuple[tuple[int, ...], torch.dtype]] = []  # what crosses each cut, per sample
        self.others: dict[str, tuple[torch.Tensor, torch.Size]] = {}  # the other stages' tensors, emptied
        self.whole = False  # rank 0: the model assembled
        self.rngs: list[dict] = []  # rank 0, at a checkpoint step: every stage's RNG state
        self._bad_grads = torch.zeros((), device=device)
        self.steps_timed, self.seconds, self.waited = -1, 0.0, 0.0  # the schedule's time and its waits (the first step left out)

    # ---- the model --------------------------------------------------------------------------------
    def part(self, model: torch.nn.Module, sample: Callable[[], torch.Tensor]) -> torch.nn.Module:
        """This rank's stage of `model` (built whole, from the seed, on every rank), the shapes that
        cross each cut measured on `sample()` (the data's sample input: each sample's shape, the
        batch dimension aside), and the other stages' weights emptied: this worker holds and trains
        its stage alone."""
        from orchestrate.backends.runner.stages import cut

        self.parts = cut(model, self.stages, self.split)
        # In eval mode, on a forked RNG: the probe updates no BatchNorm statistics and draws no dropout.
        was_training = model.training
        model.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            x = sample().to(self.device)
            for p in self.parts[:-1]:
                x = p(x)
                self.shapes.append((tuple(x.shape[1:]), x.dtype))
        model.train(was_training)
        order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
        self.indices = [[order[name] for name, _ in p.named_parameters()] for p in self.parts]
        mine = {id(t) for t in self.parts[self.stage].state_dict(keep_vars=True).values()}
        self.others = {name: (t, t.shape) for name, t in model.state_dict(keep_vars=True).items() if id(t) not in mine}
        self.hollow()
        return self.parts[self.stage]

    def hollow(self) -> None:
        """Empty the other stages' weights (their memory freed; shapes kept for `assemble`)."""
        for tensor, _ in self.others.values():
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        self.whole = False

    def assemble(self, step: int, optimizer: torch.optim.Optimizer, trainer) -> dict | None:
        """At evaluation and checkpoint steps (every rank alike): the whole model's weights on rank
        0 (each stage's replica 0 sends its own), and at a checkpoint step the whole model's
        optimizer state, which rank 0 returns (numbered as the one-process run numbers it)."""
        if not (trainer.due(step, trainer.evaluation_period) or trainer.due(step, trainer.checkpoint_period)):
            return None
        return self._assemble(optimizer if trainer.due(step, trainer.checkpoint_period) else None)

    def _assemble(self, optimizer: torch.optim.Optimizer | None) -> dict | None:
        senders = [s * self.replicas for s in range(1, self.stages)]
        if self.rank == 0:
            for s, source in enumerate(senders, start=1):
                for name in self.parts[s].state_dict():
                    if name in self.others:
                        tensor, shape = self.others[name]
                        tensor.data = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
                        dist.recv(tensor.data, source)
            self.whole = True
        elif self.rank in senders:
            for tensor in self.parts[self.stage].state_dict().values():
                dist.send(tensor.contiguous(), 0)
        if optimizer is None:
            return None
        return self._optimizer_state(optimizer, senders)

    def _optimizer_state(self, optimizer: torch.optim.Optimizer, senders: list[int]) -> dict | None:
        """The stages' optimizer states as the whole model's, on rank 0; each stage's RNG state
        beside them (`checkpoint_extra`): a stage's dropout draws its own numbers."""
        from orchestrate.checkpoints import rng_state

        mine = [optimizer.state_dict(), rng_state()]
        if self.rank in senders:
            dist.send_object_list(mine, 0)
        if self.rank != 0:
            return None
        states = [mine]
        for source in senders:
            got = [None, None]
            dist.recv_object_list(got, source)
            states.append(got)
        self.rngs = [rng for _, rng in states]
        return merge_states([state for state, _ in states], self.indices)

    def checkpoint_extra(self) -> dict:
        """What a checkpoint holds beyond the one-process run's: every stage's RNG state."""
        return {"rng_stages": self.rngs}

    def own_part(self, state: dict) -> dict:
        """A checkpoint (the whole model's) with this stage's part of its optimizer state and this
        stage's RNG state (one written without stages: rank 0's, as every data-parallel rank's)."""
        rng = state["rng_stages"][self.stage] if "rng_stages" in state else state["rng"]
        return {**state, "optimizer": split_state(state["optimizer"], self.indices[self.stage]), "rng": rng}

    # ---- a step -------------------------------------------------------------------------------
    def run(self, model: torch.nn.Module, batch: Callable[[int], tuple], loss_of: Callable, micro: int) -> torch.Tensor:
        """One step's forwards and backwards of `micro` micro-batches through this stage, in the
        schedule's order; then the stage's gradients averaged over its replicas. Returns the step's
        loss (the mean over the global batch) on every rank; a nan or inf in any stage's gradients
        is kept for `hold`."""
        if self.whole:  # assembled for the last step's evaluation or checkpoint: this stage's alone again
            self.hollow()
        inputs, outputs, sends = {}, {}, []
        loss_sum = torch.zeros((), device=self.device)
        began, waited = time.perf_counter(), 0.0
        for kind, i in SCHEDULES[self.schedule](self.stage, self.stages, micro):
            if kind == "F":
                x, y = batch(i)
                if self.first:
                    inp = x
                else:
                    shape, dtype = self.shapes[self.stage - 1]
                    inp = torch.empty((len(y), *shape), dtype=dtype, device=self.device)
                    waited -= time.perf_counter()
                    dist.recv(inp, self.before)
                    waited += time.perf_counter()
                    inp.requires_grad_(inp.is_floating_point())
                out = model(inp)
                if self.last:
                    out = loss_of(out, y)
                    loss_sum += out.detach()
                else:
                    sends.append(dist.isend(out.detach(), self.after))
                inputs[i], outputs[i] = inp, out
            else:
                inp, out = inputs.pop(i), outputs.pop(i)
                if self.last:
                    out.backward()
                else:
                    grad = torch.empty_like(out)
                    waited -= time.perf_counter()
                    dist.recv(grad, self.after)
                    waited += time.perf_counter()
                    out.backward(grad)
                if not self.first and inp.grad is not None:
                    sends.append(dist.isend(inp.grad, self.before))
        waited -= time.perf_counter()
        for sent in sends:
            sent.wait()
        waited += time.perf_counter()
        self.steps_timed += 1
        if self.steps_timed > 0:  # the first step's waits are the other stages' warm-up
            self.seconds += time.perf_counter() - began
            self.waited += waited
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if self.replicas > 1 and grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat /= self.replicas
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        # One exchange for the step: the loss (the last stage's, per replica) and whether any
        # stage's gradients hold a nan or inf, on every rank.
        bad = nonfinite(torch.nn.utils.get_total_norm(grads)) if grads else torch.zeros((), device=self.device)
        both = torch.stack([loss_sum if self.last else torch.zeros_like(loss_sum), bad.float()])
        dist.all_reduce(both)
        self._bad_grads = both[1]
        return both[0] / self.replicas

    def timings(self) -> dict[str, float]:
        """The share of this stage's schedule time spent waiting for the stages beside it (the
        pipeline's bubble, plus what the network adds), over the steps after the first."""
        return {"pipeline_idle_share": self.waited / self.seconds} if self.seconds else {}

    # ---- the meter's and the loop's hooks -----------------------------------------------------
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # no DDP: `run` averages a stage's gradients over its replicas itself

    def hold(self, loss, grads) -> torch.Tensor:
        """Hold the update when the loss or any stage's gradients are not finite: every rank has
        both from `run`'s exchange, so all decide alike."""
        return torch.maximum(nonfinite(loss), (self._bad_grads > 0).float())

    def update_allowed(self, finite: bool, grads) -> bool:
        return finite and not bool(self._bad_grads.item())

    def norms(self, found: dict[str, float]) -> dict[str, float]:
        """The whole model's gradient and parameter norms from each stage's (the same on a stage's
        replicas): the square root of the stages' summed squares."""
        keys = [k for k in ("train/param_norm", "train/grad_norm") if k in found]
        squares = torch.tensor([found[k] ** 2 if self.replica == 0 else 0.0 for k in keys], dtype=torch.float64)
        dist.all_reduce(squares)
        return {**found, **{k: v ** 0.5 for k, v in zip(keys, squares.tolist())}}


def merge_states(states: list[dict], indices: list[list[int]]) -> dict:
    """The stages' optimizer states (each one parameter group) as one optimizer's over the whole
    model: stage s's i-th parameter is the model's `indices[s][i]`-th, as a one-process run numbers
    them, so the checkpoint is the one a one-process run writes."""
    merged, groups = {}, []
    for state, index in zip(states, indices):
        (group,) = state["param_groups"]
        for i, own in enumerate(group["params"]):
            if own in state["state"]:
                merged[index[i]] = state["state"][own]
        groups = groups or [dict(group)]
    groups[0]["params"] = list(range(sum(len(i) for i in indices)))
    return {"state": dict(sorted(merged.items())), "param_groups": groups}


def split_state(state: dict, index: list[int]) -> dict:
    """`merge_states` undone for one stage, whose i-th parameter is the model's `index[i]`-th."""
    (group,) = state["param_groups"]
    return {"state": {i: state["state"][g] for i, g in enumerate(index) if g in state["state"]},
            "param_groups": [{**group, "params": list(range(len(index)))}]}
