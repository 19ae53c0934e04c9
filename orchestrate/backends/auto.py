"""backend=auto: try every backend that can take the model for a few steps, from the same initial
weights on the same batches, then train the run on the fastest one whose loss agrees.

    python -m orchestrate backend=auto
    python -m orchestrate backend=auto 'backend.candidates=[torch,ondevice]'
    python -m orchestrate backend=runner backend.engine=auto      # the runner's engine, chosen alike

The story (`AutoBackend.fit`):
1. The candidates: every conf/backend file whose backend trains in one process (a user's own in
   `--config-dir` included), or those `backend.candidates` names.
2. A probe per candidate: the run's own config with that backend, built as `backend=<it>` builds
   it (`Job.prepare`: the same seed gives the same initial weights and the same batches; a backend
   that refuses the config is listed with its reason), trained for `warmup_steps + probe_steps`
   steps aside: no MLflow, no evaluation, checkpoint or export, in a temporary folder. Every probe
   runs on the run's CPU budget (orchestrate.cpu: the same cores, split the same way between
   threads and loader processes, the load of other processes measured once for all); a
   candidate's own `backend.intra_op_threads` wins, and the table's CPU column says so.
3. Its steady samples/s and step time are the meter's over the steps after the warm-up; the
   warm-up window's seconds are kept apart: they hold what the run pays once, again (ORTModule's
   export and graph build, torch.compile's compilation). A candidate's cost for the run is that
   warm-up plus the run's other steps at its step time, so a compiler that saves a millisecond a
   step but takes 30 s to compile is not chosen for a run of 1,000 steps, and is for 100,000.
   The reference is probed first and the compilers last: one whose least compile time
   (`Backend.warmup_floor_s`) is longer than the cheapest finished probe's whole run is not
   probed at all. A probe whose timed steps have already taken so long that this cost can no
   longer be below the cheapest finished probe's stops there (on a CPU that another process keeps busy, PyTorch's
   thread pool can run 20 times slower than idle; its probe then costs seconds, not minutes).
   Each loss is compared with the reference backend's (torch) at the same step; beyond
   `tolerance` the backend disagrees and is not chosen.
4. The run trains with the cheapest that agrees, on the job the app built (its model holds the
   initial weights, the RNG is as it was before probing), in the app's one MLflow run: tagged
   `backend=<chosen>` and `auto=true`, with the probe table as `auto_probe.md` (and on the console).

The runner's `backend.engine=auto` reuses steps 1-3 in its driver, among the engines that run on
its workers (`RunnerBackend.fit`).
"""

import contextlib
import copy
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
from omegaconf import DictConfig

from orchestrate import checkpoints, errors, process, schema
from orchestrate.backends.base import Backend, backend_configs
from orchestrate.job import Checked, Job
from orchestrate.meter import Diverged
from orchestrate.parallel import Parallel
from orchestrate.schema import ABOVE_0, AT_LEAST_1, ConfigError

log = logging.getLogger(__name__)

# Backends auto never probes: those that run workers of their own (the runner) and those that
# choose themselves (auto).
NOT_PROBED = ("distributed", "chooses")
TABLE_FILE = "auto_probe.md"


