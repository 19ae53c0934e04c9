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

    from orchestrate.thirdparty import mlflow_dataset_entity

    found = []
    for split in ("train", "eval"):
        x, y = getattr(data, f"x_{split}", None), getattr(data, f"y_{split}", None)
        if x is not None:
            dataset = mlflow.data.from_numpy(np.asarray(x), targets=np.asarray(y), name=name)
        elif hasattr(data, "described"):  # a Dataset read from files (MapData): what it is, not its contents
            dataset = described(data.described(split), name)
        else:
            continue
        found.append(DatasetInput(mlflow_dataset_entity(dataset), tags=[InputTag(CONTEXT, split)]))
    return found


def described(facts: dict[str, str], name: str):
    """An MLflow dataset for data that is not arrays in memory: its source is what the data set
    says of itself (class, items, files), its digest a hash of that, so that runs on the same
    files and split show the same Dataset in the runs table."""
    import hashlib

    from mlflow.data.code_dataset_source import CodeDatasetSource
    from mlflow.data.meta_dataset import MetaDataset

    digest = hashlib.sha256(repr(sorted(facts.items())).encode()).hexdigest()[:8]
    return MetaDataset(CodeDatasetSource(tags=facts), name=name, digest=digest)
