"""Resuming a stopped run (`trainer.resume`): find the MLflow run with the same config and its
latest finished checkpoint, on disk or as an artifact. Reads the store only, so the entry point can
check `trainer.resume` before anything is written."""

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from orchestrate.schema import ConfigError
from orchestrate.tracking.owner import alive
from orchestrate.tracking.params import config_key, flatten, training_keys
from orchestrate.tracking.stores import absolute_uri

# A run that diverged (its `diverged_at` tag) may also go on with a lower learning rate, or
# skipping non-finite steps, from its last checkpoint before the nan.
RECOVERY_FREE = ("optimizer.lr", "trainer.on_nonfinite")


@dataclass
class ResumePoint:
    """Where a run stopped: its latest finished checkpoint, on disk or as an MLflow artifact."""

    run_id: str
    step: int
    local: Path | None  # the checkpoint file in the run's output folder, when it is still there
    artifact: str | None  # else its artifact path in the run
    uri: str
    changed: dict[str, tuple[str, str]] = field(default_factory=dict)  # a diverged run's: key -> (was, now)

    def fetch(self, folder: Path) -> Path:
        """Copy the checkpoint into `folder` (the new output folder's checkpoints): the next
        resume finds it there even if this attempt stops before its own first checkpoint."""
        folder.mkdir(parents=True, exist_ok=True)
        if self.local is not None:
            return Path(shutil.copy2(self.local, folder / self.local.name))
        from mlflow.tracking import MlflowClient

        got = MlflowClient(tracking_uri=self.uri).download_artifacts(self.run_id, self.artifact, str(folder))
        return Path(got)


def _step_of(name: str) -> int:
    return int(Path(name).name.split("_")[1].split(".")[0])


def find_resume(cfg: DictConfig) -> ResumePoint | None:
    """Resolve `trainer.resume` (auto or a run id) to a checkpoint; bad input is a ConfigError.
    Reads the store only: nothing is written, so it can run before the command starts."""
    want = cfg.trainer.resume
    if not want:
        return None
    uri = cfg.tracking.uri  # as the user wrote it, for messages
    real = absolute_uri(uri)  # for MLflow: one store per URI string in a process
    store = real[len("sqlite:///"):] if real.startswith("sqlite:///") else None
    if store is not None and not os.path.exists(store):  # do not create an empty store by asking
        if want == "auto":
            return None
        raise ConfigError(f"trainer.resume={want}: no MLflow store at {uri}, so no such run")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client, key = MlflowClient(tracking_uri=real), config_key(cfg)
    if want == "auto":
        experiment = client.get_experiment_by_name(cfg.tracking.experiment)
        if experiment is None:
            return None
        runs = client.search_runs([experiment.experiment_id], f"tags.config_key = '{key}'",
                                  order_by=["attributes.start_time DESC"], max_results=50)
        runs = [r for r in runs if r.info.status != "FINISHED"]
        for run in runs:
            point = _latest_checkpoint(client, run, real)
            if point is not None:
                return point
        # Else a run of this config that diverged, continued with a lower learning rate.
        diverged = client.search_runs([experiment.experiment_id], "attributes.status = 'FAILED'",
                                      order_by=["attributes.start_time DESC"], max_results=50)
        for run in diverged:
            changed = differing(cfg, run)
            if recoverable(run, changed):
                point = _latest_checkpoint(client, run, real)
                if point is not None:
                    point.changed = changed
                    return point
        return None
    try:
        run = client.get_run(want)
    except MlflowException:
        raise ConfigError(f"trainer.resume={want}: no such run in {uri}; allowed: auto or a run id") from None
    changed = {}
    if run.data.tags.get("config_key") != key:
        changed = differing(cfg, run)
        if not recoverable(run, changed):
            allowed = (f"; a run that diverged may change {' and '.join(RECOVERY_FREE)} only"
                       if "diverged_at" in run.data.tags else "")
            raise ConfigError(f"trainer.resume={want}: that run was started with another config (differs at "
                              f"{', '.join(list(changed)[:5]) or 'its keys'}); resume it with the same overrides"
                              f"{allowed}")
    point = _latest_checkpoint(client, run, real)
    if point is None:
        raise ConfigError(f"trainer.resume={want}: that run has no checkpoint to resume from "
                          "(set trainer.checkpoint_period to checkpoint during a run)")
    point.changed = changed
    return point


def recoverable(run, changed: dict) -> bool:
    """Whether a run that diverged may go on with these keys changed (RECOVERY_FREE only)."""
    return "diverged_at" in run.data.tags and set(changed) <= set(RECOVERY_FREE)


def differing(cfg: DictConfig, run) -> dict[str, tuple[str, str]]:
    """The training keys whose value in `cfg` differs from `run`'s params: key -> (was, now)."""
    now = flatten(cfg)
    return {k: (v, now.get(k)) for k, v in training_keys(run.data.params).items() if now.get(k) != v}


def close_orphans(cfg: DictConfig, run_id: str) -> list[str]:
    """With `trainer.resume=auto`, once run `run_id` is open: end as KILLED the earlier runs of this
    config that are still RUNNING although their process on this host is gone (a SIGKILL, a lost
    machine). Otherwise a run killed before its first checkpoint, which nothing resumes, would stay
    RUNNING in MLflow for ever. A run whose process still lives (or lived on another host) is left
    alone: it may be training. Returns the ids it ended."""
    import platform

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=absolute_uri(cfg.tracking.uri))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id],
                              f"tags.config_key = '{config_key(cfg)}' and attributes.status = 'RUNNING'",
                              max_results=50)
    ended = []
    for run in runs:
        tags = run.data.tags
        if run.info.run_id == run_id or tags.get("host") != platform.node() or not tags.get("pid", "").isdigit():
            continue
        if alive(int(tags["pid"])):
            continue
        client.set_tag(run.info.run_id, "error", f"its process (pid {tags['pid']}) ended without closing the run; "
                                                 f"trainer.resume=auto went on in run {run_id}")
        client.set_terminated(run.info.run_id, "KILLED")
        ended.append(run.info.run_id)
    return ended


def _latest_checkpoint(client, run, uri: str) -> ResumePoint | None:
    folder = Path(run.data.tags.get("out_dir", "/nonexistent")) / "checkpoints"
    local = sorted(folder.glob("step_*")) if folder.is_dir() else []
    if local:
        return ResumePoint(run.info.run_id, _step_of(local[-1].name), local[-1], None, uri)
    logged = sorted((a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")), key=_step_of)
    if logged:
        return ResumePoint(run.info.run_id, _step_of(logged[-1]), None, logged[-1], uri)
    return None
