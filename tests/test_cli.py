"""The command line: `python -m orchestrate ...` end to end, and bad input refused with one
plain message, exit code 2, before anything is written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrate import app
from orchestrate.cli import main
from orchestrate.config import ConfigSource, load_config
from tests.conftest import here
from tests.helpers import exit_code


def run_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "orchestrate", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


BAD_INPUT = [
    (["trainer.stepz=5"], "trainer.stepz: unknown key; allowed keys in trainer: max_steps, batch_size"),
    (["trainer.max_steps=abc"], "trainer.max_steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["backend=tensorflow"], "backend=tensorflow: no such choice; allowed: auto, compile, ondevice, ortmodule, runner, torch"),
    (["backend.bogus=1"], "backend.bogus: unknown key; allowed keys in backend: _target_, name"),
    (["trainer.lr_schedule=wavy"], "trainer.lr_schedule: Invalid value 'wavy', expected one of [constant, linear, cosine]"),
    (["trainer.max_steps=0"], "trainer.max_steps=0: must be at least 1"),
    (["optimizer=fused_adam"], "optimizer=fused_adam (onnxruntime.training.optim.FusedAdam) needs CUDA"),
    (["trainer.precision=fp16"], "trainer.precision=fp16 needs CUDA, and this machine has none"),
    (["trainer.device=cuda"], "trainer.device=cuda needs CUDA, and this machine has none"),
    (["backend=ortmodule", "backend.fp16_optimizer=true"], "backend.fp16_optimizer=true (FP16_Optimizer) needs CUDA"),
    (["model=char_transformer", "data=python_files"],
     "gives logits of shape [2, 64, 96] for data's batch of 2, whose targets have shape [2]: data.loss=cross_entropy"),
    (["backend=ondevice", "backend.frozen_params=[encoder.*]"], "backend.frozen_params: 'encoder.*' matches no parameter"),
    (["backend=ondevice", "optimizer._target_=torch.optim.Adam"],
     "the on-device API offers torch.optim.AdamW and torch.optim.SGD"),
    (["backend=ondevice", "data=synthetic", "data.loss=huber"],
     "data.loss='huber' is not one of cross_entropy, mse, bce_with_logits, l1"),
    (["model=char_transformer", "data=python_source", "data.files=[no_such_module.py]"],
     "data.files: no_such_module.py not found"),
    (["model.hidden_size=3"], "model.hidden_size: unknown key; allowed keys in model: _target_, in_features"),
    (["model._target_=orchestrate.tasks.models.Nope"], "model._target_"),
    (["trainer.batch_size=5000"], "trainer.batch_size=5000 x 1 worker(s) is larger than the training set"),
    (["trainer.resume=0123abc"], "trainer.resume=0123abc: no MLflow store at sqlite:///mlflow.db, so no such run"),
    # Optimizer arguments torch refuses: the optimizer is built once up front, on the model's parameters.
    (["optimizer.lr=-1"], "optimizer.lr=-1 (torch.optim.AdamW): Invalid learning rate: -1; allowed: a number, 0 or more"),
    (["optimizer.lr=fast"], "optimizer.lr=fast (torch.optim.AdamW): '<=' not supported"),
    (["optimizer.betas=[2,0.9]"], "optimizer.betas=[2, 0.9] (torch.optim.AdamW): Invalid beta parameter at index 0: 2; "
                                  "allowed: two numbers in [0, 1)"),
    (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay=-0.1 (torch.optim.AdamW): Invalid weight_decay value"),
    (["optimizer=sgd", "optimizer.momentum=-1"], "optimizer.momentum=-1 (torch.optim.SGD): Invalid momentum value: -1"),
    (["optimizer=sgd", "+optimizer.nesterov=true"], "optimizer.nesterov=true (torch.optim.SGD): Nesterov momentum requires"),
    (["+optimizer.foo=1"], "optimizer.foo: unknown key for torch.optim.AdamW; allowed keys: lr, betas, eps, weight_decay"),
    (["backend=ondevice", "optimizer.eps=-1"], "optimizer.eps=-1 (torch.optim.AdamW): Invalid epsilon value: -1"),
    (["backend=ondevice", "+optimizer.amsgrad=true"], "optimizer.amsgrad=true: ORT's AdamW block ignores it with "
                                                      "backend=ondevice; allowed: false"),
    # A model that cannot run on the data: one forward on the data's sample batch, up front.
    (["model.in_features=10"], "model (orchestrate.tasks.models.MLP) cannot run on data's sample batch of shape [2, 64] "
                               "(float32): mat1 and mat2 shapes cannot be multiplied (2x64 and 10x256); check the "
                               "model's sizes (model.in_features=10, model.out_features=10) against the data's "
                               "(data.num_features=64, data.num_classes=10)"),
    (["model.out_features=5"], "model (orchestrate.tasks.models.MLP) gives 5 outputs per sample and data.num_classes=10"),
    (["data=synthetic", "data.target=regression", "data.loss=mse", "model.out_features=1"],
     "gives 1 outputs per sample and data.num_classes=4 (data.loss=mse)"),
    (["model=char_transformer", "data=digits"], "model.vocab_size=${data.vocab_size}: Interpolation key 'data.vocab_size' "
                                                "not found"),
    (["model=char_transformer", "data=digits", "model.vocab_size=96", "model.block_size=64"],
     "model (orchestrate.tasks.models.CharTransformer) cannot run on data's sample batch of shape [2, 64] (float32): "
     "Expected tensor for argument #1 'indices'"),
    (["model=char_transformer", "data=python_source", "model.block_size=32"],
     "cannot run on data's sample batch of shape [2, 64] (int64): The size of tensor a (64) must match"),
    # Backend options outside what the installed ORT supports.
    (["+backend.options.ORTMODULE_NOPE=1"], "backend.options.ORTMODULE_NOPE: not an option ORTModule "
                                            "(onnxruntime-training 1.19.2) reads; allowed: ORTMODULE_ONNX_OPSET_VERSION"),
    (["backend.options.ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=[1]"],
     "backend.options.ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=[1]: allowed: a string (or a whole number)"),
    (["backend.options.ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=yes"],
     "backend.options.ORTMODULE_ENABLE_COMPUTE_OPTIMIZER=yes: ORT reads it with int(); allowed: a whole number"),
    (["+backend.options.ORTMODULE_FALLBACK_POLICY=FALLBACK_NEVER"],
     "backend.options.ORTMODULE_FALLBACK_POLICY=FALLBACK_NEVER: allowed: FALLBACK_DISABLE, "),
    (["+backend.options.ORTMODULE_LOG_LEVEL=INFO"], "backend.options.ORTMODULE_LOG_LEVEL: set backend.log_level instead"),
    (["backend.log_level=LOUD"], "backend.log_level='LOUD': allowed: VERBOSE, DEVINFO, INFO, WARNING, ERROR, FATAL"),
    (["backend.intra_op_threads=-1"], "backend.intra_op_threads=-1: must be 0 or more"),
    (["backend=ondevice", "backend.intra_op_threads=-1"], "backend.intra_op_threads=-1: must be 0 or more"),
    (["backend=ondevice", "backend.opset=99"], "backend.opset=99: allowed: 12 to 20 (torch's exporter knows 7-20, "
                                               "onnx up to 21, ORT's CrossEntropyLoss block needs 12)"),
    (["backend=ondevice", "backend.opset=11"], "backend.opset=11: allowed: 12 to 20"),
    (["backend=ondevice", "model=char_transformer", "data=python_source", "backend.opset=17"],
     "backend.opset=17: allowed: 12 to 16 (torch's exporter knows 7-20, onnx up to 21, ORT's CrossEntropyLoss block "
     "needs 12; the model's LayerNorm exports as ONNX LayerNormalization from opset 17"),
    (["backend=ondevice", "backend.adamw_mode=pytorch"], "backend.adamw_mode='pytorch': allowed: torch, hf"),
    # A `_target_` override keeps the group file's other keys: the message says how to drop them.
    (["model._target_=torch.nn.Linear"], "model.hidden: unknown key for torch.nn.Linear; allowed keys: in_features, "
                                         "out_features, bias, device, dtype; drop it with ~model.hidden, or give "
                                         "torch.nn.Linear a config file of its own (model/linear.yaml in a folder "
                                         "passed with --config-dir, then model=linear)"),
    (["data._target_=orchestrate.tasks.data.PythonSource"],
     "data.num_features, data.num_classes, data.seed: unknown keys for orchestrate.tasks.data.PythonSource; allowed "
     "keys: files, block_size, vocab_size, max_chars, eval_fraction, loss; drop them with ~data.num_features "
     "~data.num_classes ~data.seed, or give orchestrate.tasks.data.PythonSource a config file of its own "
     "(data/python_source.yaml"),
    (["optimizer._target_=torch.optim.Adagrad"],
     "optimizer.betas: unknown key for torch.optim.Adagrad; allowed keys: lr, lr_decay, weight_decay, "
     "initial_accumulator_value, eps, foreach, maximize, differentiable, fused; drop it with ~optimizer.betas, or give "
     "torch.optim.Adagrad a config file of its own (optimizer/adagrad.yaml in a folder passed with --config-dir, then "
     "optimizer=adagrad)"),
    pytest.param(["backend._target_=orchestrate.backends.torch.TorchBackend"],  # ortmodule's keys (the default)
     "backend.allow_spinning, backend.log_level, backend.save_onnx, backend.fp16_optimizer, backend.options, "
     "backend.mapped_dimensions: unknown keys for orchestrate.backends.torch.TorchBackend; allowed keys: name, "
     "intra_op_threads, fused_optimizer; drop them with ~backend.allow_spinning ~backend.log_level ~backend.save_onnx "
     "~backend.fp16_optimizer ~backend.options ~backend.mapped_dimensions", marks=pytest.mark.ort),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUT, ids=[" ".join(getattr(c, "values", c)[0]) for c in BAD_INPUT])
def test_bad_input_is_one_plain_message_exit_2_nothing_written(overrides, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, *overrides) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err, err
    assert len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no mlflow.db, no outputs/


def test_bad_input_exit_code_from_a_real_process(tmp_path):
    done = run_cli("backend=nope", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: backend=nope: no such choice; "
                                   "allowed: auto, compile, ondevice, ortmodule, runner, torch")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def user_conf(tmp_path, monkeypatch):
    """A user's folder with a config group option of their own: conf/model/wide.yaml."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "wide.yaml").write_text(
        "_target_: orchestrate.tasks.models.MLP\nin_features: ${data.num_features}\nout_features: ${data.num_classes}\n"
        "hidden: [512]\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("where", [["--config-dir", "conf"], ["--config-dir=conf"], ["hydra.searchpath=[file://conf]"]])
def test_choices_in_the_users_folder_are_checked_with_the_shipped_ones(where, user_conf, monkeypatch, capsys):
    assert exit_code(monkeypatch, *where, "model=wider") == 2
    assert capsys.readouterr().err.strip() == ("error: model=wider: no such choice; "
                                               "allowed: char_transformer, cnn, hf_causal_lm, hf_classifier, mlp, wide")
    assert sorted(p.name for p in user_conf.iterdir()) == ["conf"]


@pytest.mark.parametrize("where", [["--config-dir", "conf"], ["hydra.searchpath=[file://conf]"]])
def test_a_choice_in_the_users_folder_passes_the_check(where, user_conf):
    source = ConfigSource.from_flags([w for w in where if not w.startswith("hydra.")])
    cfg = load_config(here([*[w for w in where if w.startswith("hydra.")], "model=wide"]), source)
    assert list(cfg.model.hidden) == [512]
    app.check(cfg)  # builds it, runs it once on the sample batch


def test_a_users_own_primary_config_builds_on_orchestrates(user_conf):
    (user_conf / "conf" / "train.yaml").write_text(
        "defaults:\n  - config\n  - override model: wide\n  - _self_\nhydra:\n  searchpath: [pkg://orchestrate.conf]\n"
        "trainer:\n  max_steps: 7\n")
    source = ConfigSource.from_flags(["--config-path", "conf", "--config-name", "train"])
    assert source.config_path == str(user_conf / "conf")  # relative to where the user is
    cfg = load_config(["backend=torch"], source)
    assert cfg.trainer.max_steps == 7 and list(cfg.model.hidden) == [512] and cfg.backend.name == "torch"


def test_a_missing_config_folder_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, "--config-dir", "my_conf") == 2
    assert capsys.readouterr().err.strip() == f"error: --config-dir my_conf: no such folder ({tmp_path}/my_conf)"


