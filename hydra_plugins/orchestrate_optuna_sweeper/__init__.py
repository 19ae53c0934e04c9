"""orchestrate's Hydra sweeper plugin: `hydra/sweeper=orchestrate_optuna` is an asynchronous Optuna
sweeper that prunes losing trials while they run (the class and its config are in `optuna_sweeper`)."""
