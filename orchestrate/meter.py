"""The meter: what a training loop reports as it goes. It counts the steps (with a progress bar),
averages the train loss and times the steps between displays, runs evaluation at its period,
and sends every metric to the history (the loss-curve chart), to MLflow and, when asked, to
TensorBoard. Every backend's loop reports through it, so every backend logs the same names:

  train/loss, perf/samples_per_sec, perf/step_time_ms, lr      every trainer.display_loss_steps
  eval/loss, eval/accuracy                                       every trainer.evaluation_period

In a pruning sweep (hydra/sweeper=orchestrate_optuna) the meter also tells the trial's study every
evaluation, and `stop_early` ends the loop at the step where the study's pruner says so.
"""

import bisect
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from orchestrate.schema import NonFinite, TrainerConf


class Diverged(RuntimeError):
    """The loss (or the gradient norm) became nan or inf with trainer.on_nonfinite=stop. Its text
    is what the MLflow run's `error` tag says: `loss became nan at step 12`."""

    def __init__(self, what: str, value: float | str, step: int):
        super().__init__(f"{what} became {value} at step {step}")
        self.what, self.value, self.step = what, value, step


def nonfinite(loss):
    """1.0 where the loss tensor is nan or inf, else 0.0, as a float tensor on its device, computed
    there (nothing waits): the flag a fused optimizer reads as its `found_inf`."""
    return loss.isfinite().logical_not().float()


def reset_peak_rss() -> None:
    """Start the process's resident-memory high-water mark again from what it holds now (Linux's
    /proc/self/clear_refs), so that a run in a process that ran others before (a Ray worker's
    second trial, a warm pool's fork) reports its own peak; elsewhere the lifetime's mark stays.
    The one piece of process state a run changes for good: the kernel's counter has no way back,
    and `getrusage`'s ru_maxrss reads the same counter."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """The process's resident-memory high-water mark (MiB) since it started or `reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def world_sizes(history: dict[str, list[tuple[int, float]]]) -> list[int]:
    """The worker counts a run trained with, in order: its `world_size` metric (the runner logs it
    at each display step), each change once."""
    sizes: list[int] = []
    for _, value in history.get("world_size", []):
        if not sizes or sizes[-1] != int(value):
            sizes.append(int(value))
    return sizes


