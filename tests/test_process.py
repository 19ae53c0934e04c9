"""A run leaves the process as it found it: ORTModule's backend sets torch's threads to one and
ORT's options in the environment for its run, and a torch run after it in the same process gets
PyTorch's default threads and an unchanged environment (as `benchmarks/backends.py` assumes)."""

import io
import logging
import os
import signal
import time
import warnings

import pytest
import torch

from orchestrate import app, ort, process, signals


def test_kept_restores_threads_and_environment():
    threads = torch.get_num_threads()
    os.environ["ORCHESTRATE_TEST_CHANGED"] = "before"
    try:
        with process.kept():
            torch.set_num_threads(1 if threads > 1 else 2)
            os.environ["ORCHESTRATE_TEST_ADDED"] = "x"
            os.environ["ORCHESTRATE_TEST_CHANGED"] = "after"
        assert torch.get_num_threads() == threads
        assert "ORCHESTRATE_TEST_ADDED" not in os.environ
        assert os.environ["ORCHESTRATE_TEST_CHANGED"] == "before"
    finally:
        os.environ.pop("ORCHESTRATE_TEST_CHANGED", None)


def test_kept_restores_how_loud_ort_is():
    """`ort.quiet` (what an ORT backend's run does first) changes logging process-wide: Python
    warnings go to logging, console handlers hide ORT's records, ORT's C++ logger is set to the
    level's severity; ORTModule's logger gets a level. All of it is put back when the run ends."""
    console = logging.StreamHandler(io.StringIO())
    root, orttraining = logging.getLogger(), logging.getLogger("orttraining")
    level, showwarning, severity = orttraining.level, warnings.showwarning, ort.default_severity()
    root.addHandler(console)
    try:
        with process.kept():
            ort.quiet("ERROR")
            orttraining.setLevel(logging.WARNING)
            assert any(isinstance(f, ort.HideOrtOutput) for f in console.filters)
            assert warnings.showwarning is not showwarning  # captured into logging
            assert ort.default_severity() == ort.SEVERITIES["ERROR"]
        assert console.filters == []
        assert orttraining.level == level
        assert warnings.showwarning is showwarning
        assert ort.default_severity() == severity
    finally:
        root.removeHandler(console)


class ThreadsSeen:
    """Records torch's thread count when the torch backend's loop starts its first step."""

    def __init__(self):
        self.seen = []

    def __call__(self, original):
        def fit(backend, job):
            self.seen.append((backend.name, torch.get_num_threads(), dict(os.environ)))
            return original(backend, job)

        return fit


@pytest.mark.slow
def test_ortmodule_then_torch_in_one_process(make_cfg, tmp_path, monkeypatch):
    from orchestrate.backends.torch import TorchBackend

    threads, environ = torch.get_num_threads(), dict(os.environ)
    assert threads > 1, "needs a machine with more than one core to tell the thread counts apart"
    app.train(make_cfg("backend=ortmodule", "+backend.options.ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE"),
              tmp_path / "ortmodule")
    assert torch.get_num_threads() == threads
    assert dict(os.environ) == environ  # no ORTMODULE_* option, nothing else left behind

    seen = ThreadsSeen()
    monkeypatch.setattr(TorchBackend, "fit", seen(TorchBackend.fit))
    app.train(make_cfg("backend=torch"), tmp_path / "torch")
    (name, torch_threads, torch_env), = seen.seen
    assert (name, torch_threads) == ("torch", threads)  # PyTorch's default, not ORTModule's one thread
    assert not any(k.startswith("ORTMODULE_") for k in torch_env)


def test_sighup_stops_a_run_as_sigterm_does():
    """A closed terminal or a dropped SSH session: the run is stopped (its MLflow run KILLED, as
    `stop_on_signals`' Stopped ends it), not ended on the spot."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)
    try:
        with pytest.raises(signals.Stopped) as stopped, signals.stop_on_signals():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler raises before this ends
        assert stopped.value.signum == signal.SIGHUP
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL  # given back
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_run_under_nohup_goes_on_ignoring_sighup():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals.stop_on_signals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signals.reinstall_handlers()
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
    finally:
        signal.signal(signal.SIGHUP, previous)
