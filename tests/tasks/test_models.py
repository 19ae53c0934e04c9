"""The shipped models: the shapes they take and give, and the sizes they refuse."""

import pytest
import torch

from orchestrate.tasks.models import ConvNet


def test_convnet_reads_flat_features_as_a_square_image():
    model = ConvNet(in_features=64, out_features=10, channels=[4, 8])
    assert model(torch.randn(5, 64)).shape == (5, 10)
    assert ConvNet(in_features=16, out_features=3, channels=[4])(torch.randn(2, 16)).shape == (2, 3)
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())


def test_convnet_refuses_features_that_are_not_a_square_number():
    with pytest.raises(ValueError, match=r"model.in_features=60 is not a square number"):
        ConvNet(in_features=60, out_features=10)