class Meter:
    def __init__(self, trainer: TrainerConf, name: str, lr: float, samples_per_step: int, out_dir: Path | None,
                 tracker: Any = None, logging: bool = True, paused: Callable[[], float] = lambda: 0.0,
                 update_allowed: Callable[[bool, Callable], bool] = lambda finite, grads: finite,
                 agree: Callable[[bool], bool] = lambda flag: flag,
                 summed: Callable[[list[float]], list[float]] = lambda values: values,
                 hold: Callable[[Any, Callable], Any] = lambda loss, grads: nonfinite(loss)):
        self.trainer, self.name, self.lr, self.out_dir = trainer, name, lr, out_dir
        self.samples_per_step = samples_per_step  # the runner: batch x accumulation x workers
        self.tracker = tracker  # orchestrate.tracking.logger.RunLogger, or None (not tracked, or not rank 0)
        self.logging = logging  # False on the runner's other workers: no bar, no evaluation
        self.paused = paused  # seconds spent outside the steps (checkpoints), left out of step times
        self.update_allowed = update_allowed  # the runner's workers decide alike (Parallel.update_allowed)
        self.agree = agree  # Parallel.agree: true when true on every rank
        self.summed = summed  # Parallel.sum_: numbers summed over the ranks (the logged loss is the global batch's)
        self.hold = hold  # Parallel.hold: update_allowed's answer on the device, as a flag (1.0: hold)
        # A pruning sweep's trial (orchestrate.sweeps.pruning.Trial) on every rank, or None: it is
        # told each evaluation (on the rank that evaluates) and its pruner may end the run early.
        self.trial = None
        self.pruned_at: int | None = None  # the step the pruner stopped the run at
        self._prune = False  # the pruner's answer at the last evaluation
        self.skipped = 0  # updates dropped for a nan or inf loss (trainer.on_nonfinite=skip)
        self.step = 0  # the step under way (0: training has not begun)
        self.on_display: Callable[[int, dict[str, float]], None] | None = None  # the runner's report to Ray
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.final: dict[str, float] = {}
        self.logged_steps: dict[str, set[int]] = {}  # a resumed run: the steps MLflow holds, per metric
        self.tensorboard = None  # trainer.tensorboard: a SummaryWriter, opened at the first metric
        self.peak_rss_mb = 0.0  # the process's RSS high-water mark at the last display step (`_display`)
        self._timed_steps, self._timed_seconds = 0, 0.0
        self._first_window = (0, 0.0)  # the steps and seconds of the first display window, left out of the timing
        # What the device has not told yet (`record` with on_device=True): each step's loss and
        # whether its update was held, as tensors, read in one go at the next reading step.
        self._unread: list[tuple[int, Any, Any]] = []
        self._held = None  # trainer.on_nonfinite=stop: 1.0 on the device from the first bad step on

    def steps(self, start: int = 1) -> Iterator[int]:
        """Yield 1-based step numbers with a progress bar; time the steps between displays."""
        t = self.trainer
        if t.device.value == "cuda":  # the peak of this loop's tensors (`summary`), in the process that trains
            import torch

            torch.cuda.reset_peak_memory_stats()
        self._window_loss, self._window_losses, self._window_steps, self._excluded = 0.0, 0, 0, 0.0
        self._window_start = self._run_start = time.perf_counter()
        self._paused_at_start = self.paused()
        self._bar = tqdm(total=t.max_steps, initial=start - 1, disable=not (t.progress and self.logging),
                         unit="step", dynamic_ncols=True, mininterval=0.2 if os.isatty(2) else 10.0, desc=self.name)
        try:
            for step in range(start, t.max_steps + 1):
                self.step = step  # the step under way: an error's line names it
                yield step
                self._bar.update()
        finally:  # also when the loop stops early (stop_early): the generator is closed
            self._bar.close()
            self.final["wall_time_s"] = time.perf_counter() - self._run_start
            self.final["steps_run"] = max(0, self.step - start + 1)  # by this process (a resumed run: fewer)

    def displaying(self, step: int) -> bool:
        return self.trainer.due(step, self.trainer.display_loss_steps)

    def reads(self, step: int) -> bool:
        """Whether the loop reads its numbers back at `step`: display, evaluation and checkpoint
        steps (and the last). Between them a loop that keeps its losses on the device
        (`record(on_device=True)`) never waits for it."""
        t = self.trainer
        return self.displaying(step) or t.due(step, t.evaluation_period) or t.due(step, t.checkpoint_period)

    def record(self, step: int, loss, grad_norm: float | None = None, grads: Callable[[], list] = lambda: [],
               on_device: bool = False):
        """After the step's backward, before its update, on every rank: the step's loss (a float,
        or with `on_device` a 0-dim tensor on the loop's device), logged as the mean over each
        display window. Returns what holds the update: False (apply it), True (drop it), or, with
        `on_device` between reading steps, a float tensor on the device, 1.0 to hold it, which the
        optimizer reads itself (`orchestrate.backends.torch.update`), so that nothing waits.

        The divergence guard: a nan or inf loss (or gradient norm, where the loop computed one)
        never changes the weights. With trainer.on_nonfinite=stop it raises Diverged naming its
        step, at that step or, decided on the device, at the next reading step (every update in
        between held too), before the weights change again or a checkpoint is written; with skip
        its update is dropped, counted in train/skipped_steps. On the runner every rank takes the
        same decision, from `grads()` (the all-reduced gradients)."""
        if on_device and not self.reads(step):
            held = self.hold(loss, grads)  # decided on the device: nothing is read here
            if self.trainer.on_nonfinite == NonFinite.stop:  # every update after a bad one is held too
                held = self._held = held if self._held is None else self._held.maximum(held)
            self._unread.append((step, loss, held))  # counted in the window when read
            return held
        if not isinstance(loss, (float, int)):  # a tensor
            loss = self._read(loss)  # one wait for the device: the steps since the last read, and this one
        held = not self.finite(step, loss, grad_norm, grads)
        self._add(loss)
        if self.displaying(step):
            self._display(step)
        return held

    def _read(self, loss) -> float:
        """The losses and holds of the steps the device has not told yet, read in one go, then
        taken in step order as the host would have taken them (a held step: Diverged with stop,
        counted with skip); returns this step's `loss` as a float."""
        import torch

        unread, self._unread, self._held = self._unread, [], None
        values = torch.stack([t.float() for _, lo, h in unread for t in (lo, h)] + [loss.float()]).tolist()
        for i, (step, _, _) in enumerate(unread):
            self._add(values[2 * i])
            if values[2 * i + 1]:  # held: this rank's loss (or another rank's, or a gradient) was not finite
                self._not_finite(step, values[2 * i], None)
        return values[-1]

    def finite(self, step: int, loss: float, grad_norm: float | None = None,
               grads: Callable[[], list] = lambda: []) -> bool:
        """The host's decision for one step (`record` takes it): True to apply its update."""
        finite = math.isfinite(loss) and (grad_norm is None or math.isfinite(grad_norm))
        if self.update_allowed(finite, grads):
            return True
        self._not_finite(step, loss, grad_norm)
        return False

    def _not_finite(self, step: int, loss: float, grad_norm: float | None) -> None:
        """A step whose update did not happen: Diverged (stop), or one more skipped step (skip)."""
        if self.trainer.on_nonfinite == NonFinite.stop:
            if not math.isfinite(loss):
                raise Diverged("loss", loss, step)
            if grad_norm is not None and not math.isfinite(grad_norm):
                raise Diverged("gradient norm", grad_norm, step)
            raise Diverged("loss", "nan or inf on another worker", step)  # this rank's numbers are fine
        self.skipped += 1
        self.final["skipped_steps"] = self.skipped
        self.log({"train/skipped_steps": self.skipped}, step)

    def _add(self, loss: float) -> None:
        """One more step in the display window; a skipped step's nan or inf loss counts for the
        throughput, not for the mean loss."""
        if math.isfinite(loss):
            self._window_loss += loss
            self._window_losses += 1
        self._window_steps += 1

    def _display(self, step: int) -> None:
        """Log the display window that ends at `step`: mean loss, throughput, step time, rate."""
        now, paused = time.perf_counter(), self.paused()
        seconds = now - self._window_start - self._excluded - (paused - self._paused_at_start)
        # Each rank's losses are weighted (Job.loss_weight) so that their mean over the ranks is the
        # loss of the step's whole global batch: that mean is what is logged, at any worker count.
        loss, losses = self.summed([self._window_loss, self._window_losses])
        mean_loss = loss / losses if losses else math.nan
        metrics = {
            "train/loss": mean_loss,
            "perf/samples_per_sec": self._window_steps * self.samples_per_step / seconds,
            "perf/step_time_ms": 1000.0 * seconds / self._window_steps,
            "lr": self.lr * self.trainer.lr_factor(step - 1),
        }
        # The first window holds graph builds and warm-up: it is logged, not counted in the totals.
        if self._timed_steps or self._window_steps == self.trainer.max_steps or step > self.trainer.display_loss_steps:
            self._timed_steps += self._window_steps
            self._timed_seconds += seconds
        else:
            self._first_window = (self._window_steps, seconds)
        self.log(metrics, step)
        self.final["train_loss"] = mean_loss
        # At the last display step: training's peak (before the last step's evaluation, checkpoint
        # and export), the runner's `perf/peak_rss_mb`.
        self.peak_rss_mb = peak_rss_mb()
        self._bar.set_postfix(loss=f"{mean_loss:.4f}", samples_s=f"{metrics['perf/samples_per_sec']:,.0f}", refresh=False)
        if self.on_display is not None:
            self.on_display(step, metrics)
        self._window_loss, self._window_losses, self._window_steps, self._excluded = 0.0, 0, 0, 0.0
        self._window_start, self._paused_at_start = time.perf_counter(), self.paused()

    def evaluate(self, step: int, run_eval: Callable[[], tuple[float, float | None]]) -> None:
        """Run `run_eval() -> (loss, accuracy or None)` at evaluation steps and log the result."""
        if not (self.logging and self.trainer.due(step, self.trainer.evaluation_period)):
            return
        began = time.perf_counter()
        loss, accuracy = run_eval()
        metrics = {"eval/loss": loss}
        if accuracy is not None:
            metrics["eval/accuracy"] = accuracy
        self.log(metrics, step)
        self.final.update({k.replace("/", "_"): v for k, v in metrics.items()})
        msg = f"step {step}: eval loss {loss:.4f}" + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
        if self.trial is not None:
            # At the last step the trial is complete whatever the pruner would say.
            self._prune = self.trial.report(step, self.so_far(), ask=step < self.trainer.max_steps)
            msg += "; the sweep's pruner stops this trial here" if self._prune else ""
        self._bar.write(f"[{self.name}] {msg}")
        self._excluded += time.perf_counter() - began

    def stop_early(self, step: int) -> bool:
        """After the step's evaluation and checkpoint, on every rank: True when training ends here,
        before trainer.max_steps, because the sweep's pruner stopped this trial. The logging rank
        evaluates and asks the pruner; the others take its answer (`agree`: all ranks stop at the
        same step, or they would wait on each other for ever). Nothing to decide outside a pruning
        sweep, or between evaluations."""
        t = self.trainer
        if self.trial is None or step >= t.max_steps or not t.due(step, t.evaluation_period):
            return False
        if not self.agree(self._prune or not self.logging):
            return False
        self.pruned_at = self.final["pruned_at"] = step
        return True

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Keep `metrics` in the history and send them to MLflow (and TensorBoard)."""
        if self.logged_steps:
            metrics = {k: v for k, v in metrics.items() if step not in self.logged_steps.get(k, ())}
        for k, v in metrics.items():
            bisect.insort(self.history.setdefault(k, []), (step, v))  # an append, but for a gap a resume fills
        if self.tracker is not None and metrics:
            self.tracker.log_metrics(metrics, step)
            if self.trainer.tensorboard:
                self._tensorboard(metrics, step)

    def continue_history(self, logged: dict[str, list[tuple[int, float]]]) -> None:
        """A resumed run: take over the curves already in MLflow, and log no step of them again.
        Steps between the last checkpoint and a crash may be there, but not necessarily all of
        them: MLflow's asynchronous logging writes its batches from several threads, and a killed
        process left steps 21 and 23 in the store without 22. So every step not there is logged."""
        self.history = {k: list(v) for k, v in logged.items()}
        self.logged_steps = {k: {s for s, _ in v} for k, v in logged.items()}

    def so_far(self) -> dict[str, float]:
        """The final metrics as they stand now (orchestrate.schema.SWEEP_METRICS), for a sweep's
        pruner at an evaluation: the last evaluation and train loss, the seconds so far, the
        throughput of the steady steps so far, the memory peak so far."""
        now = {k: v for k, v in self.final.items() if k in ("train_loss", "eval_loss", "eval_accuracy")}
        now["wall_time_s"] = time.perf_counter() - self._run_start
        now["peak_rss_mb"] = self.peak_rss_mb
        return {**now, **self.speed()}

    def speed(self) -> dict[str, float]:
        """Throughput and step time over the timed steps, and the first window's warm-up: its
        seconds beyond its steps at the steady step time (export, graph build, compile)."""
        if not self._timed_steps:
            return {}
        step_s = self._timed_seconds / self._timed_steps
        steps, seconds = self._first_window
        return {"samples_per_sec": self.samples_per_step / step_s, "step_time_ms": 1000.0 * step_s,
                "warmup_s": max(0.0, seconds - steps * step_s)}

    def summary(self) -> dict[str, float]:
        """The final metrics: last train loss, last eval, throughput, step time and warm-up over
        the timed steps, the memory peak while training (the runner's driver has its workers')."""
        self.final.update(self.speed())
        if self.peak_rss_mb and "peak_rss_mb" not in self.final:
            self.final["peak_rss_mb"] = self.peak_rss_mb
        if self.trainer.device.value == "cuda" and self.step and "peak_cuda_mb" not in self.final:
            import torch  # torch's allocator: every backend's tensors but the on-device API's (ORT's own arena)

            self.final["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return dict(self.final)

    def close(self) -> None:
        """The end of training: the TensorBoard event files are complete, log them too."""
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tracker.log_artifacts(self.out_dir / "tensorboard", "tensorboard")
            self.tensorboard = None

    def _tensorboard(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer().add_scalar(k, v, step)

    def _writer(self):
        if self.tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(self.out_dir / "tensorboard"))
        return self.tensorboard

    def histograms(self, named, step: int) -> None:
        """TensorBoard's histogram and norm summaries (ORT's TrainingRunner writes them beside its
        scalars): at a display step, with trainer.tensorboard=true, on the logging rank, each
        parameter's weights and gradients as histograms (`weights/<name>`, `gradients/<name>`) and
        their norms (`norms/...`). `named`: (name, parameter) pairs; an emptied one (another pipeline
        stage's) is left out. A display step reads its numbers anyway; no other step calls this."""
        if not (self.trainer.tensorboard and self.logging and self.tracker is not None):
            return
        writer = self._writer()
        for name, p in named:
            if p.numel() == 0:
                continue
            for kind, tensor in (("weights", p.detach()), ("gradients", p.grad)):
                if tensor is not None:
                    writer.add_histogram(f"{kind}/{name}", tensor.float(), step)
                    writer.add_scalar(f"norms/{kind}/{name}", tensor.float().norm().item(), step)
