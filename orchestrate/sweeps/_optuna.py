"""The asynchronous Optuna sweeper's work (hydra_plugins.orchestrate_optuna_sweeper), imported
when a sweep starts. In order:

1. The search space: `hydra.sweeper.params` and the command line's sweeps, read as Hydra's Optuna
   sweeper reads them, become Optuna distributions; the other overrides are fixed for every trial.
2. The study: in a database beside the MLflow store, named after the sweep, so that the same sweep
   run again finds it: its finished and pruned trials count, a trial an earlier attempt left
   running (the process was killed) is failed and its parameters run again. Trials on a Ray
   cluster's other hosts reach a SQLite study through Optuna's gRPC proxy, served from here
   (`served`, orchestrate.sweeps.remote).
3. The slots: as many trials run at once as the launcher can run, and on Ray a
   few more launched ahead, waiting in Ray's queue to start the moment a slot frees. Each trial
   is launched alone (`launcher.launch([overrides], trial.number)`), from its own thread when
   there are several slots; the study is asked and told from this thread only.
4. Each ended job is told to the study: pruned (its loop stopped where the pruner said, see
   orchestrate.sweeps.pruning), complete with the value it returned, or failed. Past
   max_failure_rate no new trial starts and the sweep raises the first failure. A trial whose
   process died (its worker killed, its node lost) has its point run again, once (`lost`);
   the cluster's head lost ends the sweep in one line (the same command continues it).
"""

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf

from orchestrate import errors, schema, thirdparty
from orchestrate.cluster import ray_cluster
from orchestrate.schema import ConfigError
from orchestrate.sweeps import plan, remote
from orchestrate.sweeps.pruning import PRUNED_AT, pruner_settings
from orchestrate.sweeps.slurm import is_slurm
from orchestrate.tracking.redact import redact_text

log = logging.getLogger(__name__)
GRPC_STOP_S = 10.0  # the longest the study's gRPC proxy waits for its last calls when the sweep ends


# ---- 1. the search space -------------------------------------------------------------------------

