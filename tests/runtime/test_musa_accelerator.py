import subprocess
import sys
import types
from pathlib import Path

import deepspeed.accelerator
import pytest
import torch

from unified.runtime.musa_accelerator import MUSA_Accelerator

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_musa(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_musa", types.ModuleType("torch_musa"))
    monkeypatch.setattr(torch, "musa", types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: 2,
        current_device=lambda: 0,
    ), raising=False)


def test_covers_the_whole_deepspeed_interface():
    assert MUSA_Accelerator.__abstractmethods__ == frozenset()


def test_without_torch_musa_construction_explains_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_musa", None)
    with pytest.raises(RuntimeError, match=r"device=musa needs the torch_musa package .*device=cuda or device=cpu"):
        MUSA_Accelerator()


def test_importing_the_module_does_not_import_torch_musa():
    code = "import sys, unified.runtime.musa_accelerator; assert 'torch_musa' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_with_fake_torch_musa_it_reports_the_device_and_installs_into_deepspeed(fake_musa):
    acc = MUSA_Accelerator()
    assert acc.device_name() == "musa"
    assert acc.device_name(1) == "musa:1"
    assert acc.current_device_name() == "musa:0"
    assert acc.communication_backend_name() == "mccl"
    assert acc.is_available()
    assert acc.device_count() == 2
    assert acc.visible_devices_envs() == ["MUSA_VISIBLE_DEVICES"]

    previous = deepspeed.accelerator.get_accelerator()
    try:
        deepspeed.accelerator.set_accelerator(acc)
        assert deepspeed.accelerator.get_accelerator() is acc
    finally:
        deepspeed.accelerator.set_accelerator(previous)
