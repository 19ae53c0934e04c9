"""Secrets stay out of the records: params, tags and config.yaml in MLflow, and Hydra's .hydra/*.yaml."""

import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from orchestrate.tracking.redact import HIDDEN, is_secret, redact, redact_override, redact_text


@pytest.mark.parametrize("key", ["password", "db.password", "DB_PASSWD", "api_key", "apiKey", "hf_token",
                                 "tracking.tags.aws_secret_access_key", "credentials"])
def test_secret_looking_keys(key):
    assert is_secret(key)


@pytest.mark.parametrize("key", ["lr", "model.n_tokens", "batch_size", "data.tokenizer", "keyword", "password_file.x"])
def test_ordinary_keys_are_kept(key):
    # n_tokens and tokenizer contain "token" but name a count and a component: whole words count.
    assert not is_secret(key)


def test_redact_hides_values_and_uri_passwords_and_keeps_the_rest():
    cfg = {"trainer": {"lr": 0.1, "max_steps": 3},
           "tracking": {"uri": "postgresql://alice:s3cr3t@db.example:5432/mlflow", "tags": {"api_token": "t0k"}},
           "db": {"password": "hunter2", "env_password": "${oc.env:DB_PASSWORD}", "empty_secret": ""}}
    out = redact(cfg)
    assert out["trainer"] == {"lr": 0.1, "max_steps": 3}
    assert out["tracking"]["uri"] == f"postgresql://alice:{HIDDEN}@db.example:5432/mlflow"
    assert out["tracking"]["tags"]["api_token"] == HIDDEN and out["db"]["password"] == HIDDEN
    assert out["db"]["env_password"] == "${oc.env:DB_PASSWORD}"  # where it comes from, not what it is
    assert out["db"]["empty_secret"] == ""
    assert cfg["db"]["password"] == "hunter2"  # the run still gets the real value


def test_overrides_and_text():
    assert redact_override("+db.password=hunter2") == f"+db.password={HIDDEN}"
    assert redact_override("optimizer.lr=0.1") == "optimizer.lr=0.1"
    assert redact_override("tracking.uri=http://bob:pw@127.0.0.1:5000") == f"tracking.uri=http://bob:{HIDDEN}@127.0.0.1:5000"
    assert redact_text("http://127.0.0.1:5000/x") == "http://127.0.0.1:5000/x"  # a port is not a password


@pytest.mark.slow
def test_a_run_records_no_secret(tmp_path):
    """A real run given a secret tag and a URI with a password (SQLite ignores neither): the value
    appears nowhere in MLflow's params, tags or config.yaml artifact, nor in Hydra's output folder."""
    secret = "s3cr3t-value-4711"
    store = f"sqlite:///{tmp_path}/mlflow.db"
    done = subprocess.run(
        [sys.executable, "-m", "orchestrate", "backend=torch", "data=synthetic", "trainer=quick",
         "trainer.max_steps=2", "trainer.progress=false", f"tracking.uri={store}",
         f"+tracking.tags.api_token={secret}", f"hydra.run.dir={tmp_path}/out"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("orchestrate").experiment_id])
    assert run.data.params["tracking.tags.api_token"] == HIDDEN and run.data.tags["api_token"] == HIDDEN
    assert secret not in str(run.data.params) + str(run.data.tags)
    config = (tmp_path / "artifact").mkdir() or client.download_artifacts(run.info.run_id, "config.yaml",
                                                                           str(tmp_path / "artifact"))
    assert "api_token: '***'" in open(config).read() and secret not in open(config).read()
    saved = {p.name: p.read_text() for p in (tmp_path / "out" / ".hydra").glob("*.yaml")}
    assert set(saved) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
    assert all(secret not in text for text in saved.values()), [n for n, t in saved.items() if secret in t]
    assert secret not in done.stdout + done.stderr