@dataclass
class SearchSpace:
    distributions: dict[str, Any]  # key -> optuna distribution
    fixed: dict[str, str]  # key -> value, the same in every trial

    @classmethod
    def parse(cls, params: dict | None, arguments: list[str]) -> "SearchSpace":
        """`hydra.sweeper.params`, then the command line's overrides (a later one of a key wins)."""
        from hydra.core.override_parser.overrides_parser import OverridesParser

        lines = [f"{k}={v}" for k, v in (params or {}).items()] + list(arguments)
        for key, value in (params or {}).items():
            if not isinstance(value, (str, int, float, bool)):
                raise ConfigError(f"hydra.sweeper.params.{key}: write the search space as Hydra's override syntax "
                                  "(choice(a,b), range(a,b), interval(a,b), tag(log, interval(a,b))), not a mapping")
        space = cls({}, {})
        for override in OverridesParser.create().parse_overrides(lines):
            key = override.get_key_element()
            space.distributions.pop(key, None)
            space.fixed.pop(key, None)
            if override.is_sweep_override():
                space.distributions[key] = distribution(override)
            else:
                space.fixed[key] = override.get_value_element_as_str()
        if not space.distributions:
            raise ConfigError("hydra.sweeper.params: nothing to search; give a parameter a choice(...), range(...) "
                              "or interval(...) (e.g. optimizer.lr=tag(log,interval(1e-4,1e-2)))")
        return space

    def overrides(self, params: dict[str, Any]) -> list[str]:
        return [f"{k}={v}" for k, v in params.items()] + [f"{k}={v}" for k, v in self.fixed.items()]

    def grid(self) -> dict[str, list]:
        """The search space as GridSampler takes it: every parameter a list of values."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        grid = {}
        for key, d in self.distributions.items():
            if isinstance(d, CategoricalDistribution):
                grid[key] = list(d.choices)
            elif isinstance(d, IntDistribution) and not d.log:
                grid[key] = list(range(d.low, d.high + 1, d.step))
            else:
                raise ConfigError(f"{key}: hydra/sweeper/sampler=grid runs every combination and cannot draw from "
                                  "an interval; allowed: choice(...) or range(...), or hydra/sweeper/sampler=tpe")
        return grid


def distribution(override) -> Any:
    """A sweep override as an Optuna distribution, as Hydra's Optuna sweeper makes it: a choice
    (or a shuffled range) is categorical, a range is a stepped int or float, an interval uniform
    (`tag(log, ...)`: log-uniform), int when both ends are ints."""
    from hydra.core.override_parser.types import Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if override.is_range_sweep():  # range(start, stop, step): stop excluded, as Hydra's grid reads it
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            last = value.start + value.step * int((value.stop - value.start - 1e-12) // value.step)
            return FloatDistribution(value.start, last, step=value.step)
        last = value.start + value.step * ((value.stop - 1 - value.start) // value.step)
        return IntDistribution(int(value.start), int(last), step=int(value.step))
    if override.is_interval_sweep():
        log_scale = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(value.start, value.end, log=log_scale)
    raise ConfigError(f"{override.input_line}: not a search space Optuna can draw from")


# ---- 2. the study ------------------------------------------------------------------------------

def default_storage(tracking_uri: str) -> str:
    """The study's database beside the MLflow store: a SQLite file next to a SQLite store, a
    database of its own on a PostgreSQL store's server (MLflow's and Optuna's tables would share
    one `alembic_version`), otherwise a SQLite file in the working folder."""
    from sqlalchemy.engine import make_url

    from orchestrate.tracking.stores import absolute_uri

    uri = absolute_uri(tracking_uri)
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///"))
        return f"sqlite:///{path.with_name(path.stem + '-optuna.db')}"
    if uri.startswith("postgresql"):
        url = make_url(uri)
        return url.set(database=f"{url.database}_optuna").render_as_string(hide_password=False)
    return f"sqlite:///{Path('optuna.db').resolve()}"


def check_storage(storage: str | None, tracking_uri: str) -> None:
    """The study's storage (`storage`, or beside the MLflow store when None), checked before the
    sweep opens anything: a SQLite file's folder exists and the file, if there, is a database this
    user can read; a PostgreSQL server answers (its database created if missing). ConfigError."""
    from orchestrate.cluster.mlflow_server import with_driver

    url = with_driver(storage or default_storage(tracking_uri))
    given = f"hydra.sweeper.storage={redact_text(storage) if storage else 'null (beside tracking.uri)'}"
    if url.startswith("postgresql"):
        create_database(url)
        return
    if not url.startswith("sqlite:///"):
        return
    path = Path(url.removeprefix("sqlite:///"))
    if not path.parent.is_dir():
        raise ConfigError(f"{given}: the study's folder {path.parent} does not exist; allowed: a SQLite file in a "
                          "folder that exists (sqlite:////PATH/study.db, made on first use) or a database URL "
                          "(postgresql://USER:PASSWORD@HOST:PORT/DB)")
    if not path.exists():
        return
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as e:
        raise ConfigError(f"{given}: the study's file {path} cannot be read as a SQLite database ({e}); move it "
                          "away to start the study afresh, or set hydra.sweeper.storage to another file") from None


def create_database(storage: str) -> None:
    """A PostgreSQL storage's database, created if it is not there yet (Optuna creates tables, not databases)."""
    if not storage.startswith("postgresql"):
        return
    import contextlib

    import psycopg2
    from sqlalchemy.engine import make_url

    url = make_url(storage)
    server = url.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    try:
        with contextlib.closing(psycopg2.connect(server, connect_timeout=5)) as db:
            db.autocommit = True  # CREATE DATABASE cannot run in a transaction
            with db.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (url.database,))
                if cur.fetchone() is None:
                    cur.execute(f'CREATE DATABASE "{url.database}"')
    except psycopg2.Error as e:
        raise ConfigError(f"hydra.sweeper.storage={redact_text(storage)}: database {url.database} could not be "
                          f"created ({str(e).strip().splitlines()[0]}); create it, or set hydra.sweeper.storage "
                          "to a database the trials can reach") from None


@contextlib.contextmanager
def served(study, host: str) -> Iterator[str]:
    """The study served to trials on other hosts by Optuna's gRPC storage proxy, on `host` (this
    machine's address toward them), while the block runs: yields the URL the trials open
    (orchestrate.sweeps.pruning). The proxy serves the sweeper's own storage object, so both see
    one cache; its threads end with it."""
    server, pool, port = thirdparty.optuna_grpc_proxy(thirdparty.optuna_storage(study), host)
    server.start()
    log.info(f"Optuna study served to the trials' hosts on {host}:{port} (gRPC)")
    try:
        yield f"grpc://{host}:{port}"
    finally:
        server.stop(grace=None).wait(GRPC_STOP_S)
        pool.shutdown(wait=True)


