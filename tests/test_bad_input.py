"""Bad input beyond tests/test_cli.py's single-run catalogue: sweeps, experiments, launcher
options, Ray and MLflow addresses, malformed override syntax. Each is refused up front by
`python -m orchestrate` with one plain line, exit code 2, nothing written, within 15 s."""

import os
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrate.cli import main, validate
from orchestrate.config import ORCHESTRATE
from tests.conftest import here

CASES = [
    # sweeps
    (["-m", "trainer.max_steps=1,abc"], "trainer.max_steps: Value 'abc' of type 'str' could not be converted"),
    pytest.param(["-m", "optimizer.lr=0.1,-1"],  # the default backend (ortmodule) as typed: the trial's words
                 "trial 1 (optimizer.lr=-1): optimizer.lr=-1 (torch.optim.AdamW): Invalid learning rate",
                 marks=pytest.mark.ort),
    (["+sweep=nope"], "sweep=nope: no such choice; allowed: backends, compare, lr_grid, lr_optuna, none, tradeoff"),
    (["+dry_run", "+sweep=nope"], "sweep=nope: no such choice; allowed: backends, compare, lr_grid, lr_optuna, none, tradeoff"),
    # Several objectives and comparisons (orchestrate.sweeps.pareto, orchestrate.sweeps.compare).
    (["+sweep=tradeoff", "sweep.direction=[minimize]"],
     "gives 1 direction(s) for sweep.metric=[eval_loss,wall_time_s], 2 metric(s): give one direction per metric"),
    (["+sweep=lr_optuna", "hydra.sweeper.direction=[minimize,maximize]"],
     "hydra.sweeper.direction=[minimize,maximize] gives 2 direction(s) for sweep.metric=eval_loss, 1 metric(s)"),
    # sweep.direction is the source (the Optuna sweeper's follows it): named first, whatever else is set.
    (["+sweep=lr_optuna", "sweep.metric=[eval_loss,wall_time_s]", "hydra.sweeper.direction=[minimize,minimize]"],
     "sweep.direction=minimize gives 1 direction(s) for sweep.metric=[eval_loss,wall_time_s], 2 metric(s): give one "
     "direction per metric, e.g. sweep.direction=[minimize,minimize]"),
    (["+sweep=lr_grid", "sweep.metric=speed"], "sweep.metric=speed: no run logs it; allowed: eval_loss, eval_accuracy"),
    (["+sweep=compare", "compare.repeats=1"], "compare.repeats=1: a comparison's verdict needs an interval"),
    (["+sweep=tradeoff", "hydra/sweeper/pruner=median"],
     "hydra/sweeper/pruner: MedianPruner ranks one objective, and this sweep has 2; allowed: hydra/sweeper/pruner=dominated"),
    (["+sweep=lr_optuna", "hydra/sweeper/pruner=dominated"],
     "hydra/sweeper/pruner=dominated prunes a sweep over several objectives, and this one has one"),
    (["compare.confidence=1.5"], "compare.confidence=1.5: allowed: between 0 and 1"),
    (["-m", "optimizer.lr=range(0)"], "optimizer.lr=range(0): the sweep has no trials"),
    (["-m", "optimizer.lr=interval(0.1,0.2)"], "optimizer.lr=interval(...): Hydra's basic sweeper runs a grid"),
    (["+sweep=lr_optuna", "hydra.sweeper.n_trials=-1"], "hydra.sweeper.n_trials=-1: must be at least 1"),
    # a study whose storage is gone, or is not a study's
    (["+sweep=lr_optuna", "hydra.sweeper.storage=sqlite:////no/such/folder/study.db"],
     "hydra.sweeper.storage=sqlite:////no/such/folder/study.db: the study's folder /no/such/folder does not exist"),
    (["+sweep=lr_optuna", "hydra.sweeper.storage=sqlite:////etc/hostname"],
     "hydra.sweeper.storage=sqlite:////etc/hostname: the study's file /etc/hostname cannot be read as a SQLite "
     "database (file is not a database)"),
    (["sweep=lr_grid"], "sweep=lr_grid: a sweep runs with -m or +sweep=lr_grid"),
    (["-m", "hydra.launcher.address=127.0.0.1:9", "optimizer.lr=0.1,0.2"],
     "hydra.launcher.address=127.0.0.1:9: nothing answers at 127.0.0.1:9"),
    (["-m", "hydra/launcher=nope", "optimizer.lr=0.1,0.2"],
     "hydra/launcher=nope: no such choice; allowed: basic, orchestrate_ray, submitit_local, submitit_slurm"),
    # experiments
    (["+experiment=nope"], "experiment=nope: no such choice; allowed: backend_shootout, char_lm, lr_search"),
    (["+experiment"], "+experiment: an override needs a value (KEY=VALUE, +KEY=VALUE to add, ~KEY to delete); "
                      "allowed: +experiment=backend_shootout, +experiment=char_lm, +experiment=lr_search"),
    # launcher options, sweeps that can never be placed
    (["-m", "hydra.launcher.cpus_per_trial=999", "optimizer.lr=0.1,0.2"],
     "hydra.launcher.cpus_per_trial=999: a trial asks for more CPUs than the local Ray instance has"),
    (["-m", "hydra.launcher.gpus_per_trial=1", "optimizer.lr=0.1,0.2"],
     "hydra.launcher.gpus_per_trial=1: this machine has 0 GPU(s)"),
    (["-m", "hydra.launcher.nope=1", "optimizer.lr=0.1,0.2"], "hydra.launcher.nope: unknown key"),
    (["-m", "hydra.launcher.placement_timeout_s=abc", "optimizer.lr=0.1,0.2"],
     "hydra.launcher.placement_timeout_s: Value 'abc' of type 'str' could not be converted to Float"),
    # runner backend
    (["backend=runner", "trainer.num_workers=0"], "trainer.num_workers=0: must be at least 1"),
    (["backend=runner", "trainer.num_workers=-1"], "trainer.num_workers=-1: must be at least 1"),
    (["backend=runner", "backend.cpus_per_worker=999"], "asks for 999 CPUs; this machine has"),
    (["backend=runner", "backend.ray_address=127.0.0.1:9"], "backend.ray_address=127.0.0.1:9: nothing answers at"),
    # MLflow
    (["trainer.max_steps=1", "tracking.uri=http://127.0.0.1:9"], "tracking.uri=http://127.0.0.1:9: no MLflow server answers"),
    (["tracking=nope"], "tracking=nope: no such choice; allowed: mlflow, server"),
    (["tracking.uri=ftp://x"], "tracking.uri=ftp://x: MLflow has no tracking store for ftp://; allowed: a folder,"),
    (["trainer.resume=zzz"], "trainer.resume=zzz: no MLflow store at sqlite:///mlflow.db, so no such run"),
    (["tracking.experiment="], "tracking.experiment='': MLflow needs an experiment name"),
    # names MLflow would refuse only when handed them: the registered model's at the run's end
    (["tracking.register_model=bad/name:x"], "tracking.register_model=bad/name:x: Invalid model name 'bad/name:x'. "
                                            "Names cannot contain '/' or ':'; allowed: a non-empty name without"),
    # keys, types, ranges
    (["trainer.max_steps="], "trainer.max_steps: Value '' of type 'str' could not be converted to Integer"),
    (["trainer.max_steps=1e400"], "trainer.max_steps: Value 'inf' of type 'float' could not be converted to Integer"),
    (["trainer.batch_size=0"], "trainer.batch_size=0: must be at least 1"),
    (["trainer.batch_size=-3"], "trainer.batch_size=-3: must be at least 1"),
    (["trainer=nope"], "trainer=nope: no such choice; allowed: default, quick"),
    # ranges declared beside the types (schema.Range), checked in one place; no setting is nan or inf
    (["model.hidden=[0,0]"], "model.hidden=[0, 0]: must be at least 1"),
    (["optimizer.lr=inf"], "optimizer.lr=inf: must be a finite number"),
    (["data=synthetic", "data.num_samples=nan"], "data.num_samples=nan: must be a finite number, at least 1"),
    (["data.eval_fraction=1.5"], "data.eval_fraction=1.5: must be in (0, 1)"),
    (["trainer.seed=-5"], "trainer.seed=-5: must be from 0 to 4294967295"),
    (["model=cnn", "model.dropout=2"], "model.dropout=2: must be from 0 to 1"),
    (["backend=runner", "backend.cpus_per_worker=0"], "backend.cpus_per_worker=0: must be above 0"),
    # a model the backend cannot take, refused by the backend's own preparation in the up-front check
    pytest.param(["model._target_=tests.helpers.FftMLP"], "model (tests.helpers.FftMLP) cannot be exported by "
                 "ORTModule at opset 17: UnsupportedOperatorError: Exporting the operator 'aten::fft_fft'",
                 marks=pytest.mark.ort),
    # ... or whose export ORT's shape inference fails on (ORTModule would fail on its first step, inside the run)
    pytest.param(["model=char_transformer", "data=python_source", "model._target_=tests.helpers.TiedEncoderLM",
                  "model.n_embd=32"],
                 "model (tests.helpers.TiedEncoderLM) cannot be trained by ORTModule: ORT's symbolic shape inference, "
                 "which ORTModule runs on its export, fails at a Reshape node (AssertionError); backend=ondevice (ORT's "
                 "on-device API), backend=torch or backend=compile train it instead", marks=pytest.mark.ort),
    (["backend=ondevice", "model._target_=tests.helpers.FftMLP"],
     "model (tests.helpers.FftMLP) cannot be exported at backend.opset=15: UnsupportedOperatorError"),
    (["model._target_=torch.nn.Linear", "~model.hidden", "model.out_features=0"],
     "model (torch.nn.Linear): parameter weight has no elements (shape [0, 64]); check the model's sizes"),
    (["foo=1"], "foo: unknown key"),
    (["+foo=1"], "foo: unknown key; allowed keys at the top level: backend, model, data, optimizer, trainer"),
    (["+trainer.max_step=5"], "trainer.max_step: unknown key; allowed keys in trainer: max_steps,"),
    (["+tracking.x=1"], "tracking.x: unknown key; allowed keys in tracking: uri, experiment,"),
    (["trainer.max_steps=${nope}"], "trainer.max_steps: Interpolation key 'nope' not found"),
    (["trainer.max_steps=${oc.env:NOPE_X}"], "Environment variable 'NOPE_X' not found"),
    # unknown _target_s
    (["model._target_=nonexistent_pkg.X"], "model._target_=nonexistent_pkg.X: cannot import it"),
    (["model._target_=os.system"], "model.in_features, model.out_features, model.hidden: unknown keys for os.system"),
    # malformed override syntax
    (["trainer.max_steps=[1"], "no viable alternative at input '[1'"),
    (["trainer.max_steps=1)"], "Error parsing override 'trainer.max_steps=1)'"),
    (["=5"], "=5: a config group's choice must be a name or a list of names (Config group override must be"),
    (["backend=[32,16]"], "backend=[32,16]: a config group's choice must be a name or a list of names"),
    (["--config-dir", "/nonexistent"], "--config-dir /nonexistent: no such folder"),
    (["--nope"], "--nope: unknown option; allowed: --help/-h,"),
    (["--cfg", "nope"], "argument --cfg/-c: invalid choice: 'nope'"),
    (["backend"], "backend: an override needs a value"),
    # data and loss that do not fit, found on the sample batch before the run opens
    (["data.loss=mse"], "data.loss=mse cannot score model (orchestrate.tasks.models.MLP)'s output of shape [2, 10] "
                        "against data's targets of shape [2] (int64): Using a target size (torch.Size([2])) that is "
                        "different to the input size (torch.Size([2, 10]))"),
    (["data._target_=tests.helpers.NanColumnDigits"],
     "data (NanColumnDigits): 1438 of 92032 training input values are nan or inf (the first in sample 0); the first "
     "loss would be non-finite whatever the learning rate"),
    (["data=synthetic", "data._target_=tests.helpers.LongerThanItsArrays"],
     "data (LongerThanItsArrays): num_train=3557, but x_train holds 1536 samples; num_train must not exceed the "
     "length of x_train and y_train (x_train: 1536, y_train: 1536)"),
]


