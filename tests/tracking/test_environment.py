"""What a run records of where it ran (orchestrate.tracking.environment)."""

import importlib.metadata
import os
import sys

from orchestrate.tracking import environment


def test_the_installed_packages_are_read_again_only_when_a_folder_on_the_import_path_changed(monkeypatch, tmp_path):
    """A process that runs many trials reads the packages' metadata once; a package installed
    meanwhile (its folder on the import path changed) is listed by the next run."""
    reads = []
    real = importlib.metadata.distributions

    def counted():
        reads.append(1)
        return real()

    monkeypatch.setattr(importlib.metadata, "distributions", counted)
    monkeypatch.setattr(environment, "_LISTED", None)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    first = environment.installed_packages()
    assert "torch==" in first and environment.installed_packages() == first
    assert len(reads) == 1
    (tmp_path / "newpkg-1.0.dist-info").mkdir()  # what pip leaves in a site folder
    (tmp_path / "newpkg-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: newpkg\nVersion: 1.0\n")
    os.utime(tmp_path, ns=(0, os.stat(tmp_path).st_mtime_ns + 1_000_000))  # a clock coarser than the two writes
    assert "newpkg==1.0" in environment.installed_packages()
    assert len(reads) == 2
