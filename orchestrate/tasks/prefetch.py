"""The PyTorch loops' batches, on their device before they are needed.

On a GPU a batch copied from ordinary (pageable) memory is a copy the host waits for, and one made
when the step asks for it is a copy the GPU waits for. Here each batch is cut from the data set one
step ahead, put in pinned memory and copied on a stream of its own while the current step runs;
the step's stream waits for that copy on the device, not on the host. The batches and their order
are the data set's own (`Job.train_batch(step, micro)`), so a resumed run reads the same ones.
On the CPU the batch is where the model is: served as the data set cuts it.
"""

import torch


class DeviceBatches:
    """`get(step, micro)`: micro-batch `micro` of `step` on the job's device, the next one already
    on its way there."""

    def __init__(self, job):
        self.job, self.device = job, job.device
        self.micro_steps = job.micro_batches
        self.last_step = job.trainer.max_steps
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.ahead: tuple[tuple[int, int], tuple[torch.Tensor, ...]] | None = None  # (step, micro), batch: copying

    def get(self, step: int, micro: int = 0) -> tuple[torch.Tensor, ...]:
        if self.stream is None:
            return self.job.train_batch(step, micro)
        ahead, self.ahead = self.ahead, None
        batch = ahead[1] if ahead is not None and ahead[0] == (step, micro) else self._send(step, micro)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)  # the step's kernels start after the copy, on the device
        for tensor in batch:
            tensor.record_stream(current)  # its memory is not reused before the step is done with it
        following = (step, micro + 1) if micro + 1 < self.micro_steps else (step + 1, 0)
        if following[0] <= self.last_step:
            self.ahead = following, self._send(*following)
        return batch

    def _send(self, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        """Start copying the batch to the device (pinned memory, on the copy stream): no wait."""
        with torch.cuda.stream(self.stream):
            return tuple((t.pin_memory() if t.device.type == "cpu" else t).to(self.device, non_blocking=True)
                         for t in self.job.train_batch(step, micro))