@pytest.mark.parametrize("argv,message", CASES, ids=[" ".join(getattr(c, "values", c)[0]) for c in CASES])
def test_bad_input_is_refused_with_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["orchestrate", *here(argv)])
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        main()
    assert time.monotonic() - start < 15
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, mlruns, outputs/ or multirun/


# ---- random overrides (hypothesis): the up-front check either accepts a command line or refuses
# it with one line and exit code 2; never a traceback, never a hang. The check is the entry point's
# gate (orchestrate.cli.validate: compose, then build the job) and runs nothing, so an accepted
# random config is not trained. More examples: HYPOTHESIS_EXAMPLES=2000 pytest tests/test_bad_input.py -k random
KEYS = ["trainer.max_steps", "trainer.batch_size", "trainer.seed", "trainer.resume", "trainer.device",
        "trainer.precision", "trainer.lr_schedule", "trainer.warmup_steps", "optimizer.lr", "optimizer.weight_decay",
        "model.hidden", "model._target_", "data.loss", "data._target_", "tracking.uri", "tracking.experiment",
        "backend.intra_op_threads", "backend", "model", "data", "optimizer", "trainer", "experiment", "sweep", "nope"]
VALUES = ["1", "0", "-1", "3e-3", "abc", "", "[1", "[32,16]", "null", "true", "${nope}", "cuda", "fp16",
          "torch", "ondevice", "ortmodule", "runner", "os.system", "x.y.Z", "1e400", "'quoted'", "a=b", "(", "auto",
          "http://127.0.0.1:9", "sqlite:///no/such/dir/x.db"]
