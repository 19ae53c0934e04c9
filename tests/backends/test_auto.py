"""backend=auto: it probes every single-process backend (a user's own ones in `--config-dir`
included), chooses the fastest whose loss agrees with torch's, lists refusals with their reasons,
and trains the run exactly as the chosen backend would have, in one MLflow run tagged with the
choice. Two test backends are wrong on purpose (tests/helpers.py): one slow, one that disagrees."""

import math
import os

import pytest

from orchestrate import app, schema
from orchestrate.__main__ import main
from orchestrate.backends.auto import Probe, judge
from orchestrate.job import Job
from tests.conftest import client_for, metric_steps
from tests.helpers import fit_untracked

QUICK = ["data=synthetic", "trainer=quick", "model.hidden=[32]", "optimizer.lr=0.01"]
TEST_BACKENDS = {  # conf/backend files of the user's own, in the test's config folder
    "slow_torch": "_target_: tests.helpers.SlowTorchBackend\nname: slow_torch\nintra_op_threads: 0\ndelay_ms: 5\n",
    "off_torch": "_target_: tests.helpers.OffTorchBackend\nname: off_torch\nintra_op_threads: 0\nshift: 10\n",
}


def rows(markdown: str) -> dict[str, list[str]]:
    """The probe table's rows by backend: CPU budget, samples/s, step ms, warm-up s, run s, probe
    loss, vs reference, verdict."""
    found = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("backend", "---"):
            found[cells[0]] = cells[1:]
    return found


def test_auto_chooses_neither_the_slow_nor_the_disagreeing_backend_of_a_users_config_dir(
        mlflow_server, tmp_path, monkeypatch, capfd):
    """The command line as a user types it, with two backend files of their own: every backend is
    probed (candidates: null), the run trains on one that is neither. (capfd: ORTModule redirects
    the process's file descriptors while it exports.)"""
    for name, text in TEST_BACKENDS.items():
        (tmp_path / "conf" / "backend").mkdir(parents=True, exist_ok=True)
        (tmp_path / "conf" / "backend" / f"{name}.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["orchestrate", "--config-dir", "conf", "backend=auto", *QUICK,
                                     "trainer.max_steps=40", f"tracking.uri={mlflow_server}",
                                     "tracking.experiment=auto", f"hydra.run.dir={tmp_path / 'out'}"])
    main()
    printed = capfd.readouterr().out

    client = client_for(mlflow_server)
    [run] = client.search_runs([client.get_experiment_by_name("auto").experiment_id])
    table = rows(open(client.download_artifacts(run.info.run_id, "auto_probe.md")).read())
    assert set(table) == {"torch", "compile", "ortmodule", "ondevice", "slow_torch", "off_torch"}
    [chosen] = [name for name, row in table.items() if row[-1].startswith("chosen")]
    assert chosen not in TEST_BACKENDS
    # The same losses as torch, but slower: stopped once slower than one that finished before it.
    assert table["slow_torch"][-1].startswith(("agrees; ", "slower than ")), table["slow_torch"]
    assert float(table["slow_torch"][1].replace(",", "")) < float(table[chosen][1].replace(",", ""))
    assert table["off_torch"][-1].startswith("disagrees: loss ")
    assert abs(float(table["off_torch"][6].rstrip("%"))) > 10  # its difference from torch, beyond the tolerance
    assert table["torch"][6] == "+0.00%"
    # The shipped candidates probed on one CPU budget ("threads + loader of cores"), this machine's
    # cores; the user's files set intra_op_threads: 0 (the library's default), and the table says so.
    cores = len(os.sched_getaffinity(0))
    [budget] = {table[name][0] for name in ("torch", "compile", "ortmodule", "ondevice") if table[name][1] != "-"}
    assert budget.endswith(f" + 0 of {cores}"), table
    assert table["off_torch"][0] == f"default + 0 of {cores} (set: backend.intra_op_threads=0)"
    assert run.info.status == "FINISHED"
    assert (run.data.tags["backend"], run.data.tags["auto"]) == (chosen, "true")
    assert "| off_torch |" in printed and printed.index("| off_torch |") < printed.index(f"backend {chosen}: 40 steps")
    losses = [v for _, v in metric_steps(client, run.info.run_id, "train/loss")]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0]  # the run itself: logged every 5 of 40 steps