def open_study(conf: dict, config: DictConfig, space: SearchSpace):
    """The study, created or (the same sweep run again) loaded; its storage and name."""
    import optuna
    from hydra.utils import instantiate

    from orchestrate.cluster.mlflow_server import with_driver

    # A bare postgresql:// would pick SQLAlchemy 2.1's default driver, psycopg 3 (not installed).
    storage = with_driver(conf["storage"] or default_storage(config.tracking.uri))
    if not conf["storage"] and storage.startswith("sqlite") and is_slurm(config):
        raise ConfigError(f"hydra.sweeper.storage=null: the study would be a SQLite file on this machine "
                          f"({storage}), and {remote.elsewhere(config)}; set hydra.sweeper.storage to a database every node can "
                          "reach (postgresql://USER:PASSWORD@HOST:PORT/DB)")
    create_database(storage)
    name = conf["study_name"] or f"{config.sweep.name}-{plan.sweep_key(config)}"
    sampler_conf = OmegaConf.to_container(conf["sampler"], resolve=True)
    if sampler_conf.get("_target_") == "optuna.samplers.GridSampler":
        sampler_conf["search_space"] = space.grid()
    directions = directions_of(conf["direction"])  # checked in `check_settings`
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pruner = pruner_settings(OmegaConf.to_container(conf["pruner"], resolve=True), config.trainer)
    study = optuna.create_study(storage=storage, study_name=name, sampler=instantiate(sampler_conf),
                                pruner=instantiate(pruner), directions=directions, load_if_exists=True)
    earlier = len(study.get_trials(deepcopy=False))
    if earlier and sampler_conf.get("seed") is not None and not sampler_conf.get("search_space"):
        # A study continued (the same sweep with a larger n_trials): a sampler seeded as before
        # would draw its first proposals again, the earlier trials' own. Seeded by the seed and
        # the trials so far, it draws anew, and the same command still draws the same trials.
        # (The grid sampler takes only points no trial has taken, in its seeded order.)
        import numpy as np

        sampler_conf["seed"] = int(np.random.SeedSequence([sampler_conf["seed"], earlier]).generate_state(1)[0])
        study.sampler = instantiate(sampler_conf)
    created = [d.name.lower() for d in study.directions]
    if created != directions:
        raise ConfigError(f"hydra.sweeper.direction={schema.shown_list(directions)}: study {name} in "
                          f"{redact_text(storage)} was created to {schema.shown_list(created)}; set "
                          "hydra.sweeper.study_name to start another")
    return study, storage, name


def directions_of(value: Any) -> list[str]:
    """[minimize or maximize, ...], one per objective, from a string or a list of them."""
    return [str(getattr(v, "value", v)).lower() for v in schema.listed(value)]


SEVERAL_OBJECTIVES_PRUNERS = ("orchestrate.sweeps.dominated.DominatedPruner", "optuna.pruners.NopPruner")


def check_settings(direction, n_jobs: int | None, launcher: str, metric: Any = None, pruner: str | None = None) -> None:
    """The sweeper's own settings (`launcher`: the launcher's class path; `metric`: the app's
    sweep.metric, one objective per direction; `pruner`: its class path), refused in one line: by
    the command line's up-front check (orchestrate.cli.check_sweeper), before the sweep's MLflow
    run opens, and by the sweeper's setup for any other Hydra app."""
    directions = directions_of(direction)
    for word in directions:
        if word not in ("minimize", "maximize"):
            raise ConfigError(f"hydra.sweeper.direction={word}: allowed: minimize, maximize (a list: one per sweep.metric)")
    if metric is not None:
        schema.objectives(metric, directions, "hydra.sweeper.direction")
    several = len(directions) > 1
    if pruner is not None and several and pruner not in SEVERAL_OBJECTIVES_PRUNERS:
        raise ConfigError(f"hydra/sweeper/pruner: {pruner.rsplit('.', 1)[-1]} ranks one objective, and this sweep "
                          f"has {len(directions)}; allowed: hydra/sweeper/pruner=dominated (stops a trial that "
                          "completed trials beat on every objective) or none")
    if pruner == SEVERAL_OBJECTIVES_PRUNERS[0] and not several:
        raise ConfigError("hydra/sweeper/pruner=dominated prunes a sweep over several objectives, and this one has "
                          "one; allowed: successive_halving, median, hyperband, none")
    if n_jobs is not None and n_jobs < 1:
        raise ConfigError(f"hydra.sweeper.n_jobs={n_jobs}: must be at least 1, or null (what the launcher runs at once)")
    if n_jobs is not None and n_jobs > 1 and launcher == thirdparty.BASIC_LAUNCHER:
        raise ConfigError(f"hydra.sweeper.n_jobs={n_jobs}: hydra/launcher=basic runs one job at a time in this "
                          "process; allowed: 1 or null, or hydra/launcher=orchestrate_ray for trials at once")


