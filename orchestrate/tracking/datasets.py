"""The run's data, the MLflow 3 way: the training and eval splits as the run's inputs, each with a
name, a digest of its contents, its shape and its split, so that the runs table's Dataset column
and MLflow's dataset filters tell runs on different data apart, and the trained model's metrics
name the split they were measured on (orchestrate.tracking.models)."""

import numpy as np

CONTEXT = "mlflow.data.context"  # the input tag MLflow's UI shows as the data set's split


def dataset_inputs(data, name: str) -> list:
    """The data set's splits as MLflow DatasetInputs (none for a data set that holds no arrays)."""
    import mlflow.data
    from mlflow.entities import DatasetInput, InputTag

    found = []
    for split in ("train", "eval"):
        x, y = getattr(data, f"x_{split}", None), getattr(data, f"y_{split}", None)
        if x is None:
            continue
        dataset = mlflow.data.from_numpy(np.asarray(x), targets=np.asarray(y), name=name)
        found.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag(CONTEXT, split)]))
    return found
