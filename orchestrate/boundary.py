"""The error boundary of every entry point: the command line's up-front check (`cli.main`,
`cli.validate`, `cli.validate_sweep`), one Hydra job (`app.hydra_job`, a single run), the command
around Hydra (`cli.main`), and the other commands (orchestrate.commands: doctor, server, sync,
up, down, slurm-ray). One table, `TABLE`, maps what was raised to the one line the console gets,
the exit code and whether the full traceback is kept (the run's log, else a crash file:
orchestrate.errors); an entry point says which stage it is (`Where`), and the first row of that
stage whose types match decides; a new kind of error is one row. Exit codes: 2 when the input was
wrong and nothing ran (schema.ConfigError, errors.Refused), 1 for a run or a command that failed
(errors.Failed), 128 + N for a run stopped by signal N, 130 for a sweep stopped by Ctrl-C.

The table's words for Hydra's and OmegaConf's composition errors (`explain`) live here too.
"""

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from orchestrate import errors, signals
from orchestrate.config import ORCHESTRATE, ConfigSource, group_options, load_config
from orchestrate.meter import Diverged
from orchestrate.schema import ConfigError

# The stages: nothing ran yet; one Hydra job; around Hydra; a command besides a run (orchestrate.commands).
CHECK, RUN, COMMAND, TOOL = "check", "run", "command", "tool"
EVERY_STAGE = (CHECK, RUN, COMMAND, TOOL)
COMPOSITION_ERRORS = (ConfigCompositionException, MissingConfigException, OverrideParseException,
                      OmegaConfBaseException, yaml.YAMLError)


@dataclass
class Where:
    """What the boundary's lines name: the stage, and what the entry point knows there."""

    stage: str  # CHECK, RUN, COMMAND or TOOL
    prefix: str = ""  # what a TOOL's lines begin with ("orchestrate slurm-ray: ")
    trial: str = ""  # which trial of a sweep, before a refusal's line ("trial 3 (lr=0.1): ")
    overrides: list[str] = field(default_factory=list)  # the command line's, for composition errors
    source: ConfigSource = ORCHESTRATE  # the config folders the command composes from
    out_dir: Path | None = None  # the run's folder (its checkpoints)
    log_file: str | None = None  # the run's log: where a traceback goes (else a crash file)
    resumable: bool = True  # the run's backend continues from a checkpoint (trainer.resume)
    multirun: bool = False  # a sweep (`-m`, `+sweep`)
    handled: BaseException | None = None  # what the boundary turned into an exit, once it has


@dataclass(frozen=True)
class Row:
    types: tuple[type[BaseException], ...]
    stages: tuple[str, ...]
    line: Callable[[BaseException, Where], str]  # the console's line (after "error: ", unless `said`)
    code: Callable[[BaseException, Where], int]
    traceback: bool = False  # keep the full traceback (the run's log or a crash file) and say where
    applies: Callable[[BaseException, Where], bool] = lambda e, where: True
    said: str = "error: "  # what the line starts with


def exit_code(n: int) -> Callable[[BaseException, Where], int]:
    return lambda e, where: n


def diverged_message(e: Diverged, folder: Path, resumable: bool = True) -> str:
    """One line: the step, the run FAILED, the checkpoint kept from before it, what to do next."""
    if e.step == 1 and e.what == "loss":  # before any update: the learning rate has not acted yet
        return (f"{e}, before any update; the MLflow run is marked FAILED. The inputs or the model's first forward "
                "give non-finite values, not the learning rate: check the data set's inputs for nan or inf, "
                "and the model's forward on them")
    from orchestrate import checkpoints  # (imports torch: only a run that diverged gets here)

    kept = checkpoints.latest(folder)
    return (f"{e}; the MLflow run is marked FAILED. "
            + (f"The last checkpoint before it, {kept}, is kept: the same command with a lower optimizer.lr and "
               "trainer.resume=auto goes on from it" if kept and resumable else
               f"The last checkpoint before it, {kept}, is kept; lower optimizer.lr and run again" if kept else
               "No checkpoint was written before it: lower optimizer.lr and run again")
            + " (or drop the updates of non-finite steps with trainer.on_nonfinite=skip)")


def not_a_config(e: BaseException, where: Where) -> str:
    """A config file Hydra could read but not take (a user's YAML file that holds one value)."""
    return (f"{where.trial}{errors.shown_path(file_being_read(e))}: not a config of keys and values "
            f"({str(e).splitlines()[0]})")


def failed_check(e: BaseException, where: Where) -> str:
    """The user's own code (a model, a data set) failed in the up-front check: nothing ran."""
    return f"{where.trial}{errors.one_line(e, 'the up-front check')}"


