"""The README and the guide's pages are a contract: every command in them runs as written and does
what the text next to it says. Their fenced `bash` blocks and their bad-input examples (`$ command`
then the `error:` line) are read from README.md and every docs/*.md page (tests/guide.py: a page
added to docs/ is read with no list to edit); each command has an entry in EXPECTED below (what to
check, and the extra overrides that keep it short where the text allows: fewer steps, fewer Optuna
trials). A command added to the guide without an entry here, or an entry whose command left the
guide, fails `test_every_readme_command_is_checked`; `test_the_guide_s_pages_and_links_hold`
checks that the README links every page and that every relative link of the guide resolves.

Commands run from a fresh temporary folder with the installed wheel's environment active
(`python`, `orchestrate`: the `installed_wheel` fixture), as a user who installed orchestrate would
run them; the "Your own project" commands run in the project the README's file blocks spell out.
Placeholders are filled in: HEAD (a Ray head on 127.0.0.1), MLFLOW_HOST:5000 (a tracking server on
127.0.0.1), /shared (a temporary folder). The Slurm commands (a sweep on `submitit_slurm`, the
runner's sbatch script, docs/runner.md) run on a one-node Slurm cluster in tests/launch/test_slurm.py.
"""

import importlib
import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
import tomllib
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from tests import guide
from tests.conftest import ROOT, long, sweep_runs

VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# 20 steps, the loss logged every 5 (so that a test sees it fall), no progress bar.
SHORT = ("trainer.max_steps=20", "trainer.display_loss_steps=5", "trainer.progress=false")


def blocks(language: str) -> list[str]:
    """The bodies of the guide's fenced blocks in `language` ("" for plain ``` blocks), page by
    page (tests/guide.py: README.md, then docs/*.md)."""
    found = [block for text in guide.texts()  # list items indent theirs
             for block in re.findall(r"^[ \t]*```(\w*)\n(.*?)^[ \t]*```", text, re.S | re.M)]
    return [textwrap.dedent(body) for lang, body in found if lang == language]


def bash_commands() -> list[tuple[str, dict[str, str]]]:
    """(command, environment it runs with) for each command line of the ```bash blocks:
    continuations joined, comments dropped; `export X=Y` applies to the block's later lines."""
    found = []
    for block in blocks("bash"):
        exported = {}
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["export"]:
                exported.update(w.split("=", 1) for w in words[1:])
            elif words:
                found.append((" ".join(words), dict(exported)))
    return found


def bad_input_examples() -> list[tuple[str, str]]:
    """(command, the error line the guide shows) from its plain ``` blocks of `$ ` lines."""
    found = []
    for block in blocks(""):
        lines = block.splitlines()
        for command, shown in zip(lines, lines[1:]):
            if command.startswith("$ "):
                found.append((command[2:], shown))
    return found


def project_files() -> dict[str, str]:
    """The "Your own project" files: fenced blocks one of whose first two lines names
    `my_project/...`, each written exactly as a user copies the block (comments included: a
    comment above `# @package _global_` would break the file as it breaks a user's)."""
    files = {}
    for body in blocks("python") + blocks("yaml"):
        name = re.search(r"^# (my_project/\S+)", "\n".join(body.splitlines()[:2]), re.MULTILINE)
        if name:
            files[name.group(1)] = body
    return files


@dataclass
class Expect:
    """What the guide's text promises for a command, and how to run it here."""

    extra: tuple[str, ...] = SHORT  # appended to the command: a short run where the text allows
    where: str = "empty"  # empty: a new empty folder; project: the README's my_project/
    code: int = 0
    says: tuple[str, ...] = ()  # printed (stdout or stderr)
    runs: int | None = None  # MLflow runs the command leaves in the folder's store, all FINISHED
    experiment: str = "orchestrate"
    tags: dict[str, str] = field(default_factory=dict)  # every run has these (children only for a sweep)
    metrics: dict[str, float] = field(default_factory=dict)  # and these final metric values
    skip: str = ""  # why it is not run here
    check: Callable[[Path, str], None] | None = None  # more of what the text says: check(folder, printed)
    separate: str = ""  # the test of its own that runs it (it needs a server or a cluster beside it): its
    # name in this module, or path::name in another (one that shares its cluster with other tests)
    long: str = ""  # runs in `make test-long` only: what shows its feature in CI's tier (a test, by
    # path::name, or another guide command that takes the same path)


