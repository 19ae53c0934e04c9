"""The one loss registry: each loss works in PyTorch, has an ORT loss block, and counts accuracy
where accuracy means something."""

import pytest
import torch

from orchestrate import losses


def test_cross_entropy_flattens_language_model_logits():
    logits = torch.randn(2, 5, 7)
    targets = torch.randint(0, 7, (2, 5))
    flat = torch.nn.functional.cross_entropy(logits.reshape(10, 7), targets.reshape(10))
    assert losses.get("cross_entropy").torch(logits, targets) == pytest.approx(flat.item())


def test_accuracy_counts_correct_predictions_and_none_for_regression():
    out = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]])
    assert losses.get("cross_entropy").accuracy(out, torch.tensor([0, 1, 1])) == pytest.approx(2 / 3)
    assert losses.get("bce_with_logits").accuracy(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0])) == 0.5
    assert losses.get("mse").accuracy is None and losses.get("l1").accuracy is None


@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_every_loss_has_an_ort_block(name):
    from onnxruntime.training import onnxblock

    block = losses.get(name).ort_block()
    assert isinstance(block, onnxblock.Block) or block.__class__.__name__ == "LossType"


def test_an_unknown_loss_names_the_allowed_ones():
    with pytest.raises(ValueError, match="data.loss='huber' is not one of cross_entropy, mse, bce_with_logits, l1"):
        losses.get("huber")
