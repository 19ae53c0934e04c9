"""ORTModule's backend (orchestrate/backends/ortmodule.py): what it refuses before a run opens."""

import pytest
import torch

from orchestrate.backends.ortmodule import check_torch
from orchestrate.schema import ConfigError


@pytest.mark.parametrize("version", ["2.6.0", "2.6.0+cu124", "2.5.1", "2.4.1+cpu"])
def test_torch_up_to_ortmodules_ceiling_is_taken(version):
    check_torch(version)


@pytest.mark.parametrize("version", ["2.7.0", "2.14.1+cu130", "2.15.0", "3.0.0"])
def test_a_newer_torch_is_refused_naming_what_trains_with_it(version):
    """ORT 1.19.2's C++ extensions fail to build above torch 2.6 (2.7: an undefined symbol;
    2.14 on Python 3.12: the build fails), inside the run: refused up front instead."""
    with pytest.raises(ConfigError, match=rf"^backend=ortmodule needs torch 2.6 at most .* this environment has torch "
                                          rf"{version.replace('+', '[+]')}: install torch==2.6.0 .* backend=ondevice"):
        check_torch(version)


def test_this_environments_torch_is_taken():
    check_torch(torch.__version__)  # the tested stack pins torch 2.6.0
