"""Sweeps: the Ray launcher's private core (`_core`), used by the Hydra plugin in
`hydra_plugins/orchestrate_ray_launcher`, and the MLflow side of a sweep (`sweep_runs`)."""
