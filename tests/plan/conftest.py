from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from unified.config.schema import RunConfig


@pytest.fixture
def run_config():
    """run_config(key=value, ...) -> the typed run config a recipe would get, with those overrides."""
    def make(*overrides: str):
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist(["job=plan", *overrides]))
        return cfg
    return make
