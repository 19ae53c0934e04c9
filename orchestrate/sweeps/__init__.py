"""Sweeps, whatever the launcher: `plan` works out a sweep's trials before anything runs (so the
entry point checks every trial's config), and `callbacks.SweepTracking`, a Hydra callback, tracks
the sweep in MLflow (a parent run, one nested child run per trial, resuming, the summary). The
callback's private modules: `_runs` (the MLflow runs), `_summary` (the table), `_server` (the
MLflow server in front of a SQLite store)."""