# ---- 3. the slots -------------------------------------------------------------------------------

def slot_count(sweeper, n_jobs: int | None) -> int:
    """Trials at once: hydra.sweeper.n_jobs (checked in `check`), else what the launcher runs at once."""
    if n_jobs is not None:
        return n_jobs
    slots = getattr(sweeper.launcher, "slots", None)
    return slots() if callable(slots) else 1


def queued_count(sweeper, n_jobs: int | None) -> int:
    """Trials launched beyond the slots, waiting in the launcher's queue for the next free one
    (the Ray launcher's `queued`): the slot a trial frees starts the next at once, while this
    driver tells the study and asks for another. None when hydra.sweeper.n_jobs caps the trials
    at once (a queued one would run beside them where the cluster has room)."""
    queued = getattr(sweeper.launcher, "queued", None)
    return queued() if n_jobs is None and callable(queued) else 0


# ---- 4. the sweep ------------------------------------------------------------------------------

@dataclass
class Outcome:
    number: int
    overrides: list[str]
    state: str  # COMPLETE, PRUNED, FAIL
    value: float | list[float] | None = None  # a list: one per objective
    pruned_at: int | None = None
    error: BaseException | None = None


def rerun_interrupted(study) -> None:
    """An earlier attempt that was killed left its running trials RUNNING: failed, and run again
    (enqueued once: Optuna's own skip_if_exists would find the failed trial itself and skip it)."""
    from optuna.trial import TrialState

    waiting = [t.system_attrs.get("fixed_params", t.params)
               for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,))]
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        study.tell(trial.number, state=TrialState.FAIL)
        if trial.params not in waiting:
            study.enqueue_trial(trial.params)
            waiting.append(trial.params)


def trials_left(study, n_trials: int, space: "SearchSpace") -> tuple[int, int]:
    """(trials done, trials to run): n_trials counts the COMPLETE and PRUNED ones of every
    attempt, and a grid has no more trials than points."""
    import optuna
    from optuna.trial import TrialState

    done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
    to_run = max(0, n_trials - done)
    if isinstance(study.sampler, optuna.samplers.GridSampler):
        to_run = min(to_run, max(0, math.prod(len(v) for v in space.grid().values()) - done))
    return done, to_run


