"""The distributed runner: ORT's TrainingRunner::Run loop, data-parallel on Ray Train workers.

    driver.py      the backend: checks, a Ray cluster with room for the workers, Ray Train's trainer
    worker.py      what each worker runs: set up, then the engine's own loop, then report
    collective.py  the workers' data-parallel context: DDP, AllReduce, replica divergence
    report.py      ray.train.report, off the training loop's path
"""