def failed_run(e: BaseException, where: Where) -> str:
    run = getattr(e, "orchestrate_run", None)
    return errors.one_line(e) + (f"; the MLflow run {run} is marked FAILED" if run else "")


def stopped_by(e: BaseException) -> str:
    """`SIGTERM` for a signals.Stopped, `Ctrl-C` for a plain KeyboardInterrupt."""
    return str(e) if isinstance(e, signals.Stopped) else "Ctrl-C"


def failed_command(e: BaseException, where: Where) -> str:
    return errors.one_line(e, "the sweep" if where.multirun else "")


TABLE: tuple[Row, ...] = (
    # Bad input, said in the check's, the backend's or the command's own words: nothing ran.
    Row((ConfigError, errors.Refused), EVERY_STAGE, lambda e, w: f"{w.trial}{w.prefix}{e}", exit_code(2)),
    # What a command started failed, in its own words (its cause's traceback kept, if it has one).
    Row((errors.Failed,), EVERY_STAGE, lambda e, w: f"{w.prefix}{e}", exit_code(1), traceback=True,
        applies=lambda e, w: e.__cause__ is not None),
    Row((errors.Failed,), EVERY_STAGE, lambda e, w: f"{w.prefix}{e}", exit_code(1)),
    Row(COMPOSITION_ERRORS, (CHECK,), lambda e, w: explain(e, w.overrides, w.source), exit_code(2)),
    Row((ValueError, TypeError), (CHECK,),  # Hydra's own defaults list on `backend=[1]`
        lambda e, w: (f"{' '.join(w.overrides)}: a config group's choice must be a name or a list of names "
                      f"({str(e).splitlines()[0]})"), exit_code(2), applies=lambda e, w: raised_by_hydra(e)),
    Row((Exception,), (CHECK,), not_a_config, exit_code(2), applies=lambda e, w: file_being_read(e) is not None),
    Row((Exception,), (CHECK,), failed_check, exit_code(2), traceback=True),
    # A run that failed: its MLflow run is FAILED.
    Row((errors.CheckpointError,), (RUN,), lambda e, w: f"{e}; the MLflow run is marked FAILED",
        exit_code(1)),  # a full disk: one line, not a traceback through torch
    Row((Diverged,), (RUN,), lambda e, w: diverged_message(e, w.out_dir / "checkpoints", w.resumable), exit_code(1)),
    Row((signals.Stopped,), (RUN,),
        lambda e, w: (f"{e}: the MLflow run is marked KILLED; the same command with trainer.resume=auto continues it "
                      "from its last checkpoint"),
        lambda e, w: 128 + e.signum, said="stopped by "),  # as a shell reports a process ended by the signal
    Row((Exception,), (RUN,), failed_run, lambda e, w: 1 if getattr(e, "orchestrate_run", None) else 2,
        traceback=True),  # 2: it failed before a run opened (the input, or what it names)
    # Around Hydra: a sweep's failure, or Ctrl-C in a sweep (a single run reports its own stop).
    Row((KeyboardInterrupt,), (COMMAND,),
        lambda e, w: ("Ctrl-C: trials still running are ended and marked KILLED; the same command continues the "
                      "sweep"), exit_code(130), applies=lambda e, w: w.multirun, said="stopped by "),
    Row((Exception,), (COMMAND,), failed_command,
        lambda e, w: 1 if w.multirun or getattr(e, "orchestrate_run", None) else 2, traceback=True),
    # A command besides a run stopped by Ctrl-C (or by a signal its block takes: signals.Stopped):
    # one line, the exit code a shell gives a process ended by the signal.
    Row((KeyboardInterrupt,), (TOOL,), lambda e, w: f"{w.prefix}stopped by {stopped_by(e)}",
        lambda e, w: 128 + getattr(e, "signum", 2), said=""),
    # A command besides a run, failed in a way it did not foresee: one line, the traceback kept.
    Row((Exception,), (TOOL,), lambda e, w: f"{w.prefix}{errors.one_line(e)}", exit_code(1), traceback=True),
)


@contextlib.contextmanager
def boundary(where: Where) -> Iterator[Where]:
    """Whatever the block raises that a row of `where.stage` takes: its line on stderr (with the
    traceback kept where the row says), then SystemExit with its code. Anything else (SystemExit
    itself, a KeyboardInterrupt no row takes) goes on up."""
    try:
        yield where
    except errors.Escaped as e:  # what a Hydra callback raised past Hydra: its own row
        _exit(e.error, where)
    except (Exception, KeyboardInterrupt) as e:
        _exit(e, where)