@dataclass
class AutoBackend(Backend):
    name: str
    warmup_steps: Annotated[int, AT_LEAST_1]  # steps a probe runs before it is timed (graph builds, first allocations)
    probe_steps: Annotated[int, AT_LEAST_1]  # steps timed after the warm-up
    tolerance: Annotated[float, ABOVE_0]  # the largest relative difference from the reference's loss that agrees
    reference: str  # the backend whose probe loss the others are compared with (the eager baseline)
    candidates: Optional[list[str]]  # None: every single-process backend found; a list: only these
    chooses = True
    # resumable stays False: the checkpoints are the chosen backend's, and a resumed run would have
    # to choose that one again without probing. Job.prepare refuses trainer.resume, naming those
    # that can.

    def __post_init__(self) -> None:
        # `found`'s answers, by flags: `check` and `fit` both ask (composing a backend file costs
        # about 0.07 s), and the candidates a run was checked with are those it probes.
        self._found: dict[tuple[str, ...], dict[str, DictConfig]] = {}
        # `check_candidates`' answers, by candidate (its probe config's job, checked, or the
        # refusal). The probes of `choose` take them over: each candidate is built once.
        self._checked: dict[str, Checked] = {}

    def check_precision(self, job) -> None:
        """Nothing here: each candidate checks trainer.precision as its probe is built
        (`check_candidates`), so auto trains in any precision that one of them takes."""

    def check(self, job) -> None:
        self.check_candidates(job, self.found(), "backend=auto")

    def fit(self, job) -> None:
        found = self.found()
        name = self.choose(job, found, "backend=auto", tag="backend")
        # From here on the job is the chosen backend's: its loop, its progress bar's name, its
        # checkpoints and its export.
        job.backend = schema.build(found[name], "backend")
        job.meter.name = job.backend.name
        job.backend.fit(job)

    def read_checkpoint(self, path: Path) -> dict[str, np.ndarray]:
        raise NotImplementedError("backend=auto writes the chosen backend's checkpoints: read them with the backend "
                                  "it chose (the MLflow run's `backend` tag; the runner's `engine` tag)")

    # ---- what the runner's `backend.engine=auto` uses too -------------------------------------
    def found(self, *flags: str) -> dict[str, DictConfig]:
        """The candidates, by name, with their backend configs: every backend file whose class
        sets `flags` and trains in one process, or those `candidates` names (ConfigError for a
        name that is not one of them)."""
        if flags not in self._found:
            self._found[flags] = self.find(flags)
        return self._found[flags]

    def find(self, flags: tuple[str, ...]) -> dict[str, DictConfig]:
        """`found`'s answer, composed."""
        found = backend_configs(*flags, unless=NOT_PROBED)
        if self.candidates is None:
            return found
        if not self.candidates:
            raise ConfigError(f"backend.candidates=[]: name at least one backend; allowed: {', '.join(found)} "
                              "(or null: all of them)")
        for name in self.candidates:
            if name not in found:
                raise ConfigError(f"backend.candidates: {name} is not a backend this can probe; allowed: "
                                  f"{', '.join(found)}")
        return {name: found[name] for name in dict.fromkeys(self.candidates)}

    def check_candidates(self, job, found: dict[str, DictConfig], what: str, cores: float | None = None) -> None:
        """Before any run opens: ConfigError when every candidate refuses the config (each is
        built as its probe builds it, on `cores` CPUs: None, what the process finds; the runner's,
        one worker's). The RNG is left as it was: each build seeds it."""
        with rng_kept():
            for name, node in found.items():
                cfg = self.probe_config(job.cfg, node)
                self._checked[name] = checked_probe(cfg, cores, job.busy_cores)
        reasons = {name: self._checked[name].refused for name in found}
        if all(reasons.values()):
            raise none_takes(what, reasons)

    def choose(self, job, found: dict[str, DictConfig], what: str, tag: str, cores: float | None = None) -> str:
        """Probe every candidate on `job`'s config, pick the shortest run that agrees, print the table,
        keep it with the run (`auto_probe.md`) and tag the run (`tag` = the choice, `auto` =
        true); returns the chosen name. The RNG is put back as it was: the run trains as if no
        probe had run."""
        began = time.perf_counter()
        probes: list[Probe] = []
        after_warmup = max(job.trainer.max_steps - self.warmup_steps, 0)  # the run's steps at the step time
        # The reference first, the backends whose warm-up has a floor (a compiler) last: a run that
        # the others finish sooner than that floor need not wait for it to compile.
        floor = {name: schema.target_of(node, "backend").warmup_floor_s for name, node in found.items()}
        order = sorted(found, key=lambda name: (name != self.reference, floor[name]))
        with rng_kept():
            for name in order:
                cheapest = min((p for p in probes if p.finished), key=lambda p: p.run_s(after_warmup), default=None)
                if cheapest is not None and floor[name] > cheapest.run_s(after_warmup):
                    probes.append(Probe(name, verdict=f"not probed: its warm-up takes at least {floor[name]:g} s, "
                                                      f"longer than {cheapest.name}'s whole run "
                                                      f"({cheapest.run_s(after_warmup):.2f} s)"))
                    continue
                cfg = self.probe_config(job.cfg, found[name])
                probes.append(probe(name, cfg, cheapest, after_warmup, self._checked.pop(name, None), cores,
                                    job.busy_cores))
        choice = judge(probes, self.reference, self.tolerance, what, after_warmup)
        seconds = time.perf_counter() - began
        text = (f"{what}: {self.warmup_steps} warm-up + {self.probe_steps} timed steps per candidate, from the same "
                f"initial weights on the same batches; {choice.compared}; tolerance {self.tolerance:.1%}; the run's "
                f"cost: its warm-up + {after_warmup:,} steps at its step time; probing took "
                f"{seconds:.1f} s\n\n{table(probes, choice.base, after_warmup)}")
        print(text, flush=True)
        path = job.out_dir / TABLE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        job.meter.final["auto_probe_s"] = seconds  # logged with the final metrics (final/auto_probe_s)
        if job.meter.tracker is not None:
            job.meter.tracker.set_tags({tag: choice.chosen.name, "auto": "true"})
            job.meter.tracker.log_artifact(path)
        return choice.chosen.name

    def probe_config(self, cfg: DictConfig, node: DictConfig) -> DictConfig:
        return probe_config(cfg, node, self.warmup_steps, self.probe_steps)


