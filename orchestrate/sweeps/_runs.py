"""The MLflow side of a sweep, imported lazily by `orchestrate.sweeps.callbacks`: the parent run
and the summary on it (`Sweep`, in the launching process), and each trial's nested child run
(`open_trial` and `close_trial`, wherever the launcher runs the job)."""

import concurrent.futures
import contextlib
import json
import logging
import math
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from orchestrate import errors
from orchestrate.cluster import ray_cluster, runtime
from orchestrate.sweeps import _server, _summary, compare, pareto, plan, pruning, remote
from orchestrate.sweeps._server import own_server
from orchestrate.sweeps.slurm import is_slurm
from orchestrate.tracking import plots
from orchestrate.tracking.handover import ParentRun
from orchestrate.tracking.owner import STALE_S, Heartbeat, Owner
from orchestrate.tracking.redact import redact_override
from orchestrate.tracking.settings import NO_RUN_LINKS, set_env
from orchestrate.tracking.stores import (
    SERVER_WAIT_S,
    absolute_uri,
    new_sqlite_store,
    open_ui,
    training_experiment,
    wait_for,
)

log = logging.getLogger(__name__)
SWEEP_KEY = "orchestrate.sweep_key"
TRIAL_KEY = "orchestrate.trial"
INDEX_KEY = "orchestrate.trial_index"
PARENT_KEY = "mlflow.parentRunId"
ATTEMPT_KEY = "orchestrate.sweep.attempt"  # on the parent and each trial: the command on the sweep that ran it
OWNER_KEY = "orchestrate.sweep.owner"  # on the parent: the process running the sweep (orchestrate.tracking.owner)
BEAT_KEY = "orchestrate.sweep.alive_at"  # on the parent: its heartbeat, seconds since the epoch
HISTORY_READERS = 8  # requests for curves at once at the sweep's end (`Sweep.prefetch`)


def trial_name(overrides: list[str], fixed: list[str]) -> str:
    """What tells a trial apart: its overrides that the command line did not fix for every trial."""
    own = [o for o in overrides if o not in fixed]
    return ",".join(own) or "(defaults)"