def sweep(sweeper, arguments: list[str]) -> None:
    """The sweep: (1) the study opened, an interrupted attempt's trials run again; (2) up to
    `slots` trials at a time, each told to the study as it ends; (3) the results written, the
    sweep failed past `max_failure_rate`."""
    conf, config = sweeper.conf, sweeper.config
    space = SearchSpace.parse(conf.get("params"), arguments)
    study, storage, name = open_study(conf, config, space)
    rerun_interrupted(study)
    done, to_run = trials_left(study, int(conf["n_trials"]), space)
    # As in Study.optimize: a sampler may stop the study (GridSampler, once every point is taken).
    stop_requested = thirdparty.optuna_optimize_loop(study)
    slots = min(slot_count(sweeper, conf.get("n_jobs")), max(to_run, 1))
    ahead = queued_count(sweeper, conf.get("n_jobs")) if to_run > slots else 0
    allowed_failures = int(float(conf["max_failure_rate"]) * int(conf["n_trials"]))
    pruner = OmegaConf.select(config, "hydra.runtime.choices", default={}).get("hydra/sweeper/pruner", "?")
    queued = f" ({ahead} more queued for the next free slot)" if ahead else ""
    log.info(f"Optuna study '{name}' in {redact_text(storage)}: {done} of {conf['n_trials']} trials done; "
             f"running {to_run}, {slots} at a time{queued}; pruner: {pruner}")

    ended: queue.Queue = queue.Queue()
    running: dict[int, Any] = {}
    failures: list[Outcome] = []

    def start() -> bool:
        trial = ask_new(study, space)
        if trial is None:
            return False
        shown = [f"{k}={v}" for k, v in trial.params.items()]  # what tells this trial apart
        # The trial finds its study from the last two (orchestrate.sweeps.pruning.of_this_job):
        # Hydra keeps `hydra.*` overrides out of the job's task overrides, which name the trial.
        job = [*space.overrides(trial.params), f"hydra.sweeper.storage='{trial_storage}'",
               f"hydra.sweeper.study_name='{name}'"]
        running[trial.number] = trial

        def run() -> None:
            ended.put((trial.number, shown, launch_one(sweeper.launcher, job, trial.number)))

        if slots == 1:  # in this thread: the basic launcher runs the job in this process
            run()
        else:  # a daemon: Ctrl-C ends the sweep without waiting for the launcher's call to return
            threading.Thread(target=run, name=f"trial-{trial.number}", daemon=True).start()
        return True

    began, launched = time.perf_counter(), 0
    services = contextlib.ExitStack()  # the study served to the trials' hosts, if they are elsewhere
    try:
        trial_storage = storage  # what the trials open (`start`)
        if storage.startswith("sqlite") and remote.cluster_head(config) is not None:
            trial_storage = services.enter_context(served(study, remote.server_host(config)))
        while launched < to_run or running:
            while (launched < to_run and len(running) < slots + ahead and len(failures) <= allowed_failures
                   and not stop_requested()):
                if not start():
                    to_run = launched  # every proposal repeats a trial: the space is spent
                    break
                launched += 1
            if not running:
                break
            number, overrides, ret = next_ended(ended)
            if ret.status == JobStatus.FAILED and lost(study, running, number, overrides, ret):
                to_run += 1  # its point, again
                continue
            outcome = tell(study, running.pop(number), overrides, ret)
            if outcome.state == "FAIL":
                failures.append(outcome)
            log.info(f"\t#{number} : {' '.join(overrides)} {describe(outcome)} "
                     f"({time.perf_counter() - began:.1f} s into the sweep)")
    except BaseException:
        # Ctrl-C (or an error here): the trials still running end with the sweep (orchestrate_ray cancels
        # their tasks); the study keeps them RUNNING: the same sweep run again runs their points again.
        cancel = getattr(sweeper.launcher, "cancel", None)
        if running and callable(cancel):
            cancel()
        raise
    finally:
        thirdparty.optuna_optimize_loop_end(study)
        services.close()
    write_results(config, study, storage, name)
    if len(failures) > allowed_failures:
        raise failures[0].error


DUPLICATE_ASKS = 50  # proposals that repeat an earlier trial, asked again before the space counts as spent


def ask_new(study, space: SearchSpace):
    """The sampler's next trial whose parameters no finished trial (COMPLETE or PRUNED) had: one
    that repeats them would only repeat its result (the sweep's resume would skip it as run). A
    repeat is told FAIL with the `duplicate_of` note, so that it counts for nothing. None when
    DUPLICATE_ASKS proposals in a row were repeats (a small discrete space, all of it tried)."""
    from optuna.trial import TrialState

    finished = {tuple(sorted(t.params.items())): t.number
                for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))}
    for _ in range(DUPLICATE_ASKS):
        trial = study.ask(space.distributions)
        earlier = finished.get(tuple(sorted(trial.params.items())))
        if earlier is None:
            return trial
        log.info(f"\t#{trial.number} : would repeat trial {earlier} "
                 f"({' '.join(f'{k}={v}' for k, v in trial.params.items())}): skipped, not counted")
        trial.set_user_attr("duplicate_of", earlier)
        study.tell(trial, state=TrialState.FAIL)
    log.info(f"the last {DUPLICATE_ASKS} proposals all repeated finished trials: the search space looks spent")
    return None


def next_ended(ended: queue.Queue):
    """The next ended trial. Waits in short slices: a Ctrl-C that the kernel delivers to another
    thread (Ray's, a trial's) only sets Python's flag, and a wait with no timeout would never
    wake up to raise it."""
    while True:
        try:
            return ended.get(timeout=0.2)
        except queue.Empty:
            continue


def launch_one(launcher, overrides: list[str], number: int) -> JobReturn:
    try:
        return launcher.launch([overrides], initial_job_idx=number)[0]
    except BaseException as e:  # the launcher itself failed (e.g. no placement): the trial failed
        return JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=e)