def test_a_diverging_run_is_one_line_exit_1_naming_the_step_and_the_checkpoint_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, "backend=torch", "data=synthetic", "trainer=quick",
                     "data._target_=tests.helpers.NanFrom", "+data.start=6", "trainer.max_steps=10",
                     "trainer.checkpoint_period=3", "trainer.progress=false", "hydra.run.dir=out") == 1
    stderr = capsys.readouterr().err
    err = [line for line in stderr.splitlines() if line.startswith("error")]  # MLflow's own INFO lines aside
    assert "Traceback" not in stderr
    assert len(err) == 1 and err[0].startswith("error: loss became nan at step 7; the MLflow run is marked FAILED. "
                                               "The last checkpoint before it, "), err
    assert str(Path("out") / "checkpoints" / "step_0000006.pt") in err[0]
    assert "trainer.on_nonfinite=skip" in err[0]



def test_a_loss_non_finite_before_any_update_names_the_inputs_not_the_learning_rate(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, "backend=torch", "data=synthetic", "trainer=quick",
                     "data._target_=tests.helpers.NanFrom", "+data.start=0", "trainer.max_steps=10",
                     "trainer.progress=false", "hydra.run.dir=out") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(err) == 1 and err[0].startswith(
        "error: loss became nan at step 1, before any update; the MLflow run is marked FAILED. The inputs or the "
        "model's first forward give non-finite values, not the learning rate"), err
    assert "optimizer.lr" not in err[0]

