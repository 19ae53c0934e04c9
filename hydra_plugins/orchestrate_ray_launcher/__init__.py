"""orchestrate's Hydra launcher plugin: `hydra/launcher=orchestrate_ray` runs a sweep's jobs as Ray
tasks (the class and its config are in `ray_launcher`)."""
