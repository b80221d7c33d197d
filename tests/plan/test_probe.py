"""The start-up probe: a run that cannot fit stops before any weight is read, with the plan and its fixes."""
from __future__ import annotations

import pytest

from tests.conftest import run_cli
from unified.checkpoint.builtin import resolve_model
from unified.errors import UserError
from unified.plan.probe import probe
from unified.runtime import memory_report


def _corrupt_checkpoint(path, tiny_checkpoint):
    """A tiny model's config.json beside a weights file that cannot be read: loading it fails at once."""
    path.mkdir()
    (path / "config.json").write_text((tiny_checkpoint("llama") / "config.json").read_text())
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    return path


def test_a_layout_that_cannot_fit_stops_before_the_weights_are_read(run_config, tiny_checkpoint, tmp_path):
    model = _corrupt_checkpoint(tmp_path / "model", tiny_checkpoint)
    cfg = run_config("job=serve", f"model={model}", f"engine.kv_cache_bytes={2 ** 50}")
    with pytest.raises(UserError) as refused:
        probe(cfg)
    message = str(refused.value)
    assert "does not fit 1 x cpu" in message and "before reading any weight" in message
    assert "the requested layout" in message and "nearest fixes" in message and "plan.probe=warn" in message


def test_warn_and_off_let_the_run_go_on_and_a_fitting_run_records_its_prediction(run_config, tiny_checkpoint,
                                                                                  tmp_path, caplog):
    model = _corrupt_checkpoint(tmp_path / "model", tiny_checkpoint)
    too_big = f"engine.kv_cache_bytes={2 ** 50}"
    probe(run_config("job=serve", f"model={model}", too_big, "plan.probe=off"))
    with caplog.at_level("WARNING"):
        probe(run_config("job=serve", f"model={model}", too_big, "plan.probe=warn"))
    assert "does not fit" in caplog.text
    probe(run_config("job=batch", f"model={model}", f"engine.kv_cache_bytes={2 ** 20}"))
    expected = memory_report._expected
    assert expected is not None and expected.baseline == pytest.approx(memory_report.resident_bytes(), rel=0.2)
    assert expected.baseline < expected.peak < expected.baseline + 2 ** 30
    with pytest.raises(UserError, match="plan.probe='maybe'"):
        probe(run_config("job=serve", f"model={model}", "plan.probe=maybe"))


def test_a_configuration_only_name_never_reaches_its_missing_weights(run_config):
    with pytest.raises(UserError, match="plan.hardware=h200 plan.cards=") as refused:
        probe(run_config("job=demo", "model=kimi-k2"))
    assert "kimi-k2" in str(refused.value)
    probe(run_config("job=demo", "model=kimi-k2", "plan.probe=warn"))  # then loading stops at the missing weights
    with pytest.raises(UserError, match="configuration without weights"):
        resolve_model("kimi-k2")


def test_the_command_line_exits_2_with_the_plan_and_no_traceback(tmp_path):
    result = run_cli("recipe=batch", "model=deepseek-v3", f"input={tmp_path / 'none.jsonl'}",
                     f"output={tmp_path / 'out.jsonl'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: model=deepseek-v3 does not fit" in result.stderr and "nearest fixes" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_on_a_card_the_reserve_is_what_it_holds_once_the_context_exists(run_config, monkeypatch):
    """The card's properties and free memory stand in for a GPU this machine does not have: the probe picks the
    hardware file by the card's name and measures the reserve on the card rather than taking the file's."""
    from types import SimpleNamespace

    import torch

    from unified.plan.probe import present_hardware

    asked = []
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: asked.append(index) or SimpleNamespace(name="NVIDIA H200", total_memory=150 * 10**9))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: asked.append(index) or (148 * 10**9, 150 * 10**9))
    hardware, name = present_hardware(run_config("device.name=cuda"))
    assert (hardware.name, name, asked) == ("h200", "NVIDIA H200", [3, 3])
    assert hardware.memory_bytes == 150 * 10**9 and hardware.reserve_bytes == 2 * 10**9
