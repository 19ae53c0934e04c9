"""`orchestrate` / `python -m orchestrate`: a training run or a sweep (orchestrate.cli), or one of
the COMMANDS below. Each is imported only when named: `orchestrate server` does not pay for torch.
"""

import importlib
import sys

COMMANDS = {
    "server": "orchestrate.server",  # the team's MLflow server on PostgreSQL, artifacts served
    "doctor": "orchestrate.doctor",  # will this stack work? one line per check
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        raise SystemExit(importlib.import_module(COMMANDS[sys.argv[1]]).main(sys.argv[2:]))
    from orchestrate import cli

    cli.main()


if __name__ == "__main__":
    main()