def test_auto_trains_exactly_the_run_the_chosen_backend_would_have(tmp_path):
    """Dropout draws from torch's RNG: the run repeats backend=torch's losses only if the probe put
    the RNG back as it was after the model's build, and the model kept its initial weights."""
    dropout = [*QUICK, "model._target_=tests.helpers.DropoutMLP", "trainer.max_steps=20"]
    auto = fit_untracked(["backend=auto", "backend.candidates=[torch]", *dropout], tmp_path / "auto")
    torch_ = fit_untracked(["backend=torch", *dropout], tmp_path / "torch")
    assert auto.backend.name == "torch" and auto.meter.name == "torch"
    assert auto.meter.history["train/loss"] == torch_.meter.history["train/loss"]
    assert {p.name for p in (tmp_path / "auto").iterdir()} >= {"auto_probe.md", "model.onnx", "checkpoints"}
    assert sorted(p.name for p in (tmp_path / "auto" / "checkpoints").iterdir()) == ["step_0000015.pt",
                                                                                      "step_0000020.pt"]
    assert auto.meter.final["auto_probe_s"] > 0


@pytest.mark.ort
def test_a_candidate_that_refuses_the_model_is_listed_with_its_reason(tmp_path):
    """ORT 1.19 has no gradient for CumSum: the on-device backend refuses the model, torch trains it."""
    job = fit_untracked(["backend=auto", "backend.candidates=[ondevice,torch]", *QUICK,
                         "model._target_=tests.helpers.CumulativeMLP", "trainer.max_steps=10"], tmp_path)
    assert job.backend.name == "torch"
    table = rows((tmp_path / "auto_probe.md").read_text())
    assert table["torch"][-1] == "chosen: the shortest run that agrees"
    assert table["ondevice"][:6] == ["-"] * 6
    assert table["ondevice"][-1].startswith("refused: model=tests.helpers.CumulativeMLP cannot train with "
                                            "backend=ondevice: ORT 1.19.2 has no gradient for the ONNX op CumSum")


@pytest.mark.ort
def test_auto_trains_in_a_precision_only_some_candidates_take(tmp_path):
    job = fit_untracked(["backend=auto", "backend.candidates=[ondevice,torch]", *QUICK, "trainer.precision=bf16",
                         "trainer.max_steps=10"], tmp_path)
    assert job.backend.name == "torch"
    assert rows((tmp_path / "auto_probe.md").read_text())["ondevice"][-1].startswith(
        "refused: trainer.precision=bf16: backend=ondevice trains in fp32")


@pytest.mark.parametrize("overrides,message", [
    pytest.param(["backend.candidates=[ortmodule,ondevice]", "model._target_=tests.helpers.FftMLP"],
                 "^backend=auto: every candidate refuses this config: ortmodule: model \\(tests.helpers.FftMLP\\) cannot "
                 "be exported by ORTModule at opset 17: .*; ondevice: model \\(tests.helpers.FftMLP\\) cannot be exported",
                 marks=pytest.mark.ort),
    (["backend.candidates=[runner]"], "^backend.candidates: runner is not a backend this can probe; allowed: "
                                      "compile, ondevice, ortmodule, torch$"),
    (["backend.candidates=[]"], "^backend.candidates=\\[\\]: name at least one backend"),
    (["backend.tolerance=0"], "^backend.tolerance=0: must be above 0$"),
    (["backend.probe_steps=0"], "^backend.probe_steps=0: must be at least 1$"),
    (["trainer.resume=auto"], "^trainer.resume=auto: backend=auto cannot load its checkpoints to continue; "
                              "allowed with backend=compile, ondevice, ortmodule, runner, torch$"),
    (["backend=runner", "backend.engine=auto", "trainer.resume=auto"],
     "^trainer.resume=auto: backend.engine=auto cannot continue a run"),
])
def test_bad_auto_settings_are_refused_before_any_run(overrides, message, make_cfg):
    with pytest.raises(schema.ConfigError, match=message):
        Job.prepare(make_cfg("backend=auto", *QUICK, *overrides))


