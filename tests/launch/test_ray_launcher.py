"""orchestrate's Hydra launcher (`hydra/launcher=orchestrate_ray`) as a generic Hydra launcher:
Hydra's own launcher test suites (as hydra_ray_launcher and hydra_joblib_launcher run them),
plugin discovery, and what it adds: errors that travel back as text, fail_fast, resources per job,
a bounded wait for jobs the cluster cannot place, dry runs, and every job's output printed before
the launcher returns.

In-process tests share one local Ray (2 CPUs, 127.0.0.1) started and stopped by the module-scoped
`local_ray` fixture; Hydra's integration suite's apps join the session's warm stack (`warm`); the
other subprocess tests (the output order, placement on a 1-CPU instance) start their own Ray
through the launcher, cold, as a command without `orchestrate up` does."""

import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hydra.core.plugins import Plugins
from hydra.errors import MissingConfigException
from hydra.plugins.launcher import Launcher
from hydra.test_utils.launcher_common_tests import IntegrationTestSuite, LauncherTestSuite

from hydra_plugins.orchestrate_ray_launcher.ray_launcher import OrchestrateRayLauncher, OrchestrateRayLauncherConf
from orchestrate.cluster import ray_cluster
from orchestrate.launch._core import END_OF_OUTPUT, OutputBarrier, RemoteTraceback, TrialError

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray(ray_shared):
    """The session's local Ray (2 CPUs) for this module's in-process sweeps."""
    return ray_shared


@pytest.fixture
def all_cpus_free(local_ray):
    """Waits until the local Ray has both CPUs free again, for tests whose message shows what is
    free: Ray frees an earlier test's workers and reservations asynchronously."""
    deadline = time.monotonic() + 60
    while local_ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, f"the local Ray still has CPUs taken: {local_ray.available_resources()}"
        time.sleep(0.1)


@pytest.fixture
def hydra_compat_version_base():
    """Hydra's launcher suite expects the defaults of an app that names no version_base (a job runs
    in its output folder: hydra.job.chdir=true); importing orchestrate.app (tests/conftest.py) has
    set version_base 1.3 for this whole process."""
    from hydra import version

    base = version.VersionBase.instance()
    before, base.version_base = base.version_base, version._UNSPECIFIED_
    yield
    base.version_base = before


def test_discovery() -> None:
    assert OrchestrateRayLauncher.__name__ in [x.__name__ for x in Plugins.instance().discover(Launcher)]


@pytest.mark.usefixtures("local_ray", "hydra_compat_version_base")
@pytest.mark.parametrize("launcher_name, overrides", [("orchestrate_ray", [])])
class TestOrchestrateRayLauncher(LauncherTestSuite):
    pass


@pytest.fixture
def warm(warm_stack, monkeypatch):
    """The session's warm stack (`orchestrate up`) for the apps Hydra's integration suite starts:
    each joins its Ray head instead of starting a local Ray (a Ray start per test, for nothing
    these tests show); the subprocess tests below show the cold path."""
    monkeypatch.setenv("ORCHESTRATE_STATE_DIR", str(warm_stack.state))


@pytest.mark.usefixtures("warm")
@pytest.mark.parametrize(
    "task_launcher_cfg, extra_flags",
    [({}, ["-m", "hydra/hydra_logging=hydra_debug", "hydra/job_logging=disabled", "hydra/launcher=orchestrate_ray"])],
)
class TestOrchestrateRayLauncherIntegration(IntegrationTestSuite):
    pass


# In-process sweeps of Hydra's test app (hydra.test_utils.a_module, configs/compose.yaml: foo, bar).

def sweep_of(hydra_sweep_runner, tmp_path, task_function, *overrides: str):
    return hydra_sweep_runner(calling_file=None, calling_module="hydra.test_utils.a_module",
                              task_function=task_function, config_path="configs", config_name="compose.yaml",
                              overrides=["hydra/launcher=orchestrate_ray", *overrides], temp_dir=tmp_path)


