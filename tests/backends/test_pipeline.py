"""Pipeline stages on the runner (trainer.pipeline_parallel_size): the model cut where one tensor
crosses (stages.py), the schedules' orders, the optimizer state of the stages as one model's
(pipeline.py), and the runs a user compares: the same seed, initial weights and global batch give
the one-process run's loss at every step, with P = 2 and with P x D = 2 x 2, and a stage killed
mid-run restarts the group from the checkpoint to the same losses. Refusals: one line, exit 2,
nothing written."""

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

from orchestrate import app, checkpoints, schema
from orchestrate.backends.runner import pipeline, stages
from orchestrate.config import load_config
from orchestrate.tasks.models import MLP, CharTransformer
from tests.conftest import client_for, long, metric_steps
from tests.helpers import refused_in_one_line

COMMON = ["backend=runner", "backend.engine=torch", "data=synthetic", "trainer=quick", "trainer.max_steps=12",
          "trainer.evaluation_period=6", "trainer.checkpoint_period=6", "trainer.display_loss_steps=1",
          "optimizer=adamw", "optimizer.lr=0.01", "backend.cpus_per_worker=0.5"]
MLP_4 = ["model.hidden=[32,32,32]"]  # 4 linear layers


# ---- where a model is cut ----------------------------------------------------------------------
@pytest.mark.parametrize("model,x", [(MLP(16, 4, [32, 32, 32]), torch.randn(5, 16)),
                                     (CharTransformer(96, 16, n_layer=4, n_embd=32), torch.randint(0, 96, (3, 16)))])
@pytest.mark.parametrize("count", [2, 3])
def test_the_stages_in_turn_compute_the_models_forward_and_share_its_parameters(model, x, count):
    parts = stages.cut(model, count)
    y = x
    for part in parts:
        y = part(y)
    assert torch.equal(y, model(x))
    names = [name for part in parts for name, _ in part.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())  # each parameter in one stage
    ours = {name: p for part in parts for name, p in part.named_parameters()}
    assert all(ours[name] is p for name, p in model.named_parameters())  # the model's own tensors


def test_the_balanced_cut_of_a_deep_model_is_found_without_trying_every_combination():
    """400 places and 8 stages (C(400, 7) combinations): the linear partition gives 8 stages of 25
    equal layers each."""
    parts = stages.cut(MLP(8, 8, [8] * 199), 8)
    assert [sum(p.numel() for p in part.parameters()) for part in parts] == [25 * (8 * 8 + 8)] * 8


def test_the_char_transformer_is_cut_between_its_blocks_balanced_by_parameters():
    model = CharTransformer(96, 16, n_layer=4, n_embd=32)
    cuts = stages.trace(model)
    # Not at pos: tok's output crosses there too.
    assert list(cuts.at) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f", "head"]
    assert cuts.choose(2, None) == ["blocks.2"]


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        return self.c(self.b(h)) + h  # h crosses a cut before c beside c's input: no cut there


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, x):
        return self.mid(self.emb(x)) @ self.emb.weight.T


@pytest.mark.parametrize("model,count,names,message", [
    (MLP(16, 4, [32]), 2, ["net.7"], "'net.7' is no place to cut (the model has no such unit); "
                                     "the places a stage can begin: net.1, net.2"),
    (MLP(16, 4, [32]), 4, None, "the model can be cut in 2 place(s) (the places a stage can begin: net.1, net.2); "
                                "allowed: pipeline_parallel_size up to 3"),
    (MLP(16, 4, [32]), 2, ["net.1", "net.2"], "2 name(s) for pipeline_parallel_size=2"),
    (MLP(16, 4, [32, 32]), 3, ["net.3", "net.1"], "in the order the forward reaches them"),
    (Residual(), 2, ["c"], "'c' is no place to cut (a skip connection or a second value crosses there); "
                           "the places a stage can begin: b"),
    (Residual(), 3, None, "the model can be cut in 1 place(s)"),
    (Tied(), 2, None, "emb.weight is used on both sides of a cut (tied weights)"),
])
def test_a_model_that_cannot_be_cut_there_is_refused_saying_where_it_can(model, count, names, message):
    with pytest.raises(schema.ConfigError, match=None) as refused:
        stages.cut(model, count, names)
    assert message in str(refused.value)


