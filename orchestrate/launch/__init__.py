"""Sweeps on Ray: `_core` is the private core of orchestrate's Hydra launcher plugin
(`hydra_plugins/orchestrate_ray_launcher`, `hydra/launcher=orchestrate_ray`), imported only when a
sweep launches. A sweep's MLflow side is in `orchestrate.sweeps` (Hydra callbacks, any launcher)."""
