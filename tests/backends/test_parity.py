"""Same seed, same start: torch, compile, ortmodule and ondevice begin from the same weights and
their first steps agree. Tolerances: the first loss to 1e-6 (same weights, same batch), the first ten
steps to 1e-4 relative (ORT's kernels sum in a different order than PyTorch's)."""

import pytest

from orchestrate import app
from orchestrate.config import load_config

pytestmark = pytest.mark.slow  # ORTModule
PARITY = ["torch", "compile", "ortmodule", "ondevice"]


def first_losses(backend: str, tmp_path, *overrides: str) -> list[float]:
    """The train loss of each of the first ten steps."""
    cfg = load_config([f"backend={backend}", "data=synthetic", "trainer=quick", "trainer.max_steps=10",
                           "trainer.display_loss_steps=1", "trainer.evaluation_period=0", "trainer.checkpoint_period=0",
                           "optimizer.lr=0.01", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides])
    result = app.train(cfg, tmp_path / backend)
    return [v for _, v in result.history["train/loss"]]


@pytest.mark.parametrize("optimizer,schedule", [("adamw", "constant"), ("sgd", "linear")])
def test_backends_start_from_the_same_loss_and_agree(tmp_path, optimizer, schedule):
    # With a linear schedule and warm-up, the losses only agree if ORT's LinearLRScheduler
    # (ondevice) applies the same rates as torch's LambdaLR.
    extra = [f"optimizer={optimizer}", f"trainer.lr_schedule={schedule}", "trainer.warmup_steps=3"]
    runs = {b: first_losses(b, tmp_path, *extra) for b in PARITY}
    reference = runs["torch"]
    assert len(reference) == 10
    for backend in PARITY[1:]:
        losses = runs[backend]
        assert losses[0] == pytest.approx(reference[0], rel=1e-6), backend
        assert losses == pytest.approx(reference, rel=1e-4), backend
