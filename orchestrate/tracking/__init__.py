"""MLflow tracking: everything a training run writes to MLflow, one concern per module.

    run.py          which run a training run logs into (new, resumed, a sweep's trial) and opening
                    it: tags, params, config, system metrics; its end with the outcome
    logger.py       logging into one run by its id through MLflow's client: metrics, tags,
                    artifacts, the data and the model (the runner's rank 0 logs with it too)
    outbox.py       what a run logs reaches MLflow in order, exactly once, through a server outage
    resume.py       trainer.resume: the run and checkpoint to continue; orphaned runs ended
    models.py       the trained model as an MLflow LoggedModel (ONNX flavor), registered if asked
    datasets.py     the training and eval data as the run's inputs
    params.py       the config as MLflow params, and the key that tells configs apart
    environment.py  where a run ran: code version, host, process, package versions
    stores.py       tracking stores: reachable?, a new SQLite store fast, the experiment, the UI
    settings.py     MLflow's client settings set through the environment, and put back
    handover.py     a run handed over by a sweep (MLFLOW_RUN_ID, MLFLOW_TRACKING_URI)

Nothing here sets MLflow's process-wide tracking URI or active run.
"""
