"""MLflow client settings that orchestrate sets through the environment (MLflow reads them there),
each with a way to put them back: a run leaves the process as it found it."""

import os

# One logging thread per run (the outbox's), whatever MLflow's asynchronous logging would start:
# many processes against one server stay within its connection pool. Set for sweep trials and
# runner workers.
ONE_LOGGING_THREAD = {"MLFLOW_ASYNC_LOGGING_THREADPOOL_SIZE": "1"}

# While a run is open, a request to an MLflow server that does not answer gives up within seconds
# (MLflow's defaults: 7 retries with growing pauses and a 120 s timeout, over two minutes): the
# outbox tries again on its own, and nothing else waits minutes. A value the user set is kept.
QUICK_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}

# MLflow prints "View run <name> at: <server URL>" on the console whenever a run on an HTTP store
# ends; the run's summary names it already (and a sweep's own server is gone after the sweep).
NO_RUN_LINKS = {"MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


def set_env(values: dict[str, str | None]) -> dict[str, str | None]:
    """Set environment variables (None: remove one); returns what they were, for set_env again."""
    before = {k: os.environ.get(k) for k in values}
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    return before


def quick_http() -> dict[str, str | None]:
    """QUICK_HTTP and NO_RUN_LINKS where the user set nothing; returns what to give `set_env` back."""
    return set_env({k: v for k, v in {**QUICK_HTTP, **NO_RUN_LINKS}.items() if k not in os.environ})