@pytest.mark.usefixtures("local_ray", "hydra_restore_singletons")
class TestWhatItAdds:
    def test_fail_fast_cancels_the_rest_and_raises_the_first_error(self, hydra_sweep_runner, tmp_path, capsys):
        def task(cfg):
            if cfg.a == 0:
                raise ValueError("boom in job 0")
            time.sleep(60)  # cancelled long before
            (tmp_path / f"job{cfg.a}.done").touch()

        began = time.perf_counter()
        with pytest.raises(TrialError, match=r"^ValueError: boom in job 0$") as raised:
            with sweep_of(hydra_sweep_runner, tmp_path, task, "+a=0,1,2,3", "hydra.launcher.fail_fast=true"):
                pass
        assert time.perf_counter() - began < 30
        assert isinstance(raised.value.__cause__, RemoteTraceback)
        assert 'raise ValueError("boom in job 0")' in str(raised.value.__cause__)  # the worker's traceback
        out = capsys.readouterr().out
        assert not list(tmp_path.glob("*.done"))
        for idx in (1, 2, 3):  # job 1 was running beside job 0, jobs 2 and 3 waiting for a CPU
            assert f"#{idx} : +a={idx} CANCELLED (hydra.launcher.fail_fast=true)" in out

    def test_a_job_whose_config_does_not_compose_fails_alone(self, hydra_sweep_runner, tmp_path):
        """Each job is composed as it is submitted (orchestrate_grid does not compose them all first)."""
        def task(cfg):
            (tmp_path / f"{cfg.db.driver}.ran").touch()

        with pytest.raises(TrialError, match=r"^MissingConfigException: .*nope"):
            with sweep_of(hydra_sweep_runner, tmp_path, task, "hydra/sweeper=orchestrate_grid",
                          "+db=mysql,nope,postgresql"):
                pass
        assert sorted(p.name for p in tmp_path.glob("*.ran")) == ["mysql.ran", "postgresql.ran"]

    def test_with_fail_fast_a_job_that_does_not_compose_stops_the_sweep(self, hydra_sweep_runner, tmp_path, capsys):
        def task(cfg):
            time.sleep(1)
            (tmp_path / f"{cfg.db.driver}.ran").touch()

        with pytest.raises(MissingConfigException, match="nope"):
            with sweep_of(hydra_sweep_runner, tmp_path, task, "hydra/sweeper=orchestrate_grid",
                          "hydra.launcher.cpus_per_trial=2", "hydra.launcher.fail_fast=true",
                          "+db=mysql,nope,postgresql"):
                pass
        assert not list(tmp_path.glob("postgresql.ran"))  # never submitted
        assert "#2 : +db=postgresql CANCELLED (hydra.launcher.fail_fast=true)" in capsys.readouterr().out

    def test_an_exception_that_cannot_be_unpickled_comes_back_as_its_text(self, hydra_sweep_runner, tmp_path):
        class NeedsTwoArguments(Exception):
            def __init__(self, a, b):  # pickle rebuilds it with one: TypeError on the driver
                super().__init__(f"{a}-{b}")

        def task(cfg):
            if cfg.a == 1:
                raise NeedsTwoArguments("x", "y")
            return cfg.a

        with pytest.raises(TrialError, match=r"^NeedsTwoArguments: x-y$"):
            with sweep_of(hydra_sweep_runner, tmp_path, task, "+a=0,1"):
                pass

    def test_a_job_whose_worker_dies_fails_alone(self, hydra_sweep_runner, tmp_path):
        def task(cfg):
            if cfg.a == 0:
                os._exit(3)
            (tmp_path / f"job{cfg.a}.done").touch()

        with pytest.raises(TrialError, match=r"^trial #0 \(\+a=0\) lost its process \(killed, or its node gone\): "
                                             r"WorkerCrashedError: "):
            with sweep_of(hydra_sweep_runner, tmp_path, task, "+a=0,1"):
                pass
        assert (tmp_path / "job1.done").exists()  # the other job ran to its end

    def test_each_job_gets_the_resources_asked_for(self, hydra_sweep_runner, tmp_path):
        def task(cfg):
            import ray

            return ray.get_runtime_context().get_assigned_resources()

        with sweep_of(hydra_sweep_runner, tmp_path, task, "+a=0,1,2", "hydra.launcher.cpus_per_trial=0.5") as sweep:
            assert [r.return_value for r in sweep.returns[0]] == [{"CPU": 0.5}] * 3

    @pytest.mark.usefixtures("all_cpus_free")
    def test_gpus_on_a_local_cluster_without_stop_the_sweep_at_once(self, hydra_sweep_runner, tmp_path):
        began = time.perf_counter()
        message = (r"^hydra.launcher.cpus_per_trial=1 hydra.launcher.gpus_per_trial=1: a trial asks for "
                   r"\{'CPU': 1.0, 'GPU': 1.0\} and could not be placed on this cluster, which cannot grow; "
                   r"the Ray cluster has \{'CPU': 2.0, 'GPU': 0.0\} in all, free now \{'CPU': 2.0, 'GPU': 0.0\}$")
        with pytest.raises(ray_cluster.PlacementError, match=message):
            with sweep_of(hydra_sweep_runner, tmp_path, None, "+a=0,1", "hydra.launcher.gpus_per_trial=1",
                          "hydra.launcher.placement_timeout_s=1"):
                pass
        assert time.perf_counter() - began < 15

    def test_dry_run_prints_the_plan_and_runs_nothing(self, hydra_sweep_runner, tmp_path, capsys):
        def task(cfg):
            raise AssertionError("a dry run ran a job")

        with sweep_of(hydra_sweep_runner, tmp_path, task, "+a=0,1", "hydra.launcher.dry_run=true",
                      "hydra.launcher.cpus_per_trial=2") as sweep:
            assert [r.return_value for r in sweep.returns[0]] == [None, None]
            assert [p.name for p in Path(sweep.temp_dir).iterdir()] == ["multirun.yaml"]  # the sweeper's
        out = capsys.readouterr().out
        assert "plan: 2 trial(s) on Ray (local, 2 CPUs in all), each asking for {'CPU': 2.0}" in out
        assert "\t#0 : +a=0\n\t#1 : +a=1\n" in out

    def test_bad_settings_are_refused(self, hydra_sweep_runner, tmp_path):
        with pytest.raises(ValueError, match=r"hydra.launcher.cpus_per_trial=-1.0: must be 0 or more"):
            with sweep_of(hydra_sweep_runner, tmp_path, None, "+a=0", "hydra.launcher.cpus_per_trial=-1"):
                pass