def test_a_forward_that_cannot_be_traced_is_refused_in_one_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(x) if x.sum() > 0 else self.a(x)

    with pytest.raises(schema.ConfigError, match="Branchy's forward cannot be traced to cut it into stages"):
        stages.cut(Branchy(), 2)


# ---- the schedules -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(pipeline.SCHEDULES))
@pytest.mark.parametrize("P,M", [(2, 2), (2, 5), (3, 4), (4, 8)])
def test_every_schedule_runs_each_micro_batch_forward_then_backward_once(name, P, M):
    for s in range(P):
        order = pipeline.SCHEDULES[name](s, P, M)
        assert sorted(order) == sorted([("F", i) for i in range(M)] + [("B", i) for i in range(M)])
        assert all(order.index(("F", i)) < order.index(("B", i)) for i in range(M))
        assert [i for k, i in order if k == "B"] == list(range(M))  # the last backward is the last micro-batch's


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8)])
def test_1f1b_holds_at_most_p_minus_stage_micro_batches_and_gpipe_all_of_them(P, M):
    def most_in_flight(order):
        held, most = 0, 0
        for kind, _ in order:
            held += 1 if kind == "F" else -1
            most = max(most, held)
        return most

    assert [most_in_flight(pipeline.one_f_one_b(s, P, M)) for s in range(P)] == [P - s for s in range(P)]
    assert all(most_in_flight(pipeline.gpipe(s, P, M)) == M for s in range(P))


def test_the_stages_optimizer_states_merge_into_the_whole_models_and_split_back():
    model = MLP(8, 2, [8, 8])
    whole = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    whole.step()
    parts = stages.cut(model, 2)
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    indices = [[order[n] for n, _ in p.named_parameters()] for p in parts]
    own = [pipeline.split_state(whole.state_dict(), index) for index in indices]
    for part, state in zip(parts, own):  # each stage's optimizer takes its part
        torch.optim.AdamW(part.parameters()).load_state_dict(state)
    merged = pipeline.merge_states(own, indices)
    assert merged["param_groups"] == whole.state_dict()["param_groups"]
    assert merged["state"].keys() == whole.state_dict()["state"].keys()
    for i, state in whole.state_dict()["state"].items():
        assert all(torch.equal(state[k], merged["state"][i][k]) for k in state)


# ---- bad input: one line, exit 2, nothing written -----------------------------------------------
RUNNER = ["backend=runner", "backend.engine=torch", "data=synthetic"]


@pytest.mark.parametrize("overrides,message", [
    ([*RUNNER, "trainer.num_workers=3", "trainer.pipeline_parallel_size=2"],
     "trainer.pipeline_parallel_size=2 does not divide trainer.num_workers=3"),
    ([*RUNNER, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "model.hidden=[]"],
     "the model can be cut in 0 place(s)"),
    ([*RUNNER, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "trainer.pipeline_split=[net.9]"],
     "'net.9' is no place to cut"),
    ([*RUNNER, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "trainer.pipeline_schedule=zigzag"],
     "trainer.pipeline_schedule='zigzag': allowed: gpipe, 1f1b"),
    ([*RUNNER, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "trainer.pipeline_schedule=1f1b"],
     "trainer.gradient_accumulation_steps=1: trainer.pipeline_schedule=1f1b runs at least as many micro-batches"),
    (["backend=torch", "data=synthetic", "trainer.pipeline_parallel_size=2"],
     "trainer.pipeline_parallel_size=2: pipeline stages need backend=runner"),
    ([*RUNNER, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "trainer.min_workers=1"],
     "an elastic run changes its worker count"),
    pytest.param(["backend=runner", "backend.engine=ondevice", "data=synthetic", "trainer.num_workers=2",
                  "trainer.pipeline_parallel_size=2"],
                 "backend.engine=ondevice with trainer.pipeline_parallel_size=2: its loop cannot run a stage",
                 marks=pytest.mark.ort),
])
def test_bad_pipeline_input(overrides, message, tmp_path, monkeypatch, capsys):
    assert message in refused_in_one_line(monkeypatch, capsys, tmp_path, *overrides)


