"""The config as a run records it: the key that tells configs apart for trainer.resume."""

from orchestrate.tracking.params import config_key


def test_the_config_key_ignores_tracking_and_resume_settings_only(make_cfg):
    base = make_cfg("backend=torch")
    assert config_key(base) == config_key(make_cfg("backend=torch", "trainer.resume=auto", "tracking.run_name=x"))
    assert config_key(base) != config_key(make_cfg("backend=torch", "optimizer.lr=0.5"))
