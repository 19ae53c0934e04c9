"""`python -m orchestrate [overrides]`: check the command line, then hand it to the Hydra app.

Bad input (an unknown key or choice, a wrong type, an impossible combination) is caught here by
composing the config and building its objects once, before Hydra creates an output folder or a
run is opened in MLflow: one plain message, exit code 2.
"""

import contextlib
import io
import sys

from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from orchestrate import app, schema

MULTIRUN_FLAGS = ("-m", "--multirun")


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Hydra's own flags (--cfg, -m, hydra/...) versus config overrides."""
    flags, overrides = [], []
    it = iter(argv)
    for arg in it:
        if arg.startswith("-"):
            flags.append(arg)
            if arg in ("--cfg", "-c", "--package", "-p", "--info", "--config-name", "-cn", "--config-dir", "-cd",
                       "--experimental-rerun") and "=" not in arg:
                nxt = next(it, None)
                if nxt is not None:
                    flags.append(nxt)
        elif arg.startswith(("hydra.", "hydra/", "+hydra", "~hydra")):
            flags.append(arg)
        else:
            overrides.append(arg)
    return flags, overrides


def explain(e: Exception, overrides: list[str]) -> str:
    """One plain sentence for Hydra's and OmegaConf's composition errors."""
    cause = e
    while cause.__cause__ is not None and isinstance(cause, ConfigCompositionException):
        cause = cause.__cause__
    if isinstance(cause, MissingConfigException) and cause.missing_cfg_file:
        group = cause.missing_cfg_file.split("/")[0]
        options = cause.options or []
        chosen = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=")[0] == group), "?")
        return f"{group}={chosen}: no such choice; allowed: {', '.join(options)}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = cause.full_key or cause.key
        parent = key.rsplit(".", 1)[0] if key and "." in key else ""
        return f"{key}: unknown key{allowed_keys(parent)}"
    if isinstance(cause, ValidationError):
        return f"{cause.full_key}: {cause.msg.splitlines()[0]}"
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return f"{cause.full_key}: {cause.msg.splitlines()[0]}"
    return str(e).splitlines()[0]


def allowed_keys(parent: str) -> str:
    if not parent:
        return ""
    try:
        node = OmegaConf.select(app.load_config(), parent)
        return f"; allowed keys in {parent}: {', '.join(str(k) for k in node)}" if node is not None else ""
    except Exception:
        return ""


def validate(overrides: list[str]) -> None:
    """Compose and build the single-run config once; exit 2 with one message if it is wrong."""
    try:
        # Libraries chatter on import (torch's C++ extension loader prints about CUDA): keep the
        # check quiet so that bad input gets one message.
        with contextlib.redirect_stderr(io.StringIO()):
            app.check(app.load_config(overrides))
    except schema.ConfigError as e:
        fail(str(e))
    except (ConfigCompositionException, MissingConfigException, OverrideParseException, OmegaConfBaseException) as e:
        fail(explain(e, overrides))


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def rewrite_sweep_words(argv: list[str]) -> list[str]:
    """Hydra's grammar rejects a bare `+sweep` ("missing EQUAL"), so it is read here:
    `+sweep` -> multirun with the experiment's sweep; `+sweep=NAME` -> multirun with
    conf/sweep/NAME.yaml; `+dry_run` -> print the sweep's plan and run nothing."""
    out, multirun = [], False
    for arg in argv:
        if arg == "+sweep":
            multirun = True
        elif arg.startswith("+sweep="):
            multirun = True
            out.append(arg[1:])  # `sweep` is in the defaults list: override the choice
        elif arg == "+dry_run":
            multirun = True
            out.append("hydra.launcher.dry_run=true")
        else:
            out.append(arg)
    if "+sweep" in argv:
        # The experiment's sweep, or the configured default when it names none.
        _, overrides = split_args(out)
        try:
            cfg = app.load_config(overrides)
            if cfg.sweep.name == "none":
                out.append(f"sweep={cfg.sweep.default}")
        except Exception:
            pass  # composition errors are reported by Hydra itself, with the whole command line
    if multirun and not any(a in MULTIRUN_FLAGS for a in out):
        out.insert(0, "--multirun")
    return out


def main() -> None:
    argv = rewrite_sweep_words(sys.argv[1:])
    flags, overrides = split_args(argv)
    multirun = any(f in MULTIRUN_FLAGS for f in flags)
    if not multirun and not any(f.startswith(("--cfg", "-c", "--info", "--help", "-h", "--hydra-help")) for f in flags):
        validate(overrides)
    sys.argv = [sys.argv[0], *argv]
    try:
        app.hydra_main()
    finally:
        if multirun:
            from orchestrate.launch import _core

            _core.close_open_sweep()


if __name__ == "__main__":
    main()