def test_engine_auto_with_stages_chooses_among_the_engines_that_train_a_stage(make_cfg):
    from orchestrate.job import Job

    job = Job.prepare(make_cfg("backend=runner", "backend.engine=auto", "trainer.num_workers=2",
                               "trainer.pipeline_parallel_size=2", "backend.cpus_per_worker=0.5"))
    runner = job.backend
    with_stages, without = (set(runner.engine_candidates(runner.engine_backend(), s)) for s in (True, False))
    assert "torch" in with_stages and "compile" in with_stages
    assert with_stages <= without and all(getattr(schema.build(runner.sized(node), "x"), "stages", False)
                                          for node in runner.engine_candidates(runner.engine_backend(), True).values())


# ---- runs: the same losses as one process --------------------------------------------------------
@pytest.fixture(scope="module")
def local_ray(ray_shared):
    return ray_shared


def train(tmp_path, name: str, *overrides: str):
    cfg = load_config([*COMMON, f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides])
    return app.train(cfg, tmp_path / name)


def curves(tmp_path, *runs, key="train/loss"):
    client = client_for(f"sqlite:///{tmp_path}/mlflow.db")
    return [metric_steps(client, r.run_id, key) for r in runs]


def final_weights(result) -> dict[str, torch.Tensor]:
    path = sorted((result.out_dir / "checkpoints").glob("step_*"))[-1]
    return checkpoints.load_torch(path)["model"]


@pytest.mark.slow  # 3 runs, about 30 s
@pytest.mark.ort  # the exported models read back by ONNX Runtime
def test_two_stages_and_two_by_two_equal_one_process_at_every_step(tmp_path, local_ray):
    """MLP, AdamW: one worker with batch 64 against 2 stages x 4 micro-batches of 16 (GPipe) and
    2 stages x 2 replicas x 2 micro-batches of 16 (1F1B): the loss at every step, the evaluations and
    the gradient norm equal to 1e-5; the last checkpoint holds the whole model (every stage's
    part), and its weights and optimizer state are the one-process run's."""
    one = train(tmp_path, "one", *MLP_4, "trainer.num_workers=1", "trainer.batch_size=64")
    p2 = train(tmp_path, "p2", *MLP_4, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "trainer.batch_size=16",
               "trainer.gradient_accumulation_steps=4")
    p2d2 = train(tmp_path, "p2d2", *MLP_4, "trainer.num_workers=4", "trainer.pipeline_parallel_size=2", "trainer.batch_size=16",
                 "trainer.gradient_accumulation_steps=2", "trainer.pipeline_schedule=1f1b")
    for key in ("train/loss", "eval/loss", "train/grad_norm"):
        reference, *pipelined = curves(tmp_path, one, p2, p2d2, key=key)
        assert len(reference) == (12 if key != "eval/loss" else 2)
        for curve in pipelined:
            assert [s for s, _ in curve] == [s for s, _ in reference]
            assert [v for _, v in curve] == pytest.approx([v for _, v in reference], abs=1e-5)
    assert reference[0][1] != reference[-1][1]  # it trained
    assert curves(tmp_path, p2d2, key="train/replica_divergence")[0][-1][1] == 0.0
    for run in (p2, p2d2):
        whole, ours = final_weights(one), final_weights(run)
        assert whole.keys() == ours.keys()
        for name in whole:
            torch.testing.assert_close(ours[name], whole[name], atol=1e-5, rtol=0, msg=name)
        assert answers(run.out_dir / "model.onnx") == pytest.approx(answers(one.out_dir / "model.onnx"), abs=1e-5)


def answers(path) -> list[float]:
    """The exported model's logits for a fixed input, through ONNX Runtime: the whole model, servable."""
    import numpy as np
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    return session.run(None, {"input": x})[0].ravel().tolist()


