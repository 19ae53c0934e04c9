"""Secrets stay out of what a run leaves behind: the params logged to MLflow, the config.yaml artifact,
and Hydra's own copies of the config in the output folder (`.hydra/`). Values under secret-looking
keys (`password`, `token`, `secret`, `api_key`, ...) become `***`, and so does the password in a
URI's user part (`postgresql://user:pw@host/db`, `http://user:pw@host`). The run itself still gets
the real values: only the records are redacted.

`RedactSecrets` is a Hydra callback (conf/config.yaml, `hydra.callbacks.redact_secrets`): Hydra
writes `.hydra/config.yaml`, `hydra.yaml` and `overrides.yaml` just before `on_job_start`, which
rewrites them; as a callback it works with any launcher.
"""

import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

HIDDEN = "***"
# Whole words of a key (`db_password`, `hfToken`, `aws_secret_access_key`): `n_tokens` and
# `tokenizer` are not secrets.
SECRET_WORDS = {"password", "passwd", "pwd", "secret", "token", "credential", "credentials", "apikey"}
SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key")}
# scheme://user:password@host...: the password is the part between the first ':' and the '@'.
URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][\w+.-]*://[^:/@\s]*:)(?P<password>[^@/\s]+)(?P<tail>@)")


def is_secret(key: str) -> bool:
    """Whether a (dotted) key's last part looks like it holds a secret."""
    last = str(key).rsplit(".", 1)[-1]
    words = [w.lower() for w in re.split(r"[_\-\s]+|(?<=[a-z0-9])(?=[A-Z])", last) if w]
    return bool(SECRET_WORDS.intersection(words)) or any(pair in SECRET_PAIRS for pair in zip(words, words[1:]))


def redact_text(text: str) -> str:
    """A string with the passwords of the URIs in it hidden."""
    return URI_PASSWORD.sub(lambda m: f"{m['head']}{HIDDEN}{m['tail']}", text)


def redact(node: Any, key: str = "") -> Any:
    """A plain container (OmegaConf.to_container) with its secrets hidden."""
    if isinstance(node, dict):
        return {k: redact(v, str(k)) for k, v in node.items()}
    if isinstance(node, list):
        return [redact(v, key) for v in node]
    if key and is_secret(key) and node not in (None, "") and not str(node).startswith("${"):
        return HIDDEN  # (an unresolved `${oc.env:DB_PASSWORD}` says where it comes from, not what it is)
    return redact_text(node) if isinstance(node, str) else node


def redact_override(override: str) -> str:
    """One command-line override, `key=value`, with a secret value hidden."""
    key, sep, value = override.partition("=")
    if sep and is_secret(key.lstrip("+~")):
        return f"{key}={HIDDEN}"
    return redact_text(override)


def redacted_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML, secrets hidden: what is saved beside a run."""
    return OmegaConf.to_yaml(redact(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))


class RedactSecrets(Callback):
    """Rewrites Hydra's records of the job's config (`<output>/.hydra/*.yaml`) with secrets hidden."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if not config.hydra.output_subdir:
            return
        folder = Path(config.hydra.runtime.output_dir) / config.hydra.output_subdir
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
            path = folder / name
            if not path.exists():
                continue
            saved = OmegaConf.load(path)
            container = OmegaConf.to_container(saved, resolve=False)
            if name == "overrides.yaml":
                clean = [redact_override(str(o)) for o in container]
            else:
                clean = redact(container)
                if name == "hydra.yaml":  # the command line's overrides, as Hydra records them
                    hydra = clean.get("hydra", {})
                    for group, overrides in hydra.get("overrides", {}).items():
                        hydra["overrides"][group] = [redact_override(str(o)) for o in overrides]
                    job = hydra.get("job", {})
                    if job.get("override_dirname"):  # the same, joined (`a=1,b=2`) for folder names
                        job["override_dirname"] = ",".join(map(redact_override, job["override_dirname"].split(",")))
            if clean != container:
                path.write_text(OmegaConf.to_yaml(OmegaConf.create(clean)))
