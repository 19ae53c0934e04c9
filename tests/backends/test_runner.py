"""The runner's correctness, as seed 003 states it: N workers with batch B equal one worker with
batch N*B, and K accumulated micro-batches equal one batch K times larger, update for update.
Tolerances: 1e-5 absolute on the final weights (plain PyTorch engine); the sums are only reordered."""

import pytest
import torch

from orchestrate import app, schema
from orchestrate.__main__ import main
from orchestrate.backends.runner import RunnerBackend

pytestmark = pytest.mark.slow
COMMON = ["backend=runner", "backend.engine=torch", "data=synthetic", "trainer=quick", "trainer.max_steps=12",
          "trainer.evaluation_period=0", "trainer.checkpoint_period=0", "optimizer=sgd", "optimizer.lr=0.1",
          "model.hidden=[32]"]


def final_weights(tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    cfg = app.load_config([*COMMON, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides])
    result = app.train(cfg, tmp_path / name)
    (path,) = (result.out_dir / "checkpoints").glob("step_*.pt")
    return {k: torch.from_numpy(v) for k, v in RunnerBackend().read_checkpoint(path).items()}


def assert_same(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


def test_two_workers_with_batch_b_equal_one_worker_with_batch_2b(tmp_path):
    two = final_weights(tmp_path, "two", "trainer.num_workers=2", "trainer.batch_size=32")
    one = final_weights(tmp_path, "one", "trainer.num_workers=1", "trainer.batch_size=64")
    assert_same(two, one, atol=1e-5)


def test_accumulating_k_micro_batches_equals_one_batch_k_times_larger(tmp_path):
    acc = final_weights(tmp_path, "acc", "trainer.gradient_accumulation_steps=4", "trainer.batch_size=16")
    big = final_weights(tmp_path, "big", "trainer.batch_size=64")
    assert_same(acc, big, atol=1e-5)


def test_the_weights_moved(tmp_path):
    """Guards the two tests above against comparing two untrained models."""
    trained = final_weights(tmp_path, "one", "trainer.batch_size=64")
    cfg = app.load_config([*COMMON])
    torch.manual_seed(cfg.trainer.seed)
    initial = schema.build(cfg.model, "model").state_dict()
    assert not torch.allclose(trained["net.0.weight"], initial["net.0.weight"])


@pytest.mark.parametrize("overrides,message", [
    (["backend=runner", "trainer.num_workers=64"], "asks for 64 CPUs; this machine has"),
    (["backend=runner", "trainer.num_workers=0"], "trainer.num_workers=0: must be at least 1"),
    (["backend=runner", "trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps=0: must be at least 1"),
    (["backend=torch", "trainer.num_workers=2"], "need backend=runner"),
    (["backend=runner", "backend.engine=jax"], "backend.engine='jax': allowed: ortmodule, torch"),
])
def test_bad_runner_input(overrides, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["orchestrate", *overrides])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_ortmodule_engine_two_workers_equal_one(tmp_path):
    """DDP(ORTModule(model)): the same equivalence, within 1e-4 (ORT's kernels sum differently)."""
    two = final_weights(tmp_path, "two", "backend.engine=ortmodule", "trainer.num_workers=2", "trainer.batch_size=32")
    one = final_weights(tmp_path, "one", "backend.engine=torch", "trainer.num_workers=1", "trainer.batch_size=64")
    assert_same(two, one, atol=1e-4)
