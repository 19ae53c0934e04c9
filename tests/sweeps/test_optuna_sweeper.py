"""hydra/sweeper=orchestrate_optuna (hydra_plugins/orchestrate_optuna_sweeper, orchestrate.sweeps._optuna
and .pruning): the plugin is found, Hydra's Optuna search-space syntax becomes the same
distributions, the study lives beside the MLflow store, and end to end (`python -m orchestrate`
as a subprocess, read back through MlflowClient and Optuna): losing trials stop at an evaluation,
FINISHED with a `pruned` tag, on Hydra's basic launcher and on orchestrate's Ray launcher, where
a freed slot starts the next trial while the others still run; the same sweep run again continues
its study without running a trial twice."""

import re

import optuna
import pytest
from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from hydra_plugins.orchestrate_optuna_sweeper.optuna_sweeper import OrchestrateOptunaSweeper
from orchestrate.schema import ConfigError
from orchestrate.sweeps import _optuna
from tests.conftest import long, sweep_runs
from tests.sweeps.test_sweeps import QUICK, sweep

# Three learning rates as a grid (a seeded order), the worst last: the median pruner (after one
# trial that runs to the end) stops it at its first evaluation, where it is far behind.
PRUNED_SWEEP = ["+sweep=lr_optuna", "backend=torch", *QUICK, "trainer.max_steps=40", "trainer.evaluation_period=10",
                "hydra/sweeper/sampler=grid", "hydra.sweeper.sampler.seed=1",
                "hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1",
                "hydra.sweeper.params={optimizer.lr: 'choice(0.03, 0.01, 0.00001)', trainer.batch_size: '32'}"]


def test_discovery_and_its_config_groups() -> None:
    assert OrchestrateOptunaSweeper.__name__ in [x.__name__ for x in Plugins.instance().discover(Sweeper)]
    repo = ConfigStore.instance().repo["hydra"]["sweeper"]
    assert "orchestrate_optuna.yaml" in repo
    assert {"tpe.yaml", "random.yaml", "grid.yaml"} <= set(repo["sampler"])
    assert {"median.yaml", "successive_halving.yaml", "hyperband.yaml", "none.yaml"} <= set(repo["pruner"])


def test_hydras_optuna_syntax_becomes_the_same_distributions() -> None:
    space = _optuna.SearchSpace.parse(
        {"optimizer.lr": "tag(log, interval(1e-4, 3e-2))", "trainer.batch_size": "choice(32, 64, 128)",
         "model.depth": "range(1, 10, 3)", "x": "interval(0.1, 0.5)", "n": "int(interval(1, 5))"},
        ["trainer.max_steps=50", "backend=choice(torch, ondevice)", "x=0.2"])
    d = space.distributions
    assert d["optimizer.lr"] == FloatDistribution(1e-4, 3e-2, log=True)
    assert d["trainer.batch_size"] == CategoricalDistribution([32, 64, 128])
    assert d["model.depth"] == IntDistribution(1, 7, step=3)  # range's stop is excluded, as in Hydra's grid
    assert d["n"] == IntDistribution(1, 5)
    assert d["backend"] == CategoricalDistribution(["torch", "ondevice"])
    assert "x" not in d and space.fixed == {"trainer.max_steps": "50", "x": "0.2"}  # the command line's wins
    assert space.overrides({"optimizer.lr": 0.001}) == ["optimizer.lr=0.001", "trainer.max_steps=50", "x=0.2"]
    with pytest.raises(ConfigError, match="sampler=grid runs every combination and cannot draw from an interval"):
        space.grid()
    with pytest.raises(ConfigError, match="nothing to search"):
        _optuna.SearchSpace.parse({"a": "1"}, [])