override = st.builds(lambda prefix, key, sep, value: f"{prefix}{key}{sep}{value}",
                     st.sampled_from(["", "", "+", "~", "++"]), st.sampled_from(KEYS),
                     st.sampled_from(["=", "=", ":", "==", ""]),
                     st.one_of(st.sampled_from(VALUES), st.text(alphabet="abc019.-_=,[]{}()$:'\" ", max_size=8)))


@settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "100")), deadline=15_000,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(overrides=st.lists(override, min_size=1, max_size=3))
def test_random_overrides_are_accepted_or_refused_with_one_line(overrides, capsys):
    capsys.readouterr()
    try:
        validate(overrides, ORCHESTRATE)
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err


# ---- random YAML files (hypothesis): a config group option of the user's own (`--config-dir`) made
# of random keys and values, sometimes cut or with characters dropped in, is accepted or refused
# with one plain line: never a traceback, and never a crash file (a user's YAML is input, not a bug).
GROUP_KEYS = {"model": ["_target_", "in_features", "out_features", "hidden", "nope"],
              "data": ["_target_", "num_samples", "num_features", "num_classes", "loss", "seed", "nope"],
              "optimizer": ["_target_", "_partial_", "lr", "weight_decay", "betas", "nope"],
              "trainer": ["max_steps", "batch_size", "seed", "precision", "lr_schedule", "device", "nope"],
              "backend": ["_target_", "name", "intra_op_threads", "opset", "nope"]}
