"""Models for tests that need a trial to fail on purpose (importable as `tests.helpers` by Ray
workers when PYTHONPATH holds the repository)."""

from pathlib import Path

import torch

from orchestrate.tasks.models import MLP


class FailingMLP(MLP):
    """An MLP whose forward raises at call `fail_at_call`, but only while `marker` exists
    (so the same command fails once, then succeeds after the marker is removed)."""

    def __init__(self, in_features: int, out_features: int, hidden=(32,), fail_at_call: int = 10**9,
                 marker: str = ""):
        super().__init__(in_features, out_features, hidden)
        self.fail_at_call, self.marker, self.calls = fail_at_call, marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.fail_at_call and (not self.marker or Path(self.marker).exists()):
            raise RuntimeError(f"deliberate failure at call {self.calls}")
        return super().forward(x)
