"""The distributed runner: ORT's TrainingRunner::Run loop, data-parallel on Ray Train workers.

    driver.py      the backend: checks, a Ray cluster with room for the workers, Ray Train's trainer
    worker.py      what each worker runs: set up, then the engine's own loop, then report
    collective.py  the workers' data-parallel context: DDP, AllReduce, replica divergence
    pipeline.py    pipeline stages (trainer.pipeline_parallel_size): the schedules, a stage's context and step
    stages.py      where a model can be cut, and its stages as modules of their own
    report.py      ray.train.report, off the training loop's path
"""