@pytest.mark.usefixtures("local_ray")
class TestWaitForPlacement:
    @pytest.mark.usefixtures("all_cpus_free")
    def test_bundles_that_fit_return_at_once(self):
        began = time.perf_counter()
        ray_cluster.wait_for_placement([{"CPU": 1}] * 2, "PACK", 5, "x", "t")
        ray_cluster.wait_for_placement([{"CPU": 0, "GPU": 0}], "PACK", 5, "x", "t")  # nothing to reserve
        assert time.perf_counter() - began < 5

    @pytest.mark.usefixtures("all_cpus_free")
    def test_bundles_that_do_not_fit_say_what_was_asked(self):
        began = time.perf_counter()
        with pytest.raises(ray_cluster.PlacementError, match=(
                r"^trainer.num_workers=3: the run asks for 3 x \{'CPU': 1\} \(SPREAD\) and could not be placed "
                r"on this cluster, which cannot grow; the Ray cluster has \{'CPU': 2.0\} in all, "
                r"free now \{'CPU': 2.0\}$")):
            ray_cluster.wait_for_placement([{"CPU": 1}] * 3, "SPREAD", 0.5, "trainer.num_workers=3: the run",
                                           "backend.placement_timeout_s")
        assert time.perf_counter() - began < 5


def test_an_asynchronous_sweeper_queues_half_the_slots_ahead_and_none_for_jobs_that_ask_for_nothing(monkeypatch):
    """Trials queued in Ray beyond the slots start the moment one frees; a job that asks for no
    CPU or GPU is not held by Ray at all, so queueing one would run it beside the slots."""
    from orchestrate.launch import _core

    monkeypatch.setattr(_core, "slots", lambda conf: 4)
    assert _core.queued(OrchestrateRayLauncherConf(cpus_per_trial=1)) == 2
    assert _core.queued(OrchestrateRayLauncherConf(cpus_per_trial=0, gpus_per_trial=1)) == 2
    assert _core.queued(OrchestrateRayLauncherConf(cpus_per_trial=0, gpus_per_trial=0)) == 0
    monkeypatch.setattr(_core, "slots", lambda conf: 1)
    assert _core.queued(OrchestrateRayLauncherConf(cpus_per_trial=1)) == 1