# ---- what the sweeps page (docs/sweeps.md) says of its commands, beyond runs and tags -------------

def default_grid_with_nested_runs(folder: Path, printed: str) -> None:
    """`+sweep` with no experiment: the default grid (lr_grid), one child run per trial under one
    parent run, which holds the sweep's definition, summary table and chart."""
    client, (parent,), children = sweep_runs(folder)
    assert sorted(c.info.run_name for c in children) == ["optimizer.lr=0.001", "optimizer.lr=0.003",
                                                          "optimizer.lr=0.01"]
    for child in children:
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["optimizer.lr"] == child.info.run_name.split("=")[1]
    assert {"summary.md", "sweep.json", "trials_loss_curves.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id)}
    table = open(client.download_artifacts(parent.info.run_id, "summary.md")).read()
    assert table.count("| FINISHED |") == 3 and "| optimizer.lr=0.01 | FINISHED |" in printed  # printed too


def shootout_is_a_tie_told_apart_by_speed(folder: Path, printed: str) -> None:
    """Same model, data and seed on four backends: the same final loss, so the summary calls it a
    tie and says who was fastest; every trial's speed columns are filled."""
    _, _, children = sweep_runs(folder, "backend_shootout")
    assert sorted(c.data.tags["backend"] for c in children) == ["compile", "ondevice", "ortmodule", "torch"]
    finals = [c.data.metrics["final/train_loss"] for c in children]
    assert max(finals) - min(finals) < 1e-3 * max(finals)
    assert re.search(r"tie: trials 0, 1, 2, 3 reach eval_loss [0-9.]+ within 0\.1%; fastest to it: trial \d "
                     r"\(backend=\w+, [0-9.]+ s\); highest throughput: trial \d \([0-9,]+ samples/s\)", printed)
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "| FINISHED |" in line]
    assert len(rows) == 4 and all(all(cell.strip() for cell in row.split("|")[6:9]) for row in rows)


def optuna_draws_from_the_search_space(folder: Path, printed: str) -> None:
    """Optuna over learning rate (log-uniform in [1e-4, 3e-2]) and batch size (32, 64, 128)."""
    _, _, children = sweep_runs(folder, "lr_search")
    lrs = {c.data.params["optimizer.lr"] for c in children}
    assert len(lrs) == len(children) and all(1e-4 <= float(v) <= 3e-2 for v in lrs)
    assert {c.data.params["trainer.batch_size"] for c in children} <= {"32", "64", "128"}
    assert "best: trial" in printed


def pruned_sweep_keeps_its_study_beside_the_store(folder: Path, printed: str) -> None:
    """The same search with a pruner: the study beside the MLflow store, each trial told to it
    (complete or pruned, none left running)."""
    import optuna

    optuna_draws_from_the_search_space(folder, printed)
    (summary,) = optuna.get_all_study_summaries(f"sqlite:///{folder}/mlflow-optuna.db")
    study = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{folder}/mlflow-optuna.db")
    assert sorted({t.state.name for t in study.trials}) <= ["COMPLETE", "PRUNED"] and len(study.trials) == 4


def auto_kept_its_probe_table(folder: Path, printed: str) -> None:
    """backend=auto: every single-process backend probed, the table printed and kept with the run,
    whose `backend` tag is the one the table chose."""
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    table = open(client.download_artifacts(run.info.run_id, "auto_probe.md")).read()
    chosen = [line.split("|")[1].strip() for line in table.splitlines() if "| chosen: " in line]
    assert chosen == [run.data.tags["backend"]]
    assert all(f"| {b} |" in printed for b in ("torch", "ortmodule", "ondevice"))


def nothing_ran(folder: Path, printed: str) -> None:
    """`+dry_run`: the plan only: no MLflow store, no sweep summary."""
    assert not (folder / "mlflow.db").exists() and "sweep summary" not in printed


