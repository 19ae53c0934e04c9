"""The one loss registry: each loss works in PyTorch, has an ORT loss block, and counts accuracy
where accuracy means something."""

import pytest
import torch

from orchestrate.tasks import losses


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


@pytest.mark.ort
@pytest.mark.parametrize("name", sorted(losses.LOSSES))
def test_every_loss_has_an_ort_block(name):
    from onnxruntime.training import onnxblock

    block = losses.get(name).ort_block()
    assert isinstance(block, onnxblock.Block) or block.__class__.__name__ == "LossType"


def test_an_unknown_loss_names_the_allowed_ones():
    with pytest.raises(ValueError, match="data.loss='huber' is not one of cross_entropy, mse, bce_with_logits, l1"):
        losses.get("huber")


@pytest.mark.ort
def test_ort_cross_entropy_block_flattens_language_model_logits_inside_the_loss(tmp_path):
    """The on-device training graph's loss on (B, T, C) logits and (B, T) labels is PyTorch's, and
    the model's own output keeps its shape (B, T, C)."""
    import io

    import onnx
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module

    torch.manual_seed(0)
    model = torch.nn.Linear(7, 5)  # (B, T, 7) -> (B, T, 5) logits
    x, y = torch.randn(3, 4, 7), torch.randint(0, 5, (3, 4))
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=15,
                      do_constant_folding=False)
    artifacts.generate_artifacts(onnx.load_from_string(buffer.getvalue()), requires_grad=["weight", "bias"],
                                 loss=losses.get("cross_entropy").ort_block(), artifact_directory=tmp_path,
                                 additional_output_names=["logits"])
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    module.eval()
    loss, logits = module(x.numpy(), y.numpy())
    assert logits.shape == (3, 4, 5)
    with torch.no_grad():
        assert float(loss) == pytest.approx(losses.get("cross_entropy").torch(model(x), y).item(), rel=1e-5)