def _exit(e: BaseException, where: Where) -> None:
    row = next((r for r in TABLE if where.stage in r.stages and isinstance(e, r.types) and r.applies(e, where)),
               None)
    if row is None:
        raise  # the exception being handled, as it was raised
    where.handled = e
    line = row.line(e, where)
    if row.traceback:
        errors.report(line, e, where.log_file)
    else:
        print(f"{row.said}{line}", file=sys.stderr, flush=True)
    raise SystemExit(row.code(e, where)) from None


# ---- what the table says of composition errors --------------------------------------------------

def explain(e: Exception, overrides: list[str], source: ConfigSource = ORCHESTRATE) -> str:
    """One plain sentence for Hydra's and OmegaConf's composition errors."""
    cause = e
    while cause.__cause__ is not None and isinstance(cause, ConfigCompositionException):
        cause = cause.__cause__
    if isinstance(cause, yaml.MarkedYAMLError) and cause.problem_mark is not None:
        # A YAML file of the user's own (--config-dir, --config-path): where, and PyYAML's words.
        mark = cause.problem_mark
        said = "; ".join(str(p) for p in (cause.context, cause.problem) if p)
        return f"{errors.shown_path(mark.name)}:{mark.line + 1}:{mark.column + 1}: not valid YAML ({said})"
    if isinstance(cause, yaml.YAMLError):
        return f"not valid YAML ({str(cause).splitlines()[0]})"
    if isinstance(cause, MissingConfigException) and cause.missing_cfg_file:
        group = cause.missing_cfg_file.rsplit("/", 1)[0]  # hydra/launcher/nope -> hydra/launcher
        options = cause.options or []
        chosen = next((o.split("=", 1)[1] for o in overrides if o.lstrip("+~").split("=")[0] == group), "?")
        return f"{group}={chosen}: no such choice; allowed: {', '.join(options)}"
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):
        key = cause.full_key or cause.key
        parent = key.rsplit(".", 1)[0] if key and "." in key else ""
        return f"{key}: unknown key{allowed_keys(parent, source)}"
    if isinstance(cause, OverrideParseException):
        bare = next((o for o in overrides if "=" not in o and not o.startswith("~")), None)
        if bare is not None:  # `+experiment`, `backend`: a key without its value
            options = group_options(bare.lstrip("+"), source)
            allowed = f"; allowed: {', '.join(f'{bare}={o}' for o in options)}" if options else ""
            return f"{bare}: an override needs a value (KEY=VALUE, +KEY=VALUE to add, ~KEY to delete){allowed}"
    if isinstance(cause, ValidationError):
        if cause.full_key == "trainer.num_workers" and str(cause.msg).startswith("Value '["):  # Ray Train's (min, max)
            return (f"{cause.full_key}: {cause.msg.splitlines()[0]}; an elastic range is two keys: "
                    "trainer.min_workers=MIN trainer.num_workers=MAX")
        return f"{cause.full_key}: {cause.msg.splitlines()[0]}"
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return f"{cause.full_key}: {cause.msg.splitlines()[0]}"
    return str(e).splitlines()[0] + late_header(str(e), source)


def late_header(message: str, source: ConfigSource) -> str:
    """For an error in a config file ("In 'experiment/wine': ...") whose `# @package` line is not
    its first: Hydra reads that header only at the top of the file (a comment above it, such as
    the file's path, makes it an ordinary comment, and the file then lands in its group's package)."""
    named = re.match(r"In '([\w/.-]+)'", message)
    if not named:
        return ""
    for folder in filter(None, (source.config_dir, source.config_path, str(Path(__file__).parent / "conf"))):
        path = Path(folder) / f"{named.group(1)}.yaml"
        if path.is_file():
            lines = path.read_text().splitlines()
            at = next((i for i, line in enumerate(lines) if line.lstrip("# ").startswith("@package")), None)
            if at:  # found, and not on the first line
                return (f"; {errors.shown_path(str(path))}:{at + 1}: `{lines[at].strip()}` must be the file's first "
                        "line (Hydra reads the header only there)")
            return ""
    return ""


def allowed_keys(parent: str, source: ConfigSource = ORCHESTRATE) -> str:
    if not parent:
        return ""
    try:
        node = OmegaConf.select(load_config(source=source), parent)
        return f"; allowed keys in {parent}: {', '.join(str(k) for k in node)}" if node is not None else ""
    except Exception:
        return ""





def file_being_read(e: BaseException) -> str | None:
    """The config file Hydra was reading when `e` was raised (its file source's `load_config`), if any."""
    found, tb = None, e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "load_config" and "full_path" in tb.tb_frame.f_locals:
            found = tb.tb_frame.f_locals["full_path"]
        tb = tb.tb_next
    return found


def raised_by_hydra(e: BaseException) -> bool:
    """Whether Hydra itself raised `e` (its innermost frame is Hydra's code)."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and f"{os.sep}hydra{os.sep}" in frames[-1].filename
