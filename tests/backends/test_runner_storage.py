"""orchestrate.backends.runner.storage's rule for the data a cluster's other hosts must have: which
values of a data config name files or folders (checked on every host by tests/backends/
test_runner_hosts.py)."""

from orchestrate.backends.runner.storage import data_paths


def test_the_data_configs_values_that_name_a_file_or_folder_here_are_the_ones_checked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards").mkdir()
    labels = tmp_path / "labels.csv"
    labels.write_text("0\n")
    data = {"_target_": "shards", "folder": "shards", "labels": str(labels), "target": "classes",
            "files": ["missing.py", str(labels)], "split": {"root": "shards", "seed": 0}, "empty": "", "here": "."}
    assert data_paths(data) == {"data.folder": "shards", "data.labels": str(labels), "data.files[1]": str(labels),
                                "data.split.root": "shards"}


def test_a_data_config_that_names_no_file_asks_nothing_of_the_hosts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert data_paths({"_target_": "orchestrate.tasks.data.Digits", "num_features": 64, "loss": "cross_entropy"}) == {}