def fixed_overrides(command: list[str]) -> list[str]:
    """The command line's overrides as typed and as a sweeper writes them into each trial's
    overrides (`key=value` with the value re-escaped: `tracking.uri=sqlite\\:///x.db`)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(command)
    return [*command, *(f"{o.get_key_element()}={o.get_value_element_as_str()}" for o in parsed
                        if not o.is_sweep_override())]


def parent_name(name: str, config: DictConfig) -> str:
    """`sweep-<the sweep file>`, or with none named (a plain `-m`), what the sweep varies:
    `sweep-optimizer.lr,backend`."""
    if name != "none":
        return f"sweep-{name}"
    varied = [o.split("=", 1)[0].lstrip("+~") for o in plan.search_space(config)]
    return f"sweep-{','.join(varied)}" if varied else "sweep-none"


def open_trial(parent: ParentRun, config: DictConfig) -> str:
    """The run a job logs into: a new child of the parent, or (resuming) the trial's FINISHED
    child from an earlier attempt, which the app then skips."""
    if parent.uri.startswith("http") and wait_for(parent.uri) is not None:
        import socket  # a trial on a host that cannot reach the server: one line now, not MLflow's retries for minutes

        raise RuntimeError(f"the sweep's MLflow server {parent.uri} did not answer on {socket.gethostname()} within "
                           f"{SERVER_WAIT_S:g} s")
    name = trial_name(list(config.hydra.overrides.task), parent.command)
    if name in parent.finished:
        return parent.finished[name]
    from mlflow.tracking.context.registry import resolve_tags  # MLflow's own: user, source, git commit

    run = MlflowClient(tracking_uri=parent.uri).create_run(
        parent.experiment_id, run_name=name,
        tags=resolve_tags({PARENT_KEY: parent.run_id, TRIAL_KEY: name, INDEX_KEY: str(config.hydra.job.num),
                           ATTEMPT_KEY: str(parent.attempt), "orchestrate.role": "trial"}))
    return run.info.run_id


def close_trial(uri: str, run_id: str, failed: BaseException | None) -> None:
    """A job that ended without closing its run (it failed before the app opened its tracker, e.g.
    a rejected config) leaves it RUNNING: close it as the job ended, with the error in `error`. A
    server away (restarting) is waited for up to SERVER_WAIT_S."""
    if uri.startswith("http"):
        wait_for(uri)
    client = MlflowClient(tracking_uri=uri)
    if client.get_run(run_id).info.status != "RUNNING":
        return
    if failed is not None:
        client.set_tag(run_id, "error", f"{type(failed).__name__}: {failed}"[:5000])
    client.set_terminated(run_id, "FAILED" if failed is not None else "FINISHED")


class SweepRunning(errors.Refused):
    """The same sweep is being run by another command now."""


def refuse_if_running(run, experiment: str) -> None:
    """A parent run RUNNING whose process still runs (orchestrate.tracking.owner): SweepRunning,
    naming it. One command per sweep at a time: the second would fail the first's running trials
    in the study and run them again beside it."""
    tags = run.data.tags
    owner = Owner.parse(tags.get(OWNER_KEY))
    try:
        beat = float(tags[BEAT_KEY])
    except (KeyError, ValueError):
        beat = None
    if run.info.status != "RUNNING" or owner is None or not owner.alive(beat):
        return
    heard = f"; its last heartbeat {time.time() - beat:.0f} s ago (gone once silent for {STALE_S:g} s)" \
        if beat is not None and owner.host != platform.node() else ""
    raise SweepRunning(f"this sweep is running already: attempt {tags.get(ATTEMPT_KEY, '?')}, {owner}{heard} "
                       f"(MLflow parent run {run.info.run_id}, experiment '{experiment}'); one command per sweep "
                       f"at a time: wait for it to end, or stop it (Ctrl-C in its terminal, or kill {owner.pid} on "
                       f"{owner.host}) and run this command again to continue it")


class Sweep:
    """One sweep in the launching process: the tracking server (SQLite stores), the parent run
    (found again by the sweep's key when resuming; held by this process while it runs: its owner
    and heartbeat tags), and at the end the summary."""

    def __init__(self, settings, config: DictConfig):
        self.settings = settings
        self.began = time.time()
        self.server = None
        self.heartbeat: Heartbeat | None = None
        self.restarted = False  # the server was started again by the heartbeat's thread (keep_server)
        self.host = "127.0.0.1"  # where the sweep's own server listens
        self.server_warm = None  # whether the sweep's server was the warm stack's; None: it had none
        uri = absolute_uri(settings.tracking_uri)
        new_sqlite_store(uri)
        if own_server(uri, settings.tracking_server):
            if is_slurm(config):
                # Its trials run on other machines: neither this machine's 127.0.0.1 nor its disk is theirs.
                raise ValueError(f"tracking.uri={settings.tracking_uri}: hydra/launcher=submitit_slurm runs the "
                                 "trials on the cluster's nodes, which cannot reach this machine's SQLite store "
                                 "or the sweep's server on 127.0.0.1; set tracking.uri=http://HOST:PORT "
                                 "(an MLflow server the nodes can reach)")
            from orchestrate.sweeps import early

            began = time.perf_counter()
            self.host = remote.server_host(config)  # 127.0.0.1, or toward a cluster whose hosts run the trials
            self.server = early.take_server(uri)  # started by the command line, while it checked the trials
            if self.server is None and self.host == "127.0.0.1" and \
                    (warm := _server.warm_server(uri, runtime.current())) is not None:
                _server.prepare_store(uri, settings.experiment)
                self.server = warm  # the warm stack's (`orchestrate up`): taken as it is, left running
            if self.server is None:
                _server.prepare_store(uri, settings.experiment, served_artifacts=self.host != "127.0.0.1")
                self.server = _server.TrackingServer(uri, Path("mlartifacts").resolve(), host=self.host)
            log.info(f"MLflow server for the sweep on {self.server.uri} "
                     f"(waited {time.perf_counter() - began:.1f} s for it)")
            uri = self.server.uri
        try:
            self._open_parent(uri, config)
        except BaseException:
            self.stop_heartbeat()
            self.stop_server()
            raise

    def _open_parent(self, uri: str, config: DictConfig) -> None:
        s = self.settings
        self.uri, self.client = uri, MlflowClient(tracking_uri=uri)
        self.experiment_id = training_experiment(self.client, s.experiment)  # the UI opens it on the runs
        self.command = list(config.hydra.overrides.task)
        self.fixed = fixed_overrides(self.command)
        sweeper = OmegaConf.to_container(config.hydra.sweeper, resolve=False)
        key = plan.sweep_key(config)
        earlier = self.client.search_runs([self.experiment_id], f"tags.`{SWEEP_KEY}` = '{key}'",
                                          order_by=["attributes.start_time DESC"], max_results=1) if s.resume else []
        self.attempt = 1
        if earlier:
            refuse_if_running(earlier[0], s.experiment)
            self.run_id = earlier[0].info.run_id
            self.attempt = int(earlier[0].data.tags.get(ATTEMPT_KEY, "1")) + 1
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            from mlflow.tracking.context.registry import resolve_tags  # MLflow's own: user, source, git commit

            self.run_id = self.client.create_run(self.experiment_id, run_name=parent_name(s.name, config),
                                                 tags=resolve_tags({SWEEP_KEY: key, "orchestrate.role": "sweep"})).info.run_id
            definition = {"name": s.name, "command": [redact_override(o) for o in self.command], "sweeper": sweeper,
                          "params": {**(sweeper.get("params") or {}), "metric": s.metric}}
            for k, v in list(definition["params"].items())[:100]:
                self.client.log_param(self.run_id, f"sweep.{k}", str(v)[:6000])
            self.client.log_text(self.run_id, json.dumps(definition, indent=2, default=str), "sweep.json")
        before = Owner.parse(earlier[0].data.tags.get(OWNER_KEY)) if earlier else None
        self.client.set_tag(self.run_id, OWNER_KEY, Owner.this_process().tag())
        self.client.set_tag(self.run_id, ATTEMPT_KEY, str(self.attempt))
        self.heartbeat = Heartbeat(self.beat)
        children = self.children()
        if self.close_left_running(children, before):
            children = self.children()  # as the store has them now
        self.earlier_runs = {c.info.run_id for c in children}
        self.finished = {c.data.tags[TRIAL_KEY]: c.info.run_id
                         for c in sorted(children, key=lambda c: c.info.start_time)
                         if c.info.status == "FINISHED" and TRIAL_KEY in c.data.tags}
        # A grid's trials are known now: the summary lists the ones the sweep never reached.
        self.planned = plan.trials(config) if plan.is_grid(config) else []
        self.comparison = compare.is_comparison(plan.search_space(config))
        self.runs: dict = {}  # run id -> the trial's MLflow run, as `rows` read it
        self.histories: dict[tuple[str, str], list] = {}  # (run id, metric) -> its curve (`history`)
        # Whether the sweep prunes (its summary then says how many trials were, none included).
        pruner = OmegaConf.select(config, "hydra.runtime.choices", default={}).get("hydra/sweeper/pruner")
        self.pruner = OmegaConf.select(config, "hydra.sweeper._target_") == pruning.SWEEPER and pruner not in (None, "none")

    def beat(self) -> None:
        """Every HEARTBEAT_S while the sweep runs: its server kept (`keep_server`), then the parent's heartbeat."""
        self.keep_server()
        self.client.set_tag(self.run_id, BEAT_KEY, f"{time.time():.0f}")

    def keep_server(self) -> None:
        """The sweep's MLflow server (its own, or the warm stack's), found gone (killed, crashed), started
        again on the same port: the running trials hold its address, and their runs' outboxes keep what
        they log meanwhile and send it then. Not when its process still runs (busy, not gone), or when
        something else answers on the port now."""
        from urllib.parse import urlsplit

        from orchestrate.cluster.ports import answers

        server = self.server
        if server is None or server.answers() or (not server.warm and server.proc.poll() is None):
            return
        port = urlsplit(server.uri).port
        if answers(self.host, port, 1.0):
            return
        how = "the warm stack's" if server.warm else f"its process ended with {server.proc.returncode}"
        log.warning(f"the sweep's MLflow server {server.uri} is gone ({how}): started again on the same port")
        server.stop()
        self.server = _server.TrackingServer(absolute_uri(self.settings.tracking_uri), server.artifacts,
                                             host=self.host, port=port)
        # Linux stops it when this thread ends (the heartbeat's: _die_with_parent): `close` starts another.
        self.restarted = True

    def parent(self) -> ParentRun:
        return ParentRun(uri=self.uri, experiment_id=self.experiment_id, run_id=self.run_id,
                         command=self.fixed, finished=dict(self.finished), attempt=self.attempt)

    def close_left_running(self, children: list, before: Owner | None) -> int:
        """The trials' runs an earlier attempt left RUNNING (its process killed with theirs: SIGKILL, a
        lost host; no other command runs the sweep now) closed KILLED, saying so, before this attempt
        opens any: its own trials are new runs (a study's trial that was running is run again).
        Returns how many it closed."""
        left = [child for child in children if child.info.status == "RUNNING"]
        for child in left:
            attempt = child.data.tags.get(ATTEMPT_KEY, "?")
            # The process is known for the attempt just before this one (the parent's owner tag until now).
            by = f" ({before})" if before is not None and attempt == str(self.attempt - 1) else ""
            self.client.set_tag(child.info.run_id, "error", f"its sweep's attempt {attempt}{by} ended before the "
                                                            f"trial did (killed); closed by attempt {self.attempt}")
            with self.quiet():
                self.client.set_terminated(child.info.run_id, "KILLED")
        return len(left)

    def lost(self, index: int, error: BaseException) -> None:
        """The trial of job `index` ended with its process (its worker or its host lost) before it
        could close its run: the run closed FAILED here, with where and why in its `error` tag,
        which the summary shows."""
        running = self.client.search_runs(
            [self.experiment_id], f"tags.`{PARENT_KEY}` = '{self.run_id}' and tags.`{INDEX_KEY}` = '{index}' "
            "and attributes.status = 'RUNNING'")
        for run in running:
            if run.info.run_id in self.earlier_runs:
                continue
            host = run.data.tags.get("host")
            where = f" on host {host}" if host else ""
            self.client.set_tag(run.info.run_id, "error", f"its process ended{where} before the trial did: {error}"[:5000])
            with self.quiet():
                self.client.set_terminated(run.info.run_id, "FAILED")

    def children(self) -> list:
        return self.client.search_runs([self.experiment_id], f"tags.`{PARENT_KEY}` = '{self.run_id}'",
                                       max_results=5000)

    def history(self, run_id: str, key: str) -> list:
        """A run's curve of `key`, asked of the server once for the summary, the comparison and the chart."""
        if (run_id, key) not in self.histories:
            self.histories[run_id, key] = self.client.get_metric_history(run_id, key)
        return self.histories[run_id, key]

    def prefetch(self, run_ids: list[str], keys: tuple[str, ...]) -> None:
        """The curves the summary and its chart read, one request per run and key, HISTORY_READERS
        at a time: a server of one process gains little (1,000 curves: 3.5 s one at a time, 3.1 s
        eight at a time; docs/performance.md), one with several workers answers them at once."""
        wanted = [(r, k) for r in run_ids for k in dict.fromkeys(keys) if (r, k) not in self.histories]
        with concurrent.futures.ThreadPoolExecutor(HISTORY_READERS, thread_name_prefix="summary") as pool:
            for pair, curve in zip(wanted, pool.map(lambda pair: self.client.get_metric_history(*pair), wanted)):
                self.histories[pair] = curve

    def rows(self) -> list[_summary.Row]:
        """The latest attempt at each trial, as this sweep left it (its MLflow run kept in `runs`)."""
        metric_key = _summary.history_key(self.settings.metric)
        latest = {}
        for run in sorted(self.children(), key=lambda r: r.info.start_time):
            latest[run.data.tags.get(TRIAL_KEY, run.info.run_name)] = run
        self.prefetch([run.info.run_id for run in latest.values()], (metric_key, *self.chart_keys(len(latest))))
        rows = []
        for name, run in latest.items():
            status, error = run.info.status, run.data.tags.get("error", "")
            if run.info.run_id in self.earlier_runs:  # not run by this attempt
                status, error = ("SKIPPED", "") if status == "FINISHED" else (
                    "CANCELLED", "not run: the sweep stopped before it")
            elif status == "RUNNING":  # its job was cancelled (fail_fast) or killed: it will never finish
                error = "stopped before it finished"
                self.client.set_tag(run.info.run_id, "error", error)
                with self.quiet():
                    self.client.set_terminated(run.info.run_id, "KILLED")
                run = self.client.get_run(run.info.run_id)
                status = "CANCELLED"
            self.runs[run.info.run_id] = run
            curve = self.history(run.info.run_id, metric_key)
            max_steps, pruned = run.data.params.get("trainer.max_steps"), run.data.tags.get("pruned")
            rows.append(_summary.Row(
                index=int(run.data.tags.get(INDEX_KEY, -1)), name=name, status=status, run_id=run.info.run_id,
                start_ms=run.info.start_time, end_ms=run.info.end_time, metrics=dict(run.data.metrics),
                max_steps=int(max_steps) if max_steps else None, pruned_at=int(pruned) if pruned else None,
                curve=[(m.timestamp, m.value) for m in curve], error=error,
                params={k: v for k, v in run.data.params.items() if k.startswith("cpu.")}))
        for index, overrides in enumerate(self.planned):
            name = trial_name(overrides, self.fixed)
            if name not in latest:
                rows.append(_summary.Row(index=index, name=name, status="CANCELLED",
                                         error="not run: the sweep stopped before it"))
        return sorted(rows, key=lambda r: r.index)

    def close(self) -> None:
        """Summary table and loss-curve chart on the parent, the parent closed, the server stopped,
        and the summary printed: the last thing a sweep prints."""
        self.stop_heartbeat()
        if self.server is not None and (self.restarted or not self.server.answers()):
            # Ctrl-C reaches every process of the terminal's group, the sweep's own server too: a
            # new one in front of the same store and artifacts takes the summary.
            self.server.stop()
            self.server = _server.TrackingServer(absolute_uri(self.settings.tracking_uri), self.server.artifacts,
                                                 host=self.host)
            self.uri, self.client = self.server.uri, MlflowClient(tracking_uri=self.server.uri)
        try:
            rows = self.rows()
            text = _summary.table(rows, self.settings.metric, self.settings.tie_tolerance, self.settings.lower,
                                  pruner=self.pruner)
            if len(self.settings.objectives) > 1:
                text += "\n\n" + self.log_front(rows)
            if self.comparison:
                text = self.log_comparison(rows) + "\n\n" + text
            self.client.log_text(self.run_id, text, "summary.md")
            self.log_chart(rows)
            failed = [r for r in rows if r.status not in _summary.DONE]
            self.client.log_metric(self.run_id, "sweep/trials_failed", len(failed))
            with self.quiet():
                self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
        finally:
            self.stop_server()
        ran = [r for r in rows if r.run_id and r.run_id not in self.earlier_runs]
        timing = (f"{len(ran)} trial(s) ran in {time.time() - self.began:.1f} s of wall time, "
                  f"{sum(r.wall_time_s or 0 for r in ran):.1f} s summed over trials")
        if ran:
            first = min(r.start_ms for r in ran) / 1000 - self.began
            timing += f"; the first started {first:.1f} s after the sweep began"
        print(f"\nsweep summary (MLflow parent run {self.run_id}, experiment '{self.settings.experiment}'):\n"
              f"{text}\n{timing}\nstart: {runtime.current().start_line(ray_cluster.how(), self.server_warm)}\n"
              f"{open_ui(self.settings.tracking_uri, self.experiment_id)}", flush=True)

    def log_comparison(self, rows: list[_summary.Row]) -> str:
        """A comparison's summary (orchestrate.sweeps.compare) on the parent: its table as text and
        as an MLflow table, its chart, its verdicts as tags, and the config keys that differ
        between its configurations (only those) as a tag and a table."""
        settings = self.settings.compare or {}
        repeats = [read_repeat(self.runs[r.run_id], r.name, r.status, self.history) if r.run_id else
                   compare.Repeat(group=compare.group_of(r.name), status=r.status) for r in rows]
        result = compare.compare(repeats, settings.get("baseline", "torch"), settings.get("target"),
                                 settings.get("confidence", 0.95))
        configs = {}
        for r in repeats:
            configs.setdefault(r.group, {k: v for k, v in r.params.items() if not k.startswith(("cpu.", "tracking."))})
        differs = compare.differing(configs)
        text = f"comparison ({result.repeats} repeat(s) of each configuration):\n{result.table()}"
        if differs:
            text += "\n\nwhat differs between the configurations: " + "; ".join(
                f"{k} ({', '.join(f'{g}: {v}' for g, v in values.items())})" for k, values in differs.items())
        self.client.log_table(self.run_id, data=comparison_columns(result), artifact_file="comparison.json")
        for key, line in result.verdicts().items():
            self.client.set_tag(self.run_id, f"compare.verdict.{key}", line[:5000])
        self.client.set_tag(self.run_id, "compare.differs", ", ".join(differs)[:5000] or "(nothing)")
        with tempfile.TemporaryDirectory() as tmp:
            png = plots.comparison(result, Path(tmp) / "comparison.png")
            self.client.log_artifact(self.run_id, str(png))
        return text

    def log_front(self, rows: list[_summary.Row]) -> str:
        """A sweep over several objectives: the Pareto front (the finished trials no other one
        dominates) printed, as an MLflow table and a chart on the parent, tagged on the front's
        child runs, and, with tracking.register_model, an alias per objective on the front's best
        version by it."""
        objectives = self.settings.objectives
        minimize = [low for _, low in objectives]
        points = {r.index: [r.metrics.get(f"final/{m}") for m, _ in objectives] for r in rows
                  if r.status in _summary.DONE and r.pruned_at is None}
        points = {i: v for i, v in points.items() if None not in v}
        on_front = set(pareto.front(points, minimize))
        by_index = {r.index: r for r in rows}
        text = _summary.front_table([by_index[i] for i in sorted(on_front)], objectives, len(points))
        columns = {"trial": [], "overrides": [], **{m: [] for m, _ in objectives}, "on_front": []}
        for i, values in sorted(points.items()):
            columns["trial"].append(i)
            columns["overrides"].append(by_index[i].name)
            for (m, _), v in zip(objectives, values):
                columns[m].append(v)
            columns["on_front"].append(i in on_front)
        self.client.log_table(self.run_id, data=columns, artifact_file="pareto_front.json")
        self.client.set_tag(self.run_id, "orchestrate.pareto_front", ",".join(f"#{i}" for i in sorted(on_front)))
        for i in on_front:
            self.client.set_tag(by_index[i].run_id, "orchestrate.pareto_front", "true")
        with tempfile.TemporaryDirectory() as tmp:
            png = plots.pareto(points, on_front, [m for m, _ in objectives], Path(tmp) / "pareto_front.png")
            self.client.log_artifact(self.run_id, str(png))
        if self.settings.register_model and on_front:
            text += "\n" + self.front_aliases({i: points[i] for i in on_front}, by_index)
        return text

    def front_aliases(self, front: dict[int, list[float]], by_index: dict[int, _summary.Row]) -> str:
        """On the registered model, `best_<metric>` on the version of the front's best trial by
        each objective, and the tag pareto_front=true on every front version."""
        name, said = self.settings.register_model, []
        versions = {}
        for i in front:
            found = self.client.search_model_versions(f"name='{name}' and run_id='{by_index[i].run_id}'")
            if found:
                versions[i] = max(found, key=lambda v: int(v.version))
                self.client.set_model_version_tag(name, versions[i].version, "pareto_front", "true")
        for k, (metric, low) in enumerate(self.settings.objectives):
            ranked = sorted((i for i in front if i in versions), key=lambda i: front[i][k], reverse=not low)
            if ranked:
                self.client.set_registered_model_alias(name, f"best_{metric}", versions[ranked[0]].version)
                said.append(f"models:/{name}@best_{metric} (trial {ranked[0]})")
        return f"registered: {', '.join(said)}" if said else f"registered: no version of {name} came from the front"

    def chart_keys(self, trials: int) -> tuple[str, ...]:
        """The curves of the parent's chart: each trial's train and eval loss; past plots.LEGEND_MAX
        trials, only the sweep metric's (one request per trial fewer at the sweep's end)."""
        return plots.LOSSES if trials <= plots.LEGEND_MAX else (_summary.history_key(self.settings.metric),)

    def log_chart(self, rows: list[_summary.Row]) -> None:
        keys = self.chart_keys(len(rows))
        curves = {}
        for r in rows:
            if r.run_id:
                curves[f"#{r.index} {r.name}"] = {k: [(m.step, m.value) for m in self.history(r.run_id, k)] for k in keys}
        title = "sweep trials" if keys == plots.LOSSES else f"sweep trials' {keys[0]}"
        with tempfile.TemporaryDirectory() as tmp:
            png = plots.loss_curves(curves, Path(tmp) / "trials_loss_curves.png", title=title, metrics=keys)
            self.client.log_artifact(self.run_id, str(png))

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """No "View run at <server>" from MLflow (orchestrate.tracking.settings.NO_RUN_LINKS): the summary names the store."""
        before = set_env(NO_RUN_LINKS)
        try:
            yield
        finally:
            set_env(before)

    def stop_heartbeat(self) -> None:
        heartbeat, self.heartbeat = self.heartbeat, None
        if heartbeat is not None:
            heartbeat.stop()

    def stop_server(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            self.server_warm = server.warm  # for the summary, printed once it is stopped
            server.stop()


def comparison_columns(result: "compare.Comparison") -> dict[str, list]:
    """The comparison's figures as an MLflow table: a row per configuration, mean and interval
    ends per figure (MLflow's UI shows it under the parent run's artifacts)."""
    columns: dict[str, list] = {"configuration": [g.name for g in result.groups],
                                "runs": [len(g.repeats) for g in result.groups]}
    for key, _, _, _ in compare.FIGURES:
        for part in ("mean", "low", "high"):
            columns[f"{key}_{part}"] = [shown(getattr(g.figures[key], part)) if g.figures.get(key) else None
                                        for g in result.groups]
    columns["max_train_loss_gap"] = [shown(g.deviation) for g in result.groups]
    return columns


def shown(value: float | None) -> float | None:
    """A figure to 4 significant digits: what the intervals can tell apart, for the UI's table."""
    return None if value is None or math.isnan(value) else float(f"{value:.4g}")


def read_repeat(run, name: str, status: str, history) -> "compare.Repeat":
    """A comparison's trial (`name`: its overrides) as its MLflow run holds it; `history(run id,
    key)`: the run's curve of a metric."""
    params = dict(run.data.params)
    return compare.Repeat(
        group=compare.group_of(name), status=status, run_id=run.info.run_id, start_ms=run.info.start_time,
        metrics={k.removeprefix("final/"): v for k, v in run.data.metrics.items() if k.startswith("final/")},
        losses=[(m.step, m.value) for m in history(run.info.run_id, "train/loss")],
        evals=[(m.timestamp, m.value) for m in history(run.info.run_id, "eval/loss")],
        repeat=int(params.get(compare.REPEAT_KEY, 0)), params=params)