def test_trial_error_keeps_its_text_and_traceback_through_pickle():
    error = pickle.loads(pickle.dumps(TrialError("KeyError: 'x'", "Traceback ...\nKeyError: 'x'\n")))
    assert str(error) == "KeyError: 'x'" and "Traceback ..." in str(error.__cause__)


def test_end_markers_are_taken_out_of_the_printed_lines():
    barrier = OutputBarrier()
    lines = ["a", f"{END_OF_OUTPUT}abc:1", f"no newline{END_OF_OUTPUT}abc:2", "b"]
    assert barrier._take_markers(lines) == (["a", "no newline", "b"], [f"{END_OF_OUTPUT}abc:1", f"{END_OF_OUTPUT}abc:2"])


# Subprocess sweeps: each starts its own local Ray through the launcher.

APP = '''
import sys, time
import hydra
from hydra.experimental.callback import Callback


class Summary(Callback):
    def on_multirun_end(self, config, **kwargs):
        print("SUMMARY", flush=True)


@hydra.main(version_base=None, config_path=".", config_name="config")
def main(cfg):
    time.sleep(cfg.x * cfg.sleep)
    for i in range(cfg.lines):
        print(f"OUT job={cfg.x} line={i}")
        print(f"ERR job={cfg.x} line={i}", file=sys.stderr)
    print(f"TAIL job={cfg.x}", end="")  # the job's last output, with no newline
    return cfg.x


if __name__ == "__main__":
    main()
'''
CONFIG = """
x: 0
lines: 50
sleep: 0
hydra:
  callbacks:
    summary:
      _target_: __main__.Summary
"""


def run_app(tmp_path, *overrides: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "config.yaml").write_text(textwrap.dedent(CONFIG))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    began = time.perf_counter()
    # One pipe for both streams: the order in it is the order in which they were written.
    done = subprocess.run([sys.executable, "app.py", "-m", "hydra/launcher=orchestrate_ray", *overrides], cwd=tmp_path,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return done, time.perf_counter() - began


def test_every_job_output_is_printed_before_the_launcher_returns(tmp_path):
    # Job 1 starts printing 3 s after job 0 has finished: job 0's lines must show up by then (live),
    # and every line of both before the on_multirun_end callback's SUMMARY.
    done, _ = run_app(tmp_path, "x=0,1,2", "sleep=3", "hydra.launcher.num_cpus=3")
    out = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)  # Ray colours its "(#0 pid=...)" prefixes
    assert done.returncode == 0, out[-3000:]
    lines = out.splitlines()
    summary = lines.index("SUMMARY")
    expected = [f"{stream} job={x} line={i}" for stream in ("OUT", "ERR") for x in range(3) for i in range(50)]
    expected += [f"TAIL job={x}" for x in range(3)]
    printed = {line.split(") ", 1)[1]: n for n, line in enumerate(lines) if ") " in line and line.startswith("(#")}
    assert set(expected) <= set(printed), sorted(set(expected) - set(printed))[:5]
    assert max(printed[e] for e in expected) < summary == len(lines) - 1
    job_1_done = next(n for n, line in enumerate(lines) if "#1 : x=1 " in line and "COMPLETED" in line)
    assert max(printed[e] for e in expected if "job=0" in e) < job_1_done
    assert END_OF_OUTPUT not in out
    assert "repeated" not in out  # Ray's log deduplication is off for sweeps: every job's lines show
    assert "'node:127.0.0.1'" in next(line for line in lines if "Ray ready" in line)  # on loopback


def test_a_trial_that_cannot_be_placed_stops_the_sweep_with_one_message(tmp_path):
    done, took = run_app(tmp_path, "x=0,1", "hydra.launcher.num_cpus=1", "hydra.launcher.cpus_per_trial=2",
                         "hydra.launcher.placement_timeout_s=2", timeout=120)
    assert done.returncode != 0
    assert ("PlacementError: hydra.launcher.cpus_per_trial=2: a trial asks for {'CPU': 2.0} and could not be "
            "placed on this cluster, which cannot grow; the Ray cluster has {'CPU': 1.0} in all, free now "
            "{'CPU': 1.0}") in done.stdout
    assert "OUT job=" not in done.stdout
    assert took < 60  # Ray's start (about 8 s here) and the 2 s wait, not the default 60 s