EQUALITY = "tests/backends/test_pipeline.py::test_two_stages_and_two_by_two_equal_one_process_at_every_step"


@pytest.mark.slow
@long(stands_for=EQUALITY)
def test_the_char_transformer_in_two_stages_equals_one_process(tmp_path, local_ray):
    lm = ["model=char_transformer", "data=python_source", "model.n_layer=2", "model.n_embd=32", "trainer.max_steps=6",
          "trainer.evaluation_period=0", "trainer.checkpoint_period=0"]
    one = train(tmp_path, "one", *lm, "trainer.num_workers=1", "trainer.batch_size=8")
    p2 = train(tmp_path, "p2", *lm, "trainer.num_workers=2", "trainer.pipeline_parallel_size=2",
               "trainer.batch_size=4", "trainer.gradient_accumulation_steps=2", "trainer.pipeline_schedule=1f1b")
    reference, pipelined = curves(tmp_path, one, p2)
    assert len(reference) == 6
    assert [v for _, v in pipelined] == pytest.approx([v for _, v in reference], abs=1e-5)


@pytest.mark.slow
def test_a_killed_stage_restarts_the_group_from_the_checkpoint_to_the_same_losses(tmp_path, local_ray):
    """SIGKILL in a stage's worker at step 9 (backend.max_failures=1): both stages restart from the
    step-6 checkpoint (the whole model's, every stage's part of one step, and each stage's RNG: the
    second stage's dropout draws its own masks); MLflow holds every step once, equal to an
    uninterrupted run's."""
    marker = tmp_path / "kill_while_this_exists"
    marker.touch()
    overrides = ["model._target_=tests.helpers.DropoutMLP", "model.hidden=[32,32]", "backend.max_failures=1",
                 "trainer.num_workers=2", "trainer.pipeline_parallel_size=2", "trainer.batch_size=16",
                 "trainer.gradient_accumulation_steps=2", "data._target_=tests.helpers.KillingData",
                 "+data.kill_at=16", "+data.rank=0"]
    killed = train(tmp_path, "killed", *overrides, f"+data.marker={marker}")
    assert not marker.exists(), "the worker was never killed"
    # Both stages read every batch (the first its inputs, the last its targets): the positions read
    # again after the restart are those of steps 7-9 alone (12, 13: step 7), not from the start
    # (the first, 0, is also read by the command's check of the data against the model).
    served = Counter(int(line) for line in Path(f"{marker}.served").read_text().split())
    assert min(p for p, n in served.items() if n > 2 and p != 0) == 12
    reference = train(tmp_path, "reference", *overrides, "+data.marker=", "tracking.experiment=reference")
    got, expected = curves(tmp_path, killed, reference)
    assert [s for s, _ in got] == list(range(1, 13))
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], abs=1e-6)
    assert client_for(f"sqlite:///{tmp_path}/mlflow.db").get_run(killed.run_id).info.status == "FINISHED"


@pytest.mark.slow
@long(stands_for=EQUALITY)
@pytest.mark.parametrize("engine,atol", [("compile", 1e-5), pytest.param("ortmodule", 1e-4, marks=pytest.mark.ort)])
def test_the_compile_and_ortmodule_engines_train_stages_as_one_process(engine, atol, tmp_path, local_ray):
    """Each stage under torch.compile, or wrapped by ORTModule (its input's gradient flows back to
    the stage before): the loss at every step is the one-process torch run's (ORT's kernels sum
    differently: 1e-4)."""
    one = train(tmp_path, "one", *MLP_4, "trainer.num_workers=1", "trainer.batch_size=64", "trainer.max_steps=8")
    p2 = train(tmp_path, "p2", *MLP_4, f"backend.engine={engine}", "trainer.num_workers=2", "trainer.max_steps=8",
               "trainer.pipeline_parallel_size=2", "trainer.batch_size=32", "trainer.gradient_accumulation_steps=2")
    reference, pipelined = curves(tmp_path, one, p2)
    assert len(pipelined) == 8
    assert [v for _, v in pipelined] == pytest.approx([v for _, v in reference], abs=atol)