def probes(*specs: tuple) -> list[Probe]:
    """Probes that ran 35 steps at `speed` samples/s (a batch of 1) to `loss` (a nan loss: none
    finished), after a warm-up of `warmup_s` seconds (0 unless given)."""
    return [Probe(name, samples_per_sec=speed, step_time_ms=1000 / speed, losses={35: loss},
                  finished=math.isfinite(loss), warmup_s=warmup_s[0] if warmup_s else 0.0)
            for name, speed, loss, *warmup_s in specs]


def test_the_fastest_backend_that_disagrees_is_not_chosen():
    found = probes(("torch", 100.0, 1.0), ("fast", 500.0, 1.5), ("close", 200.0, 1.05))
    choice = judge(found, "torch", 0.1, "backend=auto", 1000)
    assert choice.chosen.name == "close"
    assert found[1].verdict == "disagrees: loss 1.5000 against torch's 1.0000 (50.0% apart)"
    assert found[0].verdict == "agrees; 0.50x the chosen one's samples/s"


def test_a_compilers_warm_up_is_paid_back_only_by_a_long_enough_run():
    """torch.compile's steps at 2x eager's speed after a 30 s compile: eager's run is the shorter
    up to 30 s of eager steps (3,000 here: 10 ms each, 5 ms compiled), compile's past it."""
    for steps, chosen in ((1_000, "torch"), (5_999, "torch"), (6_001, "compile"), (100_000, "compile")):
        found = probes(("torch", 100.0, 1.0), ("compile", 200.0, 1.0, 30.0))
        assert judge(found, "torch", 0.1, "backend=auto", steps).chosen.name == chosen, steps
    found = probes(("torch", 100.0, 1.0), ("compile", 200.0, 1.0, 30.0))
    judge(found, "torch", 0.1, "backend=auto", 1_000)
    assert found[1].verdict == ("agrees; 2.00x the chosen one's samples/s, but its 30.0 s warm-up makes the run "
                                "longer (35.0 s against 10.0 s)")


def test_a_probe_whose_run_cannot_be_the_cheapest_stops_and_one_that_still_can_goes_on():
    """The stopwatch weighs warm-ups too: after compile finished (30 s warm-up, 5 ms steps), eager
    (no warm-up, 10 ms steps) is not stopped on a short run, and is on a long one."""
    from types import SimpleNamespace

    from orchestrate.backends.auto import Slower, Stopwatch

    trainer = SimpleNamespace(display_loss_steps=5, max_steps=35)
    compiled = Probe("compile", step_time_ms=5.0, timed_s=0.15, warmup_s=30.0, finished=True)
    for after_warmup, stops in ((1_000, False), (100_000, True)):
        watch = Stopwatch(trainer, compiled, after_warmup)
        watch(5, {"perf/step_time_ms": 10.0})
        try:
            for step in range(10, 35, 5):
                watch(step, {"perf/step_time_ms": 10.0})
            stopped = False
        except Slower:
            stopped = True
        assert stopped == stops, after_warmup


def test_without_the_reference_the_first_that_finished_is_compared_with_and_said():
    found = probes(("ondevice", 100.0, 1.0), ("ortmodule", 50.0, 1.01))
    choice = judge(found, "torch", 0.1, "backend=auto", 1000)
    assert (choice.chosen.name, choice.base.name) == ("ondevice", "ondevice")
    assert choice.compared == "losses at step 35 compared with ondevice's (torch is not a candidate)"
    found = probes(("ondevice", 100.0, 1.0), ("torch", math.nan, math.nan))
    found[1].verdict = "refused: model (M) cannot run on data's sample batch"
    assert judge(found, "torch", 0.1, "backend=auto", 1000).compared == ("losses at step 35 compared with ondevice's "
                                                                   "(torch refused)")


