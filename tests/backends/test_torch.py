"""The PyTorch loop (backend=torch, and ORTModule's, which is the same loop): no step waits for the
device but at the steps where the loop reads its numbers back (display, evaluation, checkpoint).
On a GPU a read (`loss.item()`, `float(t)`, `if t:`) is a host sync that drains the GPU's queue;
here on the CPU the same calls are counted, so a loop that would wait on a GPU fails here."""

import pytest
import torch

from tests.helpers import fit_untracked

# Every Python-level way a tensor's value reaches the host.
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__index__", "__bool__")


@pytest.fixture
def reads_by_step(monkeypatch):
    """{step: [what was read]}, filled while the test trains: the step is the one the job's meter
    is on (0 before the first)."""
    from orchestrate.job import Job

    seen: dict[int, list[str]] = {}
    meter = {"current": None}
    prepare = Job.prepare

    def watched(*args, **kwargs):
        job = prepare(*args, **kwargs)
        meter["current"] = job.meter
        return job

    monkeypatch.setattr(Job, "prepare", watched)

    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if meter["current"] is not None:
                seen.setdefault(meter["current"].step, []).append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return seen


@pytest.mark.parametrize("backend", ["torch", "ortmodule"])
def test_no_step_reads_a_tensor_between_reading_steps(backend, tmp_path, reads_by_step):
    """16 steps, displayed every 4, a checkpoint at 12 and evaluation at the end: after the first
    window (ORTModule builds its graphs in step 1), steps 5-7, 9-11 and 13-15 read nothing; the
    reading steps do read (the counting works)."""
    seen = reads_by_step
    job = fit_untracked([f"backend={backend}", "data=synthetic", "trainer=quick", "trainer.max_steps=16",
                         "trainer.display_loss_steps=4", "trainer.evaluation_period=0",
                         "trainer.checkpoint_period=12"], tmp_path)
    assert job.meter.final["steps_run"] == 16
    between = {step: names for step, names in seen.items() if step > 4 and step not in (8, 12, 16)}
    assert between == {}, f"reads between reading steps (step: calls): {between}"
    assert {8, 12, 16} <= set(seen), f"the reading steps read nothing: {sorted(seen)}"


def test_a_loop_whose_optimizer_cannot_skip_on_the_device_reads_every_step(tmp_path, reads_by_step):
    """optimizer.fused=false: the guard cannot hold an update on the device, so it reads each
    step's loss (as torch's own single-tensor AdamW reads its step counts), and still trains."""
    seen = reads_by_step
    job = fit_untracked(["backend=torch", "data=synthetic", "trainer=quick", "trainer.max_steps=8",
                         "trainer.display_loss_steps=4", "trainer.evaluation_period=0",
                         "trainer.checkpoint_period=0", "+optimizer.fused=false"], tmp_path)
    assert job.meter.history["train/loss"][-1][1] < job.meter.history["train/loss"][0][1]
    assert all("item" in seen.get(step, ()) for step in (5, 6, 7)), seen


@pytest.mark.parametrize("scaled", [False, True], ids=["fp32", "loss scaler"])
@pytest.mark.parametrize("held", [0.0, 1.0])
def test_a_flag_on_the_device_holds_the_fused_optimizer_s_update(scaled, held):
    """`update` with a device flag: 1.0 leaves weights, moments and step count as they were; 0.0
    updates. With the loss scaler (fp16 on CUDA; its CPU twin here) the flag joins its overflow
    flag, and a held step backs the scale off as an overflow would."""
    from orchestrate.backends.torch import holds_on_device, update

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0, enabled=scaled)
    assert holds_on_device(optimizer) and not holds_on_device(torch.optim.AdamW(model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    update(optimizer, scaler, torch.tensor(held))
    unchanged = [torch.equal(b, p) for b, p in zip(before, model.parameters())]
    assert unchanged == [held == 1.0] * 2
    assert float(optimizer.state[model.weight]["step"]) == 1.0 - held
    assert not hasattr(optimizer, "found_inf")  # handed over for this step only
    if scaled:
        assert scaler.get_scale() == (2.0 if held else 4.0)


def test_lamb_trains_the_pytorch_loop(tmp_path):
    """optimizer=lamb: pytorch-optimizer's Lamb (the `lamb` extra) built on the loop's parameters; the loss falls."""
    job = fit_untracked(["backend=torch", "data=synthetic", "trainer=quick", "trainer.max_steps=30", "optimizer=lamb",
                         "optimizer.lr=0.01", "trainer.display_loss_steps=5", "trainer.evaluation_period=0",
                         "trainer.checkpoint_period=0"], tmp_path)
    losses = [v for _, v in job.meter.history["train/loss"]]
    assert losses[-1] < 0.9 * losses[0]


def test_tensorboard_histograms_read_nothing_between_display_steps(make_cfg, tmp_path, reads_by_step):
    """trainer.tensorboard=true on a tracked run: the weights' and gradients' histograms and norms are
    read at the display steps (4, 8, 12, 16) alone; steps 5-7, 9-11 and 13-15 read nothing."""
    from orchestrate import app

    app.train(make_cfg("backend=torch", "trainer.max_steps=16", "trainer.display_loss_steps=4", "trainer.tensorboard=true",
                       "trainer.evaluation_period=0", "trainer.checkpoint_period=0"), tmp_path / "out")
    between = {step: names for step, names in reads_by_step.items() if step > 4 and step not in (8, 12, 16)}
    assert between == {}, f"reads between display steps (step: calls): {between}"
    assert list((tmp_path / "out" / "tensorboard").glob("events.out.tfevents.*"))