PROJECT_RUN = dict(where="project", runs=1, tags={"model": "models.MyNet", "data": "models.Wine"})
PROJECT_TORCH = "python -m orchestrate --config-dir conf model=my_net data=my_data backend=torch"
COMPARISON = "tests/sweeps/test_compare.py::test_a_comparison_leaves_its_table_chart_and_verdict_on_the_parent_run"
TWO_OBJECTIVES = ("tests/sweeps/test_pareto.py::"
                  "test_a_two_objective_sweep_leaves_its_front_on_the_parent_and_aliases_per_objective")
EXPECTED: dict[str, Expect] = {
    # ---- the two commands, and the package used directly
    "make run": Expect(says=("eval accuracy", "MLflow run"), runs=1, tags={"backend": "ortmodule"}),
    "make test": Expect(skip="the command that runs the default tier"),
    "make test-all": Expect(skip="the command that runs this test (CI runs it)"),
    "make test-long": Expect(skip="the full suite again, with the long tier"),
    "make coverage": Expect(skip="the full suite again, with coverage"),
    "python -m orchestrate backend=ondevice optimizer.lr=3e-3": Expect(runs=1, tags={"backend": "ondevice"}),
    "python -m orchestrate backend=torch model=char_transformer data=python_source trainer.batch_size=16": Expect(
        extra=("trainer.max_steps=5", "trainer.display_loss_steps=5", "trainer.progress=false"), runs=1,
        tags={"backend": "torch", "model": "orchestrate.tasks.models.CharTransformer"}),
    # ---- Hugging Face models
    "python -m orchestrate model=hf_causal_lm data=python_source backend=ondevice": Expect(
        extra=("trainer.max_steps=5", "trainer.display_loss_steps=5", "trainer.progress=false"), runs=1,
        tags={"backend": "ondevice", "model": "orchestrate.tasks.hf.CausalLM"}),
    "python -m orchestrate model=hf_classifier data=python_files backend=ortmodule": Expect(
        extra=("trainer.max_steps=5", "trainer.display_loss_steps=5", "trainer.progress=false"), runs=1,
        tags={"backend": "ortmodule", "model": "orchestrate.tasks.hf.Classifier"},
        long="tests/tasks/test_hf.py::test_torch_ortmodule_and_ondevice_agree_on_the_first_steps"),
    "python -m orchestrate backend=auto": Expect(
        runs=1, tags={"auto": "true"}, check=auto_kept_its_probe_table,
        says=("backend=auto: 5 warm-up + 30 timed steps per candidate",),
        long="tests/backends/test_auto.py::test_auto_chooses_neither_the_slow_nor_the_disagreeing_backend_of_a_users_config_dir"),
    "python -m orchestrate backend=runner backend.engine=auto trainer.num_workers=2": Expect(
        runs=1, tags={"backend": "runner", "auto": "true"}, metrics={"world_size": 2}, says=("backend.engine=auto: ",),
        long="tests/backends/test_auto.py::test_the_runner_chooses_its_engine_the_same_way"),
    "python -m orchestrate --cfg job": Expect(extra=(), says=("backend:", "trainer:", "max_steps: 300"), runs=0),
    "orchestrate backend=torch": Expect(runs=1, tags={"backend": "torch"}),
    # ---- the warm stack: `ran` below runs every command warm, on one `orchestrate up` of its own
    "orchestrate up": Expect(
        separate="tests/cluster/test_warm.py::test_up_starts_ray_and_the_server_on_loopback_with_a_private_record"),
    "orchestrate down": Expect(separate="tests/cluster/test_warm.py::test_down_stops_every_process_of_the_stack"),
    # ---- checking the stack
    "orchestrate doctor": Expect(
        separate="tests/commands/test_doctor.py::test_healthy_stack_passes_every_check_and_trains_every_backend"),
    "orchestrate doctor --no-smoke": Expect(extra=(), says=("checks: all OK", "smoke runs skipped"), runs=0),
    # ---- installing elsewhere
    "pip install .": Expect(
        skip="downloads the whole stack; the installed_wheel fixture makes this install without the dependencies"),
    "pip install .[ort]": Expect(skip="the ORT stack's install below, without its pins"),
    "pip install -c constraints.txt .[ort,hf,server]": Expect(
        skip="downloads the whole stack; make setup installs it the same way (CI)"),
    "python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install": Expect(
        skip="make setup built them; building again takes minutes"),
    # ---- your own project
    "python -m orchestrate --config-dir conf model=my_net data=my_data backend=torch": Expect(**PROJECT_RUN),
    "python -m orchestrate --config-dir conf model=my_net data=my_data backend=ortmodule": Expect(
        **PROJECT_RUN, long=PROJECT_TORCH),
    "python -m orchestrate --config-dir conf model=my_net data=my_data backend=ondevice": Expect(
        **PROJECT_RUN, long="python -m orchestrate --config-path conf --config-name train backend=ondevice"),
    "python -m orchestrate --config-dir conf model=my_net data=my_data backend=runner trainer.num_workers=2": Expect(
        **{**PROJECT_RUN, "metrics": {"world_size": 2}}),
    "python -m orchestrate --config-dir conf +experiment=wine +sweep=backends": Expect(
        where="project", runs=5, experiment="wine", says=("sweep summary",),
        tags={"model": "models.MyNet", "data": "models.Wine"}, long="python -m orchestrate +experiment=backend_shootout +sweep"),
    "python -m orchestrate hydra.searchpath=[file://conf] model=my_net data=my_data": Expect(**PROJECT_RUN),
    "python -m orchestrate --config-path conf --config-name train backend=ondevice": Expect(
        **{**PROJECT_RUN, "experiment": "wine", "tags": {**PROJECT_RUN["tags"], "backend": "ondevice"}}),
    # ---- looking at the runs
    "make ui": Expect(separate="test_make_ui_serves_the_runs"),
    # ---- a team's MLflow server
    "python -m orchestrate server": Expect(
        separate="tests/commands/test_server.py::test_mlflow_and_postgresql_listen_on_loopback_only"),
    "python -m orchestrate server --host 0.0.0.0": Expect(
        skip="reachable from every network this machine is on; the tests bind 127.0.0.1 only"),
    "python -m orchestrate server --backend-store-uri postgresql://USER:PASSWORD@DBHOST:5432/mlflow": Expect(
        separate="tests/commands/test_server.py::test_a_second_server_in_front_of_an_existing_postgresql"),
    # ---- sweeps
    "python -m orchestrate backend=ortmodule +sweep": Expect(
        runs=4, says=("sweep summary",), tags={"backend": "ortmodule"}, check=default_grid_with_nested_runs),
    "python -m orchestrate +experiment=backend_shootout +sweep": Expect(
        runs=5, experiment="backend_shootout", says=("sweep summary",), check=shootout_is_a_tie_told_apart_by_speed),
    "python -m orchestrate +experiment=lr_search +sweep": Expect(
        extra=(*SHORT, "hydra.sweeper.n_trials=4"), runs=5, experiment="lr_search", says=("sweep summary",),
        tags={"backend": "ondevice"}, check=optuna_draws_from_the_search_space,
        long="python -m orchestrate +experiment=lr_search +sweep hydra/sweeper/pruner=successive_halving"),
    # ---- docs/compare.md: a comparison with repeats, and sweeps over several objectives
    "python -m orchestrate +sweep=compare": Expect(
        runs=13, says=("verdict, samples/s:",), long=COMPARISON),
    "python -m orchestrate +sweep=compare compare.repeats=5 backend=torch,ortmodule model=cnn": Expect(
        runs=11, says=("verdict, samples/s:",), tags={"model": "orchestrate.tasks.models.ConvNet"}, long=COMPARISON),
    "python -m orchestrate +sweep=tradeoff": Expect(runs=13, says=("Pareto front:",), long=TWO_OBJECTIVES),
    "python -m orchestrate +sweep=tradeoff hydra/sweeper/pruner=dominated tracking.register_model=digits": Expect(
        runs=13, says=("Pareto front:", "models:/digits@best_eval_loss"), long=TWO_OBJECTIVES),
    "python -m orchestrate +sweep=lr_optuna sweep.metric=[eval_loss,peak_rss_mb] sweep.direction=[minimize,minimize]":
        Expect(extra=(*SHORT, "hydra.sweeper.n_trials=3"), runs=4, says=("Pareto front:",), long=TWO_OBJECTIVES),
    "python -m orchestrate +experiment=lr_search +sweep hydra/sweeper/pruner=successive_halving": Expect(
        extra=(*SHORT, "hydra.sweeper.n_trials=4"), runs=5, experiment="lr_search", says=("sweep summary",),
        tags={"backend": "ondevice"}, check=pruned_sweep_keeps_its_study_beside_the_store),
    "python -m orchestrate -m optimizer.lr=1e-3,1e-2 backend=torch,ondevice": Expect(
        runs=5, says=("sweep summary",),
        long="tests/sweeps/test_sweeps.py::test_the_same_sweep_leaves_the_same_runs_on_every_launcher"),
    "python -m orchestrate +experiment=backend_shootout +sweep +dry_run": Expect(
        says=("plan: 4 trial(s)", "backend=torch", "backend=compile", "backend=ortmodule", "backend=ondevice"), runs=0,
        check=nothing_ran),
    "python -m orchestrate -m hydra/launcher=submitit_slurm hydra.launcher.partition=P hydra.launcher.account=A "
    "hydra.launcher.timeout_min=120 hydra.launcher.cpus_per_task=4 hydra.launcher.gpus_per_node=1 "
    "hydra.launcher.mem_gb=16 hydra.launcher.setup=[source .venv/bin/activate] tracking.uri=http://MLFLOW_HOST:5000 "
    "optimizer.lr=1e-3,1e-2": Expect(
        separate="tests/launch/test_slurm.py::test_the_readme_sweep_runs_every_trial_as_a_slurm_job"),  # a Slurm cluster
    # ---- the runner
    "python -m orchestrate backend=runner trainer.num_workers=2": Expect(
        runs=1, tags={"backend": "runner"}, metrics={"world_size": 2},
        long="python -m orchestrate --config-dir conf model=my_net data=my_data backend=runner trainer.num_workers=2"),
    "python -m orchestrate backend=runner backend.engine=torch trainer.gradient_accumulation_steps=4": Expect(
        runs=1, metrics={"effective_batch_size": 256},
        long="tests/backends/test_runner.py::test_accumulating_k_micro_batches_equals_one_batch_k_times_larger"),
    "python -m orchestrate backend=runner backend.engine=ondevice trainer.num_workers=2": Expect(
        runs=1, metrics={"world_size": 2}, long="tests/backends/test_runner.py::test_ondevice_engine_all_reduces_gradients"),
    "python -m orchestrate backend=runner backend.engine=ondevice backend.average_every=10 optimizer=sgd "
    "trainer.num_workers=2": Expect(runs=1, metrics={"world_size": 2},
                                    long="tests/backends/test_runner.py::test_ondevice_engine_federated_averaging"),
    "python -m orchestrate backend=runner trainer.checkpoint_period=50 trainer.resume=auto": Expect(
        runs=1, says=("trainer.resume=auto: no unfinished run with this config has a checkpoint; starting a new run",)),
    "ray job submit --address http://HEAD:8265 --working-dir . -- python -m orchestrate backend=runner "
    "trainer.num_workers=2 backend.placement_strategy=SPREAD tracking.uri=http://MLFLOW_HOST:5000 "
    "backend.storage_path=/shared/ray trainer.checkpoint_period=100 hydra.run.dir=/shared/outputs/run1": Expect(
        separate="tests/cluster/test_ray_jobs.py::test_ray_job_submit_runs_the_runner_on_a_cluster"),  # beside its other jobs
    "python -m orchestrate backend=runner backend.ray_address=auto trainer.min_workers=2 trainer.num_workers=8 "
    "trainer.checkpoint_period=50": Expect(
        skip="joins a running cluster of 8 CPUs; tests/backends/test_runner_hosts.py runs an elastic run (1 to 2 "
             "workers) on test hosts, one lost under it and back; tests/backends/test_elastic.py (long tier) on a "
             "loopback cluster that grows and shrinks under it (scripts/elastic.py)"),
    # ---- the runner's pipeline stages (docs/runner.md): 4 workers need more CPUs than the suite's machine lends
    "python -m orchestrate backend=runner backend.engine=torch trainer.num_workers=4 trainer.pipeline_parallel_size=2 "
    "trainer.gradient_accumulation_steps=4 trainer.batch_size=16 trainer.pipeline_schedule=1f1b": Expect(
        separate="tests/backends/test_pipeline.py::test_two_stages_and_two_by_two_equal_one_process_at_every_step"),
    "python -m orchestrate backend=runner backend.engine=torch trainer.num_workers=2 trainer.pipeline_parallel_size=2 "
    "model=char_transformer data=python_source trainer.pipeline_split=[blocks.1]": Expect(
        separate="tests/backends/test_pipeline.py::test_the_char_transformer_in_two_stages_equals_one_process"),
    # ---- the runner on a Slurm allocation: docs/runner.md's sbatch script, submitted to a Slurm cluster
    **{command: Expect(separate="tests/launch/test_slurm.py::test_the_runner_on_a_slurm_allocation") for command in (
        "source .venv/bin/activate",
        "exec python -m orchestrate slurm-ray -- tracking.uri=http://MLFLOW_HOST:5000 backend.storage_path=/shared/ray "
        "trainer.checkpoint_period=100 hydra.run.dir=/shared/outputs/runner-$SLURM_JOB_ID",
        "sbatch runner.sbatch")},
    # ---- GPU: this project's machines cannot install ORT training beside a GPU
    ".venv/bin/pip uninstall -y onnxruntime-training-cpu": Expect(skip="would replace the tested CPU build"),
    ".venv/bin/pip install onnxruntime-training==1.19.2": Expect(skip="GPU build: needs CUDA 11.8"),
    ".venv/bin/python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install": Expect(
        skip="make setup built them; building again takes minutes"),
    ".venv/bin/python -m orchestrate trainer.device=cuda optimizer=fused_adam": Expect(
        code=2, says=("needs CUDA, and this machine has none",), runs=0),  # on this CPU machine: refused up front
}