def test_a_run_takes_over_the_job_its_command_checked(tmp_path, monkeypatch, capsys):
    """The command builds the model once (for the check), and the run trains that model from the
    same RNG state as a run that built its own: the same final losses as app.train."""
    from orchestrate import app
    from orchestrate.config import load_config

    count = tmp_path / "builds.txt"
    same = ["backend=torch", "data=synthetic", "trainer=quick", "trainer.progress=false",
            "model._target_=tests.helpers.CountingMLP", f"+model.count_file={count}"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["orchestrate", *same, "hydra.run.dir=out"])
    main()
    assert count.read_text().count("built") == 1
    printed = capsys.readouterr().out
    reference = app.train(load_config([*same, f"tracking.uri=sqlite:///{tmp_path}/ref.db"]), tmp_path / "ref")
    assert f"final train loss   {reference.metrics['train_loss']:,.4f}" in printed


def test_a_header_below_a_comment_is_named_with_its_line(tmp_path, monkeypatch, capsys):
    """A user's experiment whose `# @package _global_` comes after another comment: Hydra reads it
    as an ordinary comment; the error names the file, the line and why."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text(
        "# conf/experiment/mine.yaml\n# @package _global_\ndefaults:\n  - override /model: cnn\n")
    monkeypatch.chdir(tmp_path)
    assert exit_code(monkeypatch, "--config-dir", "conf", "+experiment=mine") == 2
    err = capsys.readouterr().err
    assert "mine.yaml:2: `# @package _global_` must be the file's first line (Hydra reads the header only there)" in err