def tell(study, trial, overrides: list[str], ret: JobReturn) -> Outcome:
    """The ended job as the study's trial: PRUNED when its loop stopped where the pruner said
    (the trial recorded the step), COMPLETE with the value it returned, FAIL otherwise."""
    from optuna.trial import TrialState

    if ret.status == JobStatus.FAILED:
        study.tell(trial, state=TrialState.FAIL)
        return Outcome(trial.number, overrides, "FAIL", error=thirdparty.job_error(ret))
    pruned_at = thirdparty.optuna_storage(study).get_trial(thirdparty.optuna_trial_id(study, trial=trial)) \
        .user_attrs.get(PRUNED_AT)
    if pruned_at is not None:
        frozen = study.tell(trial, state=TrialState.PRUNED)  # its value: the last one it reported
        return Outcome(trial.number, overrides, "PRUNED", frozen.value, int(pruned_at))
    value = ret.return_value
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, (int, float)) for v in values):
        error = ValueError(f"trial {trial.number} returned {value!r}, not a number for each objective: does "
                           "sweep.metric name metrics this run logs (eval_accuracy: classifiers only)?")
        study.tell(trial, state=TrialState.FAIL)
        return Outcome(trial.number, overrides, "FAIL", error=error)
    told = [float(v) for v in values] if len(values) > 1 else float(values[0])
    study.tell(trial, told)
    return Outcome(trial.number, overrides, "COMPLETE", told)


RERUN_OF = "rerun_of"  # a trial's user attribute: the number of the trial whose point it runs again


def lost(study, running: dict, number: int, overrides: list[str], ret: JobReturn) -> bool:
    """A failed job that is no result of its point. The cluster's head lost (ray_cluster.HeadLost):
    the sweep ends in one line naming the trials running or queued. Its own process died under it
    (TrialLost: its worker killed, its node lost): failed in the study, its point enqueued to run
    again as a new trial, once (a rerun that dies too counts as a failure); True. Else False."""
    from optuna.trial import TrialState

    from orchestrate.launch._core import TrialLost

    error, trial = thirdparty.job_error(ret), running[number]
    if isinstance(error, ray_cluster.HeadLost):
        raise errors.Failed(f"{error}: the sweep stops; trial(s) {', '.join(f'#{n}' for n in sorted(running))} were "
                            "running or queued on its cluster: their runs are closed KILLED, and the same command runs "
                            "them again once the cluster is back (or with hydra.launcher.address of another)") from None
    if not isinstance(error, TrialLost) or RERUN_OF in trial.user_attrs:
        return False
    study.tell(trial, state=TrialState.FAIL)
    study.enqueue_trial(trial.params, user_attrs={RERUN_OF: trial.number})
    del running[number]
    log.warning(f"\t#{number} : {' '.join(overrides)} lost its process (killed, or its node gone): its point runs "
                "again as a new trial")
    return True


def describe(outcome: Outcome) -> str:
    if outcome.state == "PRUNED":
        return f"PRUNED at step {outcome.pruned_at}"
    if outcome.state == "COMPLETE":
        values = outcome.value if isinstance(outcome.value, list) else [outcome.value]
        return f"COMPLETE, {', '.join(f'{v:.4g}' for v in values)}"
    return f"FAILED: {outcome.error}"


def write_results(config: DictConfig, study, storage: str, name: str) -> None:
    """optimization_results.yaml in the sweep folder, as Hydra's Optuna sweeper writes it."""
    from optuna.trial import TrialState

    counts = {s.name: len(study.get_trials(deepcopy=False, states=(s,)))
              for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}
    repeats = sum("duplicate_of" in t.user_attrs for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)))
    counts["FAIL"] -= repeats
    counts["REPEAT_SKIPPED"] = repeats  # proposals that repeated a finished trial (ask_new)
    results: dict[str, Any] = {"name": "optuna", "study_name": name, "storage": redact_text(storage),
                               "trials": counts}
    if counts["COMPLETE"] and len(study.directions) == 1:
        results.update(best_params=study.best_params, best_value=study.best_value)
    elif counts["COMPLETE"]:  # several objectives: the Pareto front, as Optuna finds it
        results["best_trials"] = [{"number": t.number, "params": t.params, "values": t.values}
                                  for t in study.best_trials]
    folder = Path(str(config.hydra.sweep.dir))
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(results), folder / "optimization_results.yaml")