YAML_SCALARS = st.one_of(st.integers(-3, 70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
                         st.sampled_from(["orchestrate.tasks.models.MLP", "orchestrate.tasks.data.Synthetic",
                                          "torch.optim.SGD", "orchestrate.backends.torch.TorchBackend", "torch",
                                          "cross_entropy", "fp16", "cuda", "cosine", "${data.num_features}",
                                          "${nope}", "???", "x.y.Z", ""]),
                         st.text(alphabet="ab1.:-_{}[]$ '\"#", max_size=6))
YAML_VALUES = st.recursive(YAML_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["a", "b", "_target_"]), inner, max_size=2), max_leaves=4)


@st.composite
def yaml_files(draw):
    """(group, text): a random option of a config group, as YAML text, sometimes broken."""
    import yaml

    group = draw(st.sampled_from(sorted(GROUP_KEYS)))
    node = draw(st.dictionaries(st.sampled_from(GROUP_KEYS[group]), YAML_VALUES, max_size=5))
    text = yaml.safe_dump(node, default_flow_style=draw(st.booleans())) if node else ""
    if draw(st.booleans()):  # break it: cut it short, or drop characters in
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from(["", "[", "{", ": :", "\t", "- ", "'", "*a", "&", "%", "\n  x"]))
    if draw(st.booleans()):
        text = "# @package _global_\n" + text  # an experiment-style file
    return group, text


@settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", "100")), deadline=15_000,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(file=yaml_files())
def test_random_yaml_files_in_a_config_dir_are_accepted_or_refused_with_one_line(file, tmp_path, capsys):
    from orchestrate.config import ConfigSource

    group, text = file
    folder = tmp_path / "conf" / group
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fuzz.yaml").write_text(text)
    capsys.readouterr()
    try:
        validate([f"{group}=fuzz", "trainer.max_steps=1"], ConfigSource(config_dir=str(tmp_path / "conf")))
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert "full traceback in" not in err, f"{text!r} crashed the check: {err}"


def test_a_tag_key_mlflow_would_refuse_is_refused_before_the_run():
    """Tags from a user's YAML (an override's key cannot spell these): checked by MLflow's rules."""
    from omegaconf import OmegaConf

    from orchestrate.schema import ConfigError, check_tracking_names

    with pytest.raises(ConfigError, match=r"^tracking.tags: the key 'a\*b': Invalid value \"a\*b\" for parameter 'key'"):
        check_tracking_names(OmegaConf.create({"register_model": None, "tags": {"a*b": "1"}}))
    check_tracking_names(OmegaConf.create({"register_model": "digits-mlp", "tags": {"team": "vision"}}))


def test_a_deleted_experiment_is_named_with_the_way_back(tmp_path, monkeypatch, capsys):
    """MLflow refuses runs in an experiment in its deleted state (and keeps the name): said before
    anything runs, with how to restore it."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    deleted = client.create_experiment("orchestrate")
    client.delete_experiment(deleted)
    capsys.readouterr()  # MLflow's own lines as it made the store
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["orchestrate", *here(["trainer.max_steps=1"])])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: tracking.experiment=orchestrate: the experiment (id {deleted}) is deleted in "
                   f"sqlite:///mlflow.db; restore it (`mlflow experiments restore --experiment-id {deleted}` with "
                   "MLFLOW_TRACKING_URI=sqlite:///mlflow.db) or choose another name"), err
    assert [p.name for p in tmp_path.iterdir()] == ["mlflow.db"]  # no outputs/, no crash file named