# ---- one probe ------------------------------------------------------------------------------------
@dataclass
class Probe:
    """One candidate's probe: how fast it trained, its losses, and the verdict."""

    name: str
    verdict: str = ""
    samples_per_sec: float = math.nan  # over its timed steps (all of them, or up to where it stopped)
    step_time_ms: float = math.nan
    timed_s: float = math.nan  # the seconds its timed steps took
    warmup_s: float = 0.0  # the seconds of its warm-up steps: an export, a compilation, first allocations
    losses: dict[int, float] = field(default_factory=dict)  # each display window's mean train loss, by its last step
    finished: bool = False  # ran every step and ended with a finite loss
    stopped_at: int | None = None  # the step it stopped at, slower than the fastest finished probe
    loss: float = math.nan  # the loss compared with the reference's (`judge`)
    difference: float = math.nan  # (loss - the reference's) / the reference's, at the same step
    agrees: bool = False  # its loss is within the tolerance of the reference's
    budget: str = ""  # the CPU budget it ran with (orchestrate.cpu.Budget.cell)

    def run_s(self, steps: int) -> float:
        """What the run would take with it: the warm-up again, then `steps` steps at its step time."""
        return self.warmup_s + steps * self.step_time_ms / 1000


class Slower(Exception):
    """A probe's timed steps so far took so long that its run can no longer be the cheapest."""

    def __init__(self, step: int):
        super().__init__(f"slower at step {step}")
        self.step = step


class Stopwatch:
    """A probe's warm-up seconds and timed seconds, window by window from the meter's own step
    times (its display hook). It stops the probe (`Slower`, before its last step) once the timed
    seconds show that its run (`Probe.run_s`, `after_warmup` steps) costs more than `cheapest`'s:
    its timed seconds so far, at most all of them, past the cheapest's by more than the
    cheapest's warm-up saves over its own, scaled from the run's steps to the probe's."""

    def __init__(self, trainer, cheapest: "Probe | None", after_warmup: int):
        self.warmup, self.max_steps = trainer.display_loss_steps, trainer.max_steps
        self.cheapest, self.scale = cheapest, (trainer.max_steps - self.warmup) / max(after_warmup, 1)
        self.seconds, self.warmup_s, self.last = 0.0, 0.0, trainer.display_loss_steps

    def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if step <= self.warmup:  # the warm-up window: kept apart, not timed
            self.warmup_s = metrics["perf/step_time_ms"] * step / 1000
            return
        self.seconds += metrics["perf/step_time_ms"] * (step - self.last) / 1000
        self.last = step
        if self.cheapest is None or step >= self.max_steps:
            return
        budget_s = self.cheapest.timed_s + (self.cheapest.warmup_s - self.warmup_s) * self.scale
        if self.seconds > budget_s:
            raise Slower(step)


class Aside(Parallel):
    """One process, as `Parallel`, that neither evaluates, checkpoints nor exports (what only the
    logging rank does): a probe times the training steps, and pays for nothing else."""

    logging = False

    def __init__(self, cores: float | None = None, busy: Callable[[], float] | None = None):
        # The probe's CPUs (orchestrate.cpu; None: what the process finds), and the cores other
        # processes keep busy as the run measured them: every probe runs on the run's budget.
        self.cores, self.busy = cores, busy


def probe_config(cfg: DictConfig, node: DictConfig, warmup_steps: int, probe_steps: int) -> DictConfig:
    """The run's config with `node` as its backend, as a probe trains it: one process, one batch
    a step (the whole model, no pipeline stages), `warmup_steps + probe_steps` steps, the warm-up as
    the first display window (the meter leaves that one out of its timing), no progress bar. The rate stays at its base value: the
    run's schedule is laid out over the run's own steps, and its warm-up (a rate near 0) would leave
    a short probe's losses equal whatever each backend's update did."""
    probe = copy.deepcopy(cfg)
    probe.backend = node
    t = probe.trainer
    t.max_steps, t.display_loss_steps = warmup_steps + probe_steps, warmup_steps
    t.num_workers, t.min_workers, t.gradient_accumulation_steps, t.pipeline_parallel_size = 1, None, 1, 1
    t.lr_schedule, t.warmup_steps = "constant", 0
    t.progress, t.tensorboard, t.resume = False, False, None
    return probe