def test_the_study_lives_beside_the_mlflow_store(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _optuna.default_storage("sqlite:///runs/mlflow.db") == f"sqlite:///{tmp_path}/runs/mlflow-optuna.db"
    assert _optuna.default_storage("postgresql://u:p@db:5432/mlflow") == "postgresql://u:p@db:5432/mlflow_optuna"
    assert _optuna.default_storage("http://127.0.0.1:5000") == f"sqlite:///{tmp_path}/optuna.db"


def test_a_bad_sweeper_setting_is_one_line_before_any_run_opens(tmp_path):
    done = sweep("+sweep=lr_optuna", *QUICK, "hydra/launcher=basic", "hydra.sweeper.n_jobs=2", cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "hydra.sweeper.n_jobs=2: hydra/launcher=basic runs one job at a time in this process" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "mlflow-optuna.db").exists()
    assert not (tmp_path / "mlflow.db").exists() or not sweep_runs(tmp_path)[1]  # no parent run


def study_of(folder):
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{folder}/mlflow-optuna.db")
    return optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{folder}/mlflow-optuna.db")


def by_lr(children) -> dict[str, object]:
    return {c.data.params["optimizer.lr"]: c for c in children}


@pytest.fixture(scope="module")
def pruned_on_basic(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("basic")
    done = sweep(*PRUNED_SWEEP, "hydra/launcher=basic", "hydra.sweeper.n_trials=2", cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    again = sweep(*PRUNED_SWEEP, "hydra/launcher=basic", "hydra.sweeper.n_trials=3", cwd=cwd)
    assert again.returncode == 0, again.stderr[-3000:]
    return cwd, done, again


@pytest.mark.slow  # commands as a user types them
def test_a_losing_trial_stops_at_an_evaluation_finished_and_tagged(pruned_on_basic):
    """The grid's seeded order runs lr=0.03 first (to the end: the pruner's one startup trial);
    both later trials are behind it at their first evaluation and stop there."""
    cwd, _, again = pruned_on_basic
    client, (parent,), children = sweep_runs(cwd)
    runs = by_lr(children)
    assert set(runs) == {"0.03", "0.01", "1e-05"} and all(r.info.status == "FINISHED" for r in children)
    first = runs["0.03"]
    assert "pruned" not in first.data.tags
    assert [m.step for m in client.get_metric_history(first.info.run_id, "eval/loss")] == [10, 20, 30, 40]
    at_10 = {lr: client.get_metric_history(r.info.run_id, "eval/loss")[0].value for lr, r in runs.items()}
    for lr in ("0.01", "1e-05"):
        assert runs[lr].data.tags["pruned"] == "10" and at_10[lr] > at_10["0.03"]
        assert [m.step for m in client.get_metric_history(runs[lr].info.run_id, "eval/loss")] == [10]
        assert runs[lr].data.metrics["final/pruned_at"] == 10
    study = study_of(cwd)
    assert {t.params["optimizer.lr"]: t.state.name for t in study.trials} == {
        0.03: "COMPLETE", 0.01: "PRUNED", 1e-05: "PRUNED"}
    assert study.best_params == {"optimizer.lr": 0.03}
    # The summary says where, and what the sweep spent: 40 + 10 + 10 trial-steps of 3 x 40.
    assert len(re.findall(r"\| PRUNED at 10( \(earlier attempt\))? \|", again.stdout)) == 2
    assert "pruned: 2 of 3 trials: 1 (step 10), 2 (step 10); trial-steps run: 60 of 120 without pruning " \
           "(50% of the budget)" in again.stdout


@pytest.mark.slow  # commands as a user types them
def test_the_same_sweep_again_continues_its_study(pruned_on_basic):
    """The second command asked for 3 trials in all: only the third ran, under the same parent run."""
    cwd, done, again = pruned_on_basic
    client, parents, children = sweep_runs(cwd)
    assert len(parents) == 1 and len(children) == 3
    assert "2 of 3 trials done; running 1" in again.stdout
    assert len(study_of(cwd).trials) == 3
    # The first command's two, not run again: one finished, one pruned.
    assert again.stdout.count("| SKIPPED |") == 1 and again.stdout.count("| PRUNED at 10 (earlier attempt) |") == 1


@pytest.mark.slow  # commands as a user types them
@long("test_a_losing_trial_stops_at_an_evaluation_finished_and_tagged (the pruner's decision); "
      "test_ctrl_c_ends_the_sweep_with_its_summary_and_the_same_command_goes_on (two trials at once on Ray)")
def test_a_pruned_sweep_on_ray_keeps_both_slots_busy(tmp_path):
    """Two slots (2 CPUs), a grid of long and short trials in a seeded order: (lr 0.03, 1500 steps)
    and (0.03, 300) start together; when the short one ends, its slot takes (1e-05, 300) at once,
    while the long one still runs (a batch sweeper would wait for it), and that trial, behind the
    finished one at its first evaluation, is pruned there; so is (1e-05, 1500) after it."""
    args = ["+sweep=lr_optuna", "backend=torch", *QUICK, "trainer.evaluation_period=50", "trainer.display_loss_steps=50",
            "hydra/sweeper/sampler=grid", "hydra.sweeper.sampler.seed=4", "hydra/sweeper/pruner=median",
            "hydra.sweeper.pruner.n_startup_trials=1", "hydra.sweeper.n_trials=4", "hydra.launcher.num_cpus=2",
            "hydra.sweeper.params={optimizer.lr: 'choice(0.03, 0.00001)', trainer.batch_size: '32'}",
            "trainer.max_steps=choice(1500, 300)"]  # a sweep on the command line joins the search space
    done = sweep(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "running 4, 2 at a time" in done.stdout
    client, _, children = sweep_runs(tmp_path)
    runs = {(c.data.params["optimizer.lr"], c.data.params["trainer.max_steps"]): c.info for c in children}
    tags = {key: c.data.tags.get("pruned") for key, c in zip(runs, children)}
    assert tags == {("0.03", "1500"): None, ("0.03", "300"): None, ("1e-05", "300"): "50", ("1e-05", "1500"): "50"}
    assert all(info.status == "FINISHED" for info in runs.values())
    long, short, freed = runs["0.03", "1500"], runs["0.03", "300"], runs["1e-05", "300"]
    assert short.end_time <= freed.start_time < long.end_time, (short, freed, long)


@pytest.mark.slow
@long("test_a_losing_trial_stops_at_an_evaluation_finished_and_tagged (the pruner's decision); "
      "tests/backends/test_contract.py::test_a_diverging_run_stops_at_that_step_failed_with_the_checkpoint_before_it"
      "[runner-1] (both ranks stop at rank 0's step)")
def test_the_runners_workers_stop_together_where_the_pruner_says(tmp_path):
    """Two ranks on Ray Train: rank 0 evaluates and asks the study, both stop at its step."""
    # Two trials: the first sets the rung, the second (worse) stops at it on both ranks.
    done = sweep(*PRUNED_SWEEP, "hydra/launcher=basic", "hydra.sweeper.n_trials=2", "backend=runner",
                 "backend.engine=torch", "trainer.num_workers=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    client, _, children = sweep_runs(tmp_path)
    runs = by_lr(children)
    assert {lr: r.data.tags.get("pruned") for lr, r in runs.items()} == {"0.03": None, "1e-05": "10"}
    assert all(r.info.status == "FINISHED" and r.data.tags["backend"] == "runner" for r in children)
    assert [m.step for m in client.get_metric_history(runs["1e-05"].info.run_id, "eval/loss")] == [10]


@pytest.mark.slow
@long("tests/sweeps/test_runs.py::test_three_kills_then_the_same_command_leave_every_trial_once_and_no_run_running "
      "(a Ctrl-C among its kills, the same command after it)")
def test_ctrl_c_ends_the_sweep_with_its_summary_and_the_same_command_goes_on(tmp_path):
    """Ctrl-C reaches every process of the terminal's group: the sweep (its server and Ray trials
    included) ends within seconds, exit 130, and the summary says which trials were stopped
    (KILLED in MLflow). The same command afterwards fails the interrupted trials in the study and
    runs their parameters again, and the study ends with every trial complete."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT
    from tests.test_signals import HeldData

    marker = tmp_path / "hold"
    marker.touch()  # every trial holds at its step 5 while it exists
    args = ["+sweep=lr_optuna", "backend=torch", *QUICK, "trainer.evaluation_period=0", "hydra.sweeper.n_trials=3",
            "hydra.launcher.num_cpus=2", f"data._target_={HeldData.__module__}.HeldData", "+data.hold_at=4",
            f"+data.marker={marker}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    # A terminal's Ctrl-C: SIGINT (not ignored, as it is for a shell's background job) to the group.
    proc = subprocess.Popen([sys.executable, "-m", "orchestrate", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while len(list(tmp_path.glob("hold.held"))) < 1 or len(list(tmp_path.glob("multirun/*/*/1/app.log"))) < 1:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    time.sleep(2)  # both slots' trials are running (or held)
    os.killpg(proc.pid, signal.SIGINT)
    stopped = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130 and time.monotonic() - stopped < 60, out[-3000:]
    assert "stopped by Ctrl-C" in out and out.rstrip().splitlines()[-1].startswith("then open"), out[-3000:]
    _, _, children = sweep_runs(tmp_path)
    assert sorted(c.info.status for c in children) == ["KILLED", "KILLED"]
    assert sorted(t.state.name for t in study_of(tmp_path).trials) == ["RUNNING", "RUNNING"]
    marker.unlink()
    again = sweep(*args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    states = [t.state.name for t in study_of(tmp_path).trials]
    assert states.count("FAIL") == 2 and states.count("COMPLETE") == 3  # both interrupted trials ran again
    interrupted = {t.params["optimizer.lr"] for t in study_of(tmp_path).trials if t.state.name == "FAIL"}
    assert interrupted <= {t.params["optimizer.lr"] for t in study_of(tmp_path).trials if t.state.name == "COMPLETE"}


def test_a_continued_study_draws_new_trials_and_never_counts_a_repeat(tmp_path) -> None:
    """The same sweep with a larger n_trials continues its study: its seeded sampler must not
    replay the first proposals (the earlier trials' own), and the same command draws the same new
    ones. A proposal that repeats a finished trial is told FAIL (`duplicate_of`), not run."""
    from optuna.trial import TrialState

    from tests.conftest import multirun_config

    def opened(seed: int = 0, params: dict | None = None):
        config = multirun_config(["sweep=lr_optuna", "data=synthetic", "trainer=quick",
                                  f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.sweeper.sampler.seed={seed}",
                                  *([f"hydra.sweeper.study_name=s{seed}"] if params else [])])
        conf = config.hydra.sweeper
        space = _optuna.SearchSpace.parse(params or conf.params, [])
        return _optuna.open_study(conf, config, space)[0], space

    study, space = opened()
    first = [study.ask(space.distributions) for _ in range(2)]
    for trial in first:
        study.tell(trial, 1.0)
    # Continued twice from the same two trials (two runs of the same command): the same new draw,
    # and not the first command's.
    one, other = opened(), opened()
    drawn = [study_.ask(space.distributions).params for study_, _ in (one, other)]
    assert drawn[0] == drawn[1]
    assert tuple(sorted(drawn[0].items())) not in {tuple(sorted(t.params.items())) for t in first}

    # A discrete space with one point, taken: every proposal repeats it, none is counted or run.
    tiny, tiny_space = opened(seed=1, params={"trainer.batch_size": "choice(32)"})
    done = tiny.ask(tiny_space.distributions)
    tiny.tell(done, 1.0)
    assert _optuna.ask_new(tiny, tiny_space) is None
    repeats = tiny.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    assert len(repeats) == _optuna.DUPLICATE_ASKS and all(t.user_attrs["duplicate_of"] == 0 for t in repeats)