def test_every_readme_command_is_checked():
    commands = [c for c, _ in bash_commands()]
    assert sorted(set(commands)) == sorted(EXPECTED), "the guide (README.md, docs/*.md) and EXPECTED disagree"
    assert all(separate_test_exists(e.separate) for e in EXPECTED.values() if e.separate)
    # A command left to `make test-long` names what shows its path in CI: a test, or a command that runs there.
    assert all(separate_test_exists(e.long) if "::" in e.long else e.long in RUNNABLE and not EXPECTED[e.long].long
               for e in EXPECTED.values() if e.long)
    assert set(project_files()) >= {"my_project/models.py", "my_project/conf/model/my_net.yaml",
                                    "my_project/conf/data/my_data.yaml"}
    assert len(bad_input_examples()) >= 3


def test_a_sweep_over_backends_is_described_by_the_backends_it_runs():
    """A guide command whose comment lists what `+sweep=NAME` sweeps over names exactly the
    backends conf/sweep/NAME.yaml runs (not "every backend" for the single-process ones)."""
    described = 0
    for line in (ROOT / "README.md").read_text().splitlines():
        sweep = re.search(r"\+sweep=(\w+)\s+#\s*([\w, ]+):", line)
        if not sweep:
            continue
        swept = OmegaConf.load(ROOT / "conf" / "sweep" / f"{sweep.group(1)}.yaml").hydra.sweeper.params.backend
        assert [b.strip() for b in sweep.group(2).split(",")] == [b.strip() for b in swept.split(",")], line
        described += 1
    assert described >= 1


FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.S | re.M)


def anchors(text: str) -> set[str]:
    """The `#anchor`s of a markdown text's headings, as GitHub makes them: lower case, punctuation
    but `-` and `_` dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCED.sub("", text), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_guide_s_pages_and_links_hold():
    """The README links every docs/*.md page (its "Read more"), and every relative link of the
    guide (README.md, docs/*.md; images included) names a file that exists and, with `#anchor`, a
    heading of that page: a section moved between pages leaves no link behind."""
    readme = (ROOT / "README.md").read_text()
    assert [p.name for p in guide.pages()[1:] if f"](docs/{p.name})" not in readme] == []
    broken = []
    for page, text in zip(guide.pages(), guide.texts(), strict=True):
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", text)):  # a link in a code block is code
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file.read_text())):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert broken == []


def separate_test_exists(name: str) -> bool:
    path, _, test = name.rpartition("::")
    module = importlib.import_module(path.removesuffix(".py").replace("/", ".")) if path else sys.modules[__name__]
    return callable(getattr(module, test, None))


def write_project(folder: Path) -> Path:
    for name, text in project_files().items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder / "my_project"


def run(command: str, cwd: Path, env: dict, extra=(), timeout: int = 600) -> subprocess.CompletedProcess:
    words = shlex.split(command)
    if words[0] == "make":  # this checkout's Makefile (and its .venv), run from the folder
        words = ["make", "-s", "-f", str(ROOT / "Makefile"), *words[1:], *([f"ARGS={' '.join(extra)}"] if extra else [])]
        extra = ()
    if words[0].startswith(".venv/"):
        words[0] = str(ROOT / words[0])
    return subprocess.run([*words, *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def mlflow_runs(folder: Path, experiment: str) -> list:
    if not (folder / "mlflow.db").exists():
        return []
    client = MlflowClient(f"sqlite:///{folder}/mlflow.db")
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


RUNNABLE = [c for c, e in EXPECTED.items() if not e.skip and not e.separate]
CASES = [pytest.param(c, marks=[long(EXPECTED[c].long)] if EXPECTED[c].long else []) for c in RUNNABLE]


@pytest.fixture(scope="module")
def warm_env(installed_wheel, tmp_path_factory) -> Iterator[dict[str, str]]:
    """The installed wheel's environment with a warm stack up (`orchestrate up`, as the README's
    quick start says, from a folder of its own, with the wheel's interpreter: Ray's workers import
    orchestrate from the wheel too), sized for CONCURRENT commands; `orchestrate down` at the end.
    The guide's commands join its Ray head by themselves (each has its own folder and store, so
    a sweep still starts its own MLflow server); tests/cluster/test_warm.py shows the stack itself, cold
    commands are shown everywhere else."""
    env = {**installed_wheel.env, "ORCHESTRATE_STATE_DIR": str(tmp_path_factory.mktemp("readme_state"))}
    folder = tmp_path_factory.mktemp("readme_stack")
    up = subprocess.run(["orchestrate", "up", "--num-cpus", str(2 * CONCURRENT)], cwd=folder, env=env,
                        capture_output=True, text=True, timeout=300)
    assert up.returncode == 0, up.stdout + up.stderr
    yield env
    subprocess.run(["orchestrate", "down"], cwd=folder, env=env, capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def ran(warm_env, tmp_path_factory, request) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Every runnable command of the guide, run CONCURRENT at a time, warm (`warm_env`): they are
    independent (each in its own folder, with its own MLflow store), and most of a short command's
    time is start-up and waiting. Command -> (its folder, its result)."""

    def one(command: str) -> tuple[Path, subprocess.CompletedProcess]:
        expect = EXPECTED[command]
        folder = tmp_path_factory.mktemp("readme")
        folder = write_project(folder) if expect.where == "project" else folder
        env = {**warm_env, **dict(bash_commands())[command], "PYTHONUNBUFFERED": "1"}
        return folder, run(command, folder, env, expect.extra)

    # Only the commands this pytest session selected (`-k` picks some).
    chosen = [c for c in RUNNABLE if any(getattr(item, "callspec", None) and item.callspec.params.get("command") == c
                                         for item in request.session.items)]
    if not chosen:
        return {}
    with ThreadPoolExecutor(ON_RAY) as on_ray, ThreadPoolExecutor(CONCURRENT - ON_RAY) as rest:
        futures = {c: (on_ray if places_work_on_ray(c) else rest).submit(one, c) for c in chosen}
        return {c: f.result() for c, f in futures.items()}


CONCURRENT = 4
# The commands that place work on the warm head (a sweep's trials, the runner's workers) ask for
# at most 4 CPUs each (the guide's sweeps have at most 4 trials, its runners 2 workers): ON_RAY
# of them at a time fit its 2 * CONCURRENT CPUs. More would not, and a sweep that finds every CPU
# taken waits hydra.launcher.placement_timeout_s (60 s) and stops, as it would for a user whose
# other sweep holds the head (its message says so; test_runner shows it). The rest run beside them.
ON_RAY = 2


def places_work_on_ray(command: str) -> bool:
    """A sweep (read as the command line's own `rewrite_sweep_words` reads it) that runs, or a runner."""
    from orchestrate.cli import MULTIRUN_FLAGS, rewrite_sweep_words

    words = shlex.split(command)
    args = words[words.index("orchestrate") + 1:] if "orchestrate" in words else []  # after `python -m orchestrate`
    sweep = any(word in MULTIRUN_FLAGS for word in rewrite_sweep_words(args))
    return (sweep and "+dry_run" not in args) or "backend=runner" in args


@pytest.mark.slow
@pytest.mark.parametrize("command", CASES)
def test_the_command_does_what_the_readme_says(command, ran):
    expect = EXPECTED[command]
    folder, done = ran[command]
    printed = done.stdout + done.stderr
    assert done.returncode == expect.code, printed[-4000:]
    for text in expect.says:
        assert text in printed, printed[-4000:]
    if expect.runs is not None:
        runs = mlflow_runs(folder, expect.experiment)
        assert len(runs) == expect.runs, [r.info.run_name for r in runs]
        assert all(r.info.status == "FINISHED" for r in runs)
        trials = [r for r in runs if "mlflow.parentRunId" in r.data.tags] or runs
        for r in trials:
            assert expect.tags.items() <= r.data.tags.items(), r.data.tags
            assert r.data.tags["version.orchestrate"] == VERSION
            for key, value in expect.metrics.items():
                assert r.data.metrics.get(key) == value, (key, r.data.metrics)
            history = MlflowClient(f"sqlite:///{folder}/mlflow.db").get_metric_history(r.info.run_id, "train/loss")
            losses = [m.value for m in sorted(history, key=lambda m: m.step)]
            assert len(losses) < 2 or losses[-1] < losses[0], losses  # it trained
    if "num_workers=2" in command and expect.code == 0:  # a worker group joined the warm head, as the quick start says
        assert "warm: joined the Ray head" in printed, printed[-4000:]
    if expect.check is not None:
        expect.check(folder, printed)
    if expect.code != 0:
        assert list(folder.iterdir()) == []  # refused before anything was written


# An example that names no backend runs the default one (ortmodule) as typed: ORT's where it is missing.
# The sweep's example (10 s: a sweep's check starts Ray beside it) runs in the full suite; the single
# runs' examples stand for it in the default tier.
@pytest.mark.parametrize("command,shown", [pytest.param(c, s, marks=([] if "backend=" in c else [pytest.mark.ort]) +
                                                        ([pytest.mark.slow] if " -m " in c else []))
                                           for c, s in bad_input_examples()], ids=[c for c, _ in bad_input_examples()])
def test_the_bad_input_examples_print_what_the_readme_shows(command, shown, installed_wheel, tmp_path):
    done = run(command, tmp_path, installed_wheel.env)
    assert done.returncode == 2
    printed = done.stderr.strip()
    # The guide shortens long lists with "...": what it shows must be the start of the line.
    assert printed.startswith(shown.removesuffix("...").rstrip()), (printed, shown)
    assert len(printed.splitlines()) == 1 and done.stdout.strip() == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_make_ui_serves_the_runs(installed_wheel, tmp_path):
    """`make ui` opens MLflow's UI on this folder's store at http://127.0.0.1:5000."""
    proc = subprocess.Popen(["make", "-s", "-f", str(ROOT / "Makefile"), "ui"],
                            cwd=tmp_path, env=installed_wheel.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline, answer = time.monotonic() + 120, None
        while time.monotonic() < deadline and answer is None:
            try:
                answer = urllib.request.urlopen("http://127.0.0.1:5000/health", timeout=5).read()
            except OSError:
                time.sleep(1)
        assert answer == b"OK"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def test_the_readme_s_timings_are_the_measured_ones():
    """The guide's "about N seconds" figures (README.md, docs/doctor.md) are those
    benchmarks/readme_timings.py measured and wrote to docs/readme-timings.md (the script writes
    both: a figure moved in one moves in both)."""
    spec = importlib.util.spec_from_file_location("readme_timings", ROOT / "benchmarks" / "readme_timings.py")
    timings = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(timings)
    measured = timings.read_table((ROOT / "docs" / "readme-timings.md").read_text())
    assert set(measured) == set(timings.COMMANDS)
    assert timings.read_claims(guide.text()) == measured