def test_a_reference_stopped_as_slower_is_compared_with_at_the_step_it_stopped():
    """Every probe logs its loss at the same steps: a reference stopped at step 10 (slower than one
    that finished) still judges the others, there."""
    def three():
        return (Probe("off", samples_per_sec=900.0, losses={5: 3.0, 10: 2.5, 35: 2.0}, finished=True),
                Probe("ondevice", samples_per_sec=500.0, losses={5: 2.0, 10: 1.5, 35: 1.0}, finished=True),
                Probe("torch", samples_per_sec=100.0, losses={5: 2.0, 10: 1.52}, stopped_at=10,
                      verdict="slower than off: stopped at step 10"))

    off, ondevice, torch_ = three()
    choice = judge([off, ondevice, torch_], "torch", 0.1, "backend=auto", 1000)
    assert choice.chosen is ondevice and choice.compared == "losses at step 10 compared with torch's"
    assert off.verdict == "disagrees: loss 2.5000 against torch's 1.5200 (64.5% apart)"
    assert torch_.verdict == "slower than off: stopped at step 10"
    off, ondevice, torch_ = three()  # one stopped as slower is compared at that step: wrong too, it says so
    off.stopped_at, off.finished, off.losses = 10, False, {5: 3.0, 10: 2.5}
    off.verdict = "slower than ondevice: stopped at step 10"
    judge([ondevice, off, torch_], "ondevice", 0.1, "backend=auto", 1000)
    assert off.verdict == ("disagrees: loss 2.5000 against ondevice's 1.5000 at step 10 (66.7% apart); slower than "
                           "ondevice: stopped at step 10")
    assert torch_.verdict.startswith("slower than off") and abs(torch_.difference - 0.0133) < 1e-3
    off, _, torch_ = three()  # when every faster one disagrees, the reference itself trains the run
    assert judge([off, torch_], "torch", 0.1, "backend=auto", 1000).chosen is torch_
    assert torch_.verdict == "chosen: the shortest run that agrees (stopped at step 10)"


def test_when_no_probe_finished_the_reference_trains_the_run_and_shows_why():
    found = probes(("ondevice", math.nan, math.nan), ("torch", math.nan, math.nan))
    found[0].verdict, found[1].verdict = "diverged: loss became nan at step 7", "diverged: loss became nan at step 7"
    choice = judge(found, "torch", 0.1, "backend=auto", 1000)
    assert choice.chosen.name == "torch" and choice.base is None
    assert found[1].verdict.endswith("chosen all the same: no probe ended with a finite loss, and the run shows why")


@pytest.mark.slow  # 23 s on 2 cores: Ray Train's workers start after the probes
def test_the_runner_chooses_its_engine_the_same_way(ray_shared, make_cfg, tmp_path, capfd):
    """backend.engine=auto: the driver probes every engine that runs on the workers, in its own
    process, then two workers train with the chosen one (its checkpoints are that engine's)."""
    cfg = make_cfg("backend=runner", "backend.engine=auto", "trainer.num_workers=2", "trainer.batch_size=16", *QUICK)
    result = app.train(cfg, tmp_path / "out")
    run = client_for(cfg.tracking.uri).get_run(result.run_id)
    table = rows((tmp_path / "out" / "auto_probe.md").read_text())
    assert set(table) == {"compile", "ondevice", "ortmodule", "torch"}  # the engines (data_parallel); not auto, nor the runner
    [chosen] = [name for name, row in table.items() if row[-1].startswith("chosen")]
    assert (run.data.tags["backend"], run.data.tags["engine"], run.data.tags["auto"]) == ("runner", chosen, "true")
    assert run.data.params["backend.engine"] == "auto"
    suffixes = {p.suffix for p in (tmp_path / "out" / "checkpoints").iterdir()}
    assert suffixes == ({".ckpt"} if chosen == "ondevice" else {".pt"})
    losses = [v for _, v in result.history["train/loss"]]
    assert losses[-1] < 0.8 * losses[0]
    assert "backend.engine=auto: 5 warm-up + 30 timed steps per candidate" in capfd.readouterr().out
