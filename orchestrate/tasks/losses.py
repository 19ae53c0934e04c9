"""The one registry of losses. A data set names its loss (`data.loss`); each entry says how every
backend computes it: the PyTorch function (torch, ortmodule, the runner's torch engines), the loss
block ORT's `generate_artifacts` appends to the training graph (ondevice), and how accuracy is
counted at evaluation (None for regression)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.nn import functional as F


@dataclass(frozen=True)
class Loss:
    name: str
    torch: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (model output, targets) -> scalar
    ort_block: Callable[[], Any]  # -> an `artifacts.LossType` member or an onnxblock Block
    accuracy: Callable[[torch.Tensor, torch.Tensor], float] | None  # (output, targets) -> share correct


def _cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Models return logits (..., C): flattened to (N, C), per-token (language model) and
    # per-sample (classifier) targets go through the same loss.
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _ort_loss(name: str) -> Callable[[], Any]:
    def block():
        from onnxruntime.training import artifacts

        return getattr(artifacts.LossType, name)

    return block


def cross_entropy_block():
    """ORT's CrossEntropyLoss block (ONNX SoftmaxCrossEntropyLoss) takes the classes from dimension
    1, (N, C) or (N, C, d1, ...): a language model's (B, T, C) logits would be read as T classes
    at C positions, which its (B, T) labels do not fit. So logits of rank 3 and up are flattened to
    (B*T, C), and the labels to (B*T,), inside the loss: the model keeps its own output, and the
    exported model.onnx is the same as the other backends'."""
    import onnx
    from onnxruntime.training.onnxblock import Block, loss

    class FlatCrossEntropy(Block):
        def build(self, logits: str, labels: str = "labels") -> str:
            (output,) = [o for o in self.base.graph.output if o.name == logits]
            dims = [d.dim_param or d.dim_value for d in output.type.tensor_type.shape.dim]
            if len(dims) <= 2:  # (N, C) already: ORT's block as it is
                return loss.CrossEntropyLoss()(logits, labels)
            graph = self.base.graph
            # The labels input: the logits' shape without the class dimension, int64.
            graph.input.append(onnx.helper.make_tensor_value_info(labels, onnx.TensorProto.INT64, dims[:-1]))
            graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], dtype=np.int64), "flat_shape"))
            graph.node.extend([
                onnx.helper.make_node("Flatten", [logits], ["logits_flat"], axis=len(dims) - 1),
                onnx.helper.make_node("Reshape", [labels, "flat_shape"], ["labels_flat"]),
            ])
            return loss.CrossEntropyLoss()("logits_flat", "labels_flat")

    return FlatCrossEntropy()


def stable_bce_with_logits():
    """BCE with logits as max(x, 0) - x*y + log(1 + exp(-|x|)), written with onnxblock's blocks
    as (x + |x|)/2 - x*y - log(sigmoid(|x|)). ORT's own BCEWithLogitsLoss block computes
    log(sigmoid(x)) and log(1 - sigmoid(x)), which turn into NaN once a logit passes about 17."""
    from onnxruntime.training.onnxblock import Block, blocks

    class StableBCEWithLogits(Block):
        def build(self, x: str, target: str = "target") -> str:
            y = blocks.InputLike(x)(target)  # a new graph input shaped like the logits
            abs_x = blocks.Abs()(x)
            relu_x = blocks.Mul()(blocks.Add()(x, abs_x), blocks.Constant(0.5)())
            softplus = blocks.Neg()(blocks.Log()(blocks.Sigmoid()(abs_x)))
            return blocks.ReduceMean(keepdims=False)(blocks.Add()(blocks.Sub()(relu_x, blocks.Mul()(x, y)), softplus))

    return StableBCEWithLogits()


LOSSES = {loss.name: loss for loss in [
    Loss("cross_entropy", _cross_entropy, cross_entropy_block,
         lambda out, y: (out.argmax(dim=-1) == y).float().mean().item()),
    Loss("mse", F.mse_loss, _ort_loss("MSELoss"), None),
    Loss("bce_with_logits", F.binary_cross_entropy_with_logits, stable_bce_with_logits,
         lambda out, y: ((out > 0).float() == y).float().mean().item()),
    Loss("l1", F.l1_loss, _ort_loss("L1Loss"), None),
]}


def get(name: str) -> Loss:
    """The registry entry for `data.loss`; a ValueError naming the allowed ones otherwise."""
    if name not in LOSSES:
        raise ValueError(f"data.loss={name!r} is not one of {', '.join(LOSSES)}")
    return LOSSES[name]
