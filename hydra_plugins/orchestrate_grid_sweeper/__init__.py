"""orchestrate's Hydra sweeper plugin: `hydra/sweeper=orchestrate_grid` is Hydra's basic (grid)
sweeper that can leave composing each job to the launcher (the class and its config are in
`grid_sweeper`)."""
