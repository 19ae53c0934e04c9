"""A trial of a pruning sweep (hydra/sweeper=orchestrate_optuna), as the training loop sees it.

The sweeper (orchestrate.sweeps._optuna, in the launching process) asks its Optuna study for a
trial and launches it as Hydra job number `trial.number`, with the study's storage and name as
overrides of `hydra.sweeper`. Wherever the job runs (this process, a Ray worker, a Slurm node),
it finds its trial from those (`of_this_job`); the meter then reports every evaluation of
`sweep.metric` to it (`Trial.report`), and the study's pruner, which sees every trial's reports
in the shared storage (or through the sweep's gRPC proxy of it, for trials on other hosts), says
whether this one should stop. A trial that stops records the step in
its Optuna trial (`pruned_at`), where the sweeper reads it to tell the study the trial was pruned.

This module stays light: Optuna is imported at the first report, on the rank that evaluates.
"""

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from orchestrate.schema import listed
from orchestrate.thirdparty import optuna_storage, optuna_trial_id

SWEEPER = "hydra_plugins.orchestrate_optuna_sweeper.optuna_sweeper.OrchestrateOptunaSweeper"
PRUNED_AT = "pruned_at"  # the Optuna trial's user attribute: the step its run stopped at


@dataclass
class Trial:
    """One Optuna trial, reachable from any process that can reach its storage. Pickles (the
    runner sends it to its workers); the study is opened at the first report."""

    storage: str
    study_name: str
    number: int  # the trial's number in its study, which is the Hydra job's number
    metrics: list[str]  # sweep.metric: the objective(s) the pruner is told, as final metrics name them (eval_loss)
    pruner: dict  # hydra.sweeper.pruner: each process builds the same pruner to ask it
    _trial: Any = field(default=None, repr=False, compare=False)
    _storage: Any = field(default=None, repr=False, compare=False)  # what the study was opened with

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_trial": None, "_storage": None}

    def close(self) -> None:
        """Close the connection to a study served over gRPC (the sweep's proxy ends with the
        sweep; an open channel would log its going away)."""
        storage, self._storage, self._trial = self._storage, None, None
        if hasattr(storage, "close"):
            storage.close()

    def report(self, step: int, metrics: dict[str, float], ask: bool = True) -> bool:
        """Tell the study this evaluation (`metrics`: the final metrics as they stand now,
        orchestrate.meter.Meter.so_far); with `ask`, True when its pruner says the trial should
        stop here (then recorded in the trial as `pruned_at`). With several objectives the values
        are recorded for orchestrate.sweeps.dominated, which Optuna's own report refuses."""
        if any(m not in metrics for m in self.metrics):
            return False
        trial = self._open()
        if len(self.metrics) == 1:
            trial.report(float(metrics[self.metrics[0]]), step)
            stop = ask and trial.should_prune()
        else:
            from orchestrate.sweeps import dominated

            trial.set_user_attr(f"{dominated.VALUES_AT}{step}", [float(metrics[m]) for m in self.metrics])
            frozen = optuna_storage(trial.study).get_trial(optuna_trial_id(trial.study, trial=trial))
            stop = ask and trial.study.pruner.prune(trial.study, frozen)
        if stop:
            trial.set_user_attr(PRUNED_AT, step)
        return stop

    def _open(self):
        if self._trial is None:
            import optuna
            from hydra.utils import instantiate

            optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "A new study created" per trial
            self._storage = opened(self.storage)
            study = optuna.load_study(study_name=self.study_name, storage=self._storage,
                                      pruner=instantiate(self.pruner) if self.pruner else None)
            trial_id = optuna_trial_id(study, self.number)
            self._trial = optuna.trial.Trial(study, trial_id)
        return self._trial


STUDY_CONNECT_TIMEOUT_S = 30.0  # the longest a trial waits for the sweep's study server to answer


def opened(storage: str):
    """The study's storage as a trial opens it: its URL, or for `grpc://HOST:PORT` (a study the
    sweep serves to other hosts, orchestrate.sweeps._optuna.served) Optuna's proxy to it, once it
    answers (a RuntimeError naming the host and the URL if it does not within
    STUDY_CONNECT_TIMEOUT_S)."""
    if not storage.startswith("grpc://"):
        return storage
    import socket
    import warnings

    import optuna

    host, _, port = storage.removeprefix("grpc://").rpartition(":")
    with warnings.catch_warnings():  # "GrpcStorageProxy is experimental": on every trial's console
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        proxy = optuna.storages.GrpcStorageProxy(host=host, port=int(port))
    try:
        proxy.wait_server_ready(timeout=STUDY_CONNECT_TIMEOUT_S)
    except ConnectionError:
        raise RuntimeError(f"hydra.sweeper.storage={storage}: the sweep's study did not answer on "
                           f"{socket.gethostname()} within {STUDY_CONNECT_TIMEOUT_S:g} s") from None
    return proxy


def of_this_job(cfg: DictConfig) -> Trial | None:
    """The Optuna trial this Hydra job runs, when it is a trial of a pruning sweep; else None (a
    single run, another sweeper, or a sweep without a pruner)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    sweeper = hydra_cfg.sweeper
    if OmegaConf.select(sweeper, "_target_") != SWEEPER or not sweeper.get("storage") or not sweeper.get("study_name"):
        return None
    pruner = OmegaConf.to_container(sweeper.pruner, resolve=True) if sweeper.get("pruner") else None
    if not pruner or pruner.get("_target_") == "optuna.pruners.NopPruner":
        return None  # nothing will ever be pruned: no report is worth its write to the storage
    return Trial(storage=sweeper.storage, study_name=sweeper.study_name, number=int(hydra_cfg.job.num),
                 metrics=listed(cfg.sweep.metric), pruner=pruner_settings(pruner, cfg.trainer))


# Evaluations a trial makes before the first rung of `min_resource: auto`: its grace period.
GRACE_EVALUATIONS = 2


def pruner_settings(pruner: dict, trainer) -> dict:
    """The pruner's settings as the sweeper and every trial build it, `auto` resources made
    concrete from the trainer. `min_resource: auto` (successive halving, hyperband) is
    GRACE_EVALUATIONS evaluation periods. Not Optuna's own `auto`, which waits for a finished
    trial: the trials that ran before that file the values they report at later steps under the
    early rungs, against which every later trial looks far behind (measured: the best of 16
    char-LM trials pruned at its first evaluation). Not one period either: a trial's first
    evaluation says too little (measured on lr_search, whose best two trials cross after step
    175 of 200: a first rung at the first evaluation pruned the best in 81% of the orders its
    trials could run in; benchmarks/pruner_defaults.py). Hyperband's `max_resource: auto` is
    trainer.max_steps."""
    pruner = dict(pruner)
    period, steps = trainer.evaluation_period, trainer.max_steps
    if pruner.get("min_resource") == "auto" and period > 0:
        pruner["min_resource"] = min(GRACE_EVALUATIONS * period, steps)
    if pruner.get("max_resource") == "auto":
        pruner["max_resource"] = steps
    return pruner