def checked_probe(cfg: DictConfig, cores: float | None = None, busy: Callable[[], float] | None = None) -> Checked:
    """The probe config's job, built and checked as its probe runs it (on `cores` CPUs: Aside),
    or why its backend refuses it (its ConfigError's line)."""
    return Checked.of(cfg, lambda: Job.prepare(cfg, parallel=Aside(cores, busy)))


def probe(name: str, cfg: DictConfig, cheapest: Probe | None = None, after_warmup: int = 0,
          checked: Checked | None = None, cores: float | None = None,
          busy: Callable[[], float] | None = None) -> Probe:
    """Train the probe config `cfg` aside and measure it; stopped early once its run (warm-up and
    `after_warmup` steps) costs more than `cheapest`'s (the cheapest probe that finished before
    it). `checked`: `checked_probe`'s answer for `cfg`, taken over instead of building the job
    again (None: built and checked here). The process is left as found
    (orchestrate.process.kept: thread counts, environment, ORT's logging); nothing stays on disk."""
    result = Probe(name)
    with tempfile.TemporaryDirectory(prefix=f"auto_probe_{name}_") as folder, process.kept():
        try:
            job = (checked.take(cfg, folder) if checked is not None else None) or \
                Job.prepare(cfg, folder, parallel=Aside(cores, busy))
        except ConfigError as e:
            result.verdict = f"refused: {e}"
            return result
        watch = Stopwatch(job.trainer, cheapest, after_warmup)
        job.meter.on_display = watch
        try:
            job.backend.fit(job)
        except Slower as e:
            result.stopped_at = e.step
            result.verdict = f"slower than {cheapest.name}: stopped at step {e.step}"
        except Diverged as e:
            result.verdict = f"diverged: {e}"
            return result
        except Exception as e:  # noqa: BLE001 - a backend that fails here is not chosen; the others may do
            log.warning(f"backend=auto: the probe of {name} failed", exc_info=True)  # the job log has the traceback
            result.verdict = f"failed: {errors.one_line(e)}"
            return result
        finally:
            result.budget = job.cpu.cell if job.cpu is not None else ""  # what its loop took (Job.use_cores)
    summary = job.meter.summary()
    result.samples_per_sec = summary.get("samples_per_sec", math.nan)
    result.step_time_ms = summary.get("step_time_ms", math.nan)
    result.timed_s, result.warmup_s = watch.seconds, watch.warmup_s
    result.losses = dict(job.meter.history.get("train/loss", []))
    last = result.losses.get(job.trainer.max_steps, math.nan)
    result.finished = math.isfinite(last)
    if result.stopped_at is None and not result.finished:  # trainer.on_nonfinite=skip dropped its last updates
        result.verdict = f"ended with a loss of {last}"
    return result


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Every RNG state as it was before the block (each probe seeds them to build its model)."""
    state = checkpoints.rng_state()
    try:
        yield
    finally:
        checkpoints.set_rng_state(state)


# ---- the choice -----------------------------------------------------------------------------------
@dataclass
class Choice:
    chosen: Probe
    base: Probe | None  # whose loss the others were compared with (None: no probe finished)
    compared: str  # what the losses were compared with, in words


def judge(probes: list[Probe], reference: str, tolerance: float, what: str, after_warmup: int) -> Choice:
    """Compare the losses with the reference's at the same step (the probes' last, or the one the
    reference stopped at as the slower; when the reference is not a candidate or has no finite
    loss, the first that finished is the reference) and choose the one that agrees whose run
    (`Probe.run_s`: its warm-up, then `after_warmup` steps) is the shortest. A probe stopped as
    slower is not a choice (it can no longer be the cheapest, unless the one that was cheaper
    disagrees; then the reference itself may be the choice), but its loss is compared at the step
    it stopped at, so one both slower and wrong says so. When no probe finished (every
    one diverged, failed, ended on a nan loss or was refused), the reference trains the run all the
    same (or the first that took the config), as it would have without auto: the run then shows why
    (a loss that becomes nan at step 7 does so on every backend, and the run stops there with its
    checkpoints)."""
    finished = [p for p in probes if p.finished]
    named = next((p for p in probes if p.name == reference), None)
    stopped = named is not None and named.stopped_at is not None and math.isfinite(named.losses[named.stopped_at])
    base = named if named in finished or stopped else (finished[0] if finished else None)
    if base is None:
        taken = [p for p in probes if not p.verdict.startswith("refused")]
        if not taken:
            raise none_takes(what, {p.name: p.verdict.removeprefix("refused: ") for p in probes})
        chosen = named if named in taken else taken[0]
        chosen.verdict += "; chosen all the same: no probe ended with a finite loss, and the run shows why"
        return Choice(chosen, None, "no probe ended with a finite loss, no losses compared")
    step = max(base.losses)  # the end of every probe, or where the reference stopped
    compared = finished + ([base] if base not in finished else [])
    for p in compared:
        p.loss = p.losses[step]
    for p in compared:
        p.difference = (p.loss - base.loss) / max(abs(base.loss), 1e-12)
        p.agrees = abs(p.difference) <= tolerance
        if not p.agrees:
            p.verdict = (f"disagrees: loss {p.loss:.4f} against {base.name}'s {base.loss:.4f} ({abs(p.difference):.1%} "
                         f"apart)")
    for p in probes:  # stopped as slower, not the reference: wrong too?
        if p not in compared and p.stopped_at in base.losses and math.isfinite(p.losses.get(p.stopped_at, math.nan)):
            p.loss, then = p.losses[p.stopped_at], base.losses[p.stopped_at]
            p.difference = (p.loss - then) / max(abs(then), 1e-12)
            if abs(p.difference) > tolerance:
                p.verdict = (f"disagrees: loss {p.loss:.4f} against {base.name}'s {then:.4f} at step {p.stopped_at} "
                             f"({abs(p.difference):.1%} apart); {p.verdict}")
    chosen = min((p for p in compared if p.agrees), key=lambda p: p.run_s(after_warmup))
    for p in compared:
        if p is chosen:
            p.verdict = "chosen: the shortest run that agrees"
            if p.stopped_at:  # the reference, slower than one that disagrees
                p.verdict += f" (stopped at step {p.stopped_at})"
        elif p.agrees and not p.stopped_at:
            p.verdict = f"agrees; {p.samples_per_sec / chosen.samples_per_sec:.2f}x the chosen one's samples/s"
            if p.samples_per_sec > chosen.samples_per_sec:  # faster steps, a longer run: its warm-up
                p.verdict += (f", but its {p.warmup_s:.1f} s warm-up makes the run longer ({p.run_s(after_warmup):,.1f} s "
                              f"against {chosen.run_s(after_warmup):,.1f} s)")
    words = f"losses at step {step} compared with {base.name}'s"
    if base is not named:  # e.g. "(torch is not a candidate)", "(torch refused)", "(torch diverged)"
        words += f" ({reference} {named.verdict.split(':')[0] if named else 'is not a candidate'})"
    return Choice(chosen, base, words)


def none_takes(what: str, reasons: dict[str, str]) -> ConfigError:
    return ConfigError(f"{what}: every candidate refuses this config: "
                       + "; ".join(f"{name}: {reason}" for name, reason in reasons.items()))


def table(probes: list[Probe], base: Probe | None, after_warmup: int) -> str:
    """The probes as a markdown table: one row per candidate, in the order probed."""
    def number(value: float, spec: str) -> str:
        return "-" if math.isnan(value) else format(value, spec)

    rows = [f"| backend | CPU: threads + loader of cores | samples/s | step ms | warm-up s | run s | probe loss | "
            f"vs {base.name if base else 'reference'} | verdict |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for p in probes:
        difference = round(p.difference, 4) + 0.0  # a difference of -1e-7 shows as +0.00%, not -0.00%
        timed = not math.isnan(p.step_time_ms)
        rows.append(f"| {p.name} | {p.budget or '-'} | {number(p.samples_per_sec, ',.0f')} | {number(p.step_time_ms, '.3f')} | "
                    f"{number(p.warmup_s if timed else math.nan, '.2f')} | "
                    f"{number(p.run_s(after_warmup), ',.1f')} | "
                    f"{number(p.loss, '.4f')} | {number(difference, '+.2%')} | {p.verdict.replace('|', '/')} |")
    return "\n".join(rows) + "\n"
