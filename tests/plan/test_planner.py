"""The planner end to end: the 3T plan in under a minute, refusals with fixes that work, plan.json, hardware."""
from __future__ import annotations

import json
import time

import pytest
from omegaconf import OmegaConf

from tests.conftest import run_cli
from unified.errors import UserError
from unified.plan import load_hardware, plan_for
from unified.plan.hardware import HARDWARE_DIR, hardware_names, measure_host_reserve
from unified.plan.training import training_state_bytes


def test_the_3t_plan_runs_in_under_a_minute_and_fits_64_h200_at_a_million_tokens(run_config):
    start = time.perf_counter()
    plan = plan_for(run_config("model=unified-3t-vl", "plan.hardware=h200", "plan.cards=64", "plan.context=1048576"))
    assert time.perf_counter() - start < 60
    assert plan.fits and not plan.requested.fits  # one card's worth of layout cannot hold 3T; others can
    best = plan.feasible[0]
    assert best.layout.tensor * best.layout.pipeline * best.layout.expert == 64
    assert best.sequences >= 1 and best.peak <= best.budget
    assert set(best.breakdown) >= {"reserve", "weights", "activations", "kv_cache"}
    assert plan.fixes and plan.fixes[0] == best.overrides


def test_a_fix_the_planner_suggests_fits_when_applied(run_config):
    cfg = run_config("engine.kv_cache_bytes=100000000", "plan.context=8192")
    plan = plan_for(cfg)
    assert not plan.requested.fits and plan.fixes
    for fix in plan.fixes:
        assert plan_for(OmegaConf.merge(cfg, OmegaConf.from_dotlist(fix.split()))).requested.fits, fix


def test_training_refusal_suggests_memory_savers_that_fit(run_config):
    from dataclasses import replace

    small = replace(load_hardware("h100"), name="small", memory_bytes=6 * 2 ** 30)
    cfg = run_config("plan.mode=train", "plan.cards=2")
    plan = plan_for(cfg, small)
    assert not plan.fits and "train.activation_checkpointing=true" in plan.fixes
    for fix in plan.fixes:
        assert plan_for(OmegaConf.merge(cfg, OmegaConf.from_dotlist(fix.split())), small).requested.fits, fix


def test_a_card_count_only_data_parallel_uses_fits_and_silly_values_are_refused(run_config, tiny_checkpoint):
    """On 3 cards the tiny DeepSeek-V3's 8 experts, 4 heads and 2 layers split no further: replicas serve."""
    plan = plan_for(run_config(f"model={tiny_checkpoint('deepseek_v3')}", "plan.hardware=h200", "plan.cards=3"))
    assert plan.requested.fits and plan.fits and not plan.fixes
    assert any(p.layout == plan.requested.layout for p in plan.feasible)
    for override, message in (("plan.context=-5", "plan.context=-5: give a positive"),
                              ("plan.context=0", "plan.context=0: give a positive"),
                              ("plan.cards=1000000000000", "plan for 1 to 16384 cards")):
        with pytest.raises(UserError, match=message):
            plan_for(run_config(override))


def test_a_kv_budget_too_small_for_one_sequence_gets_the_budget_that_holds_one(run_config):
    cfg = run_config("engine.kv_cache_bytes=1000", "plan.context=2048")
    plan = plan_for(cfg)
    assert not plan.fits and plan.requested.short == 0
    fix = next(f for f in plan.fixes if f.startswith("engine.kv_cache_bytes="))
    fixed = plan_for(OmegaConf.merge(cfg, OmegaConf.from_dotlist([fix]))).requested
    assert fixed.fits and fixed.sequences == 1
    impossible = plan_for(run_config("engine.kv_cache_bytes=1000", "plan.cards=2", "parallel.tensor=2"))
    assert impossible.requested.problems and not any(f.startswith("engine.") for f in impossible.fixes)


def test_the_fewest_cards_need_not_be_a_doubling(run_config):
    plan = plan_for(run_config("model=deepseek-v3", "plan.hardware=h100", "plan.cards=8", "plan.context=4096"))
    more = next(f for f in plan.fixes if f.startswith("plan.cards="))
    cards = int(more.split()[0].removeprefix("plan.cards="))
    assert cards % 8 == 0 and cards & (cards - 1)  # whole nodes, not a power of two
    assert not plan_for(run_config("model=deepseek-v3", "plan.hardware=h100", f"plan.cards={cards - 8}",
                                   "plan.context=4096")).fits


def test_zero_stages_divide_what_they_partition():
    args = dict(params=1000, trainable=1000, largest_unit=100, dtype_bytes=2, dp=4, offload_optimizer=False,
                offload_params=False)
    always, _, step, _ = training_state_bytes(stage=0, **{**args, "dtype_bytes": 4})
    assert always["parameters"] + step["gradients"] + always["optimizer"] == 16 * 1000  # 4 + 4 + AdamW's 8
    always, _, step, _ = training_state_bytes(stage=1, **args)
    assert always["parameters"] == step["gradients"] == 2000 and always["optimizer"] == 16 * 1000 // 4
    always, backward, _, _ = training_state_bytes(stage=3, **args)
    assert always["parameters"] == 500 and always["gradients"] == 4 * 1000 // 4  # float32 gradient partitions
    assert backward["zero3_gathered"] == 2000  # a small model stays gathered from forward to backward
    device, _, _, host = training_state_bytes(stage=3, **{**args, "offload_optimizer": True, "offload_params": True})
    assert "optimizer" not in device and "parameters" not in device and host["optimizer"] == always["optimizer"]


def test_a_model_that_cannot_fit_exits_2_with_fixes_and_writes_plan_json(tmp_path):
    result = run_cli("recipe=plan", "model=deepseek-v3", "plan.hardware=h100", "plan.cards=8",
                     "plan.context=4096", f"output={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert "no layout fits on 8 x h100" in result.stdout and "\n  plan.cards=" in result.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["fits"] is False and plan["fixes"] and plan["requested"]["short_bytes"] > 0
    assert all(row["built"] == row["planned"] for row in plan["meta_build"])


def test_hardware_files_load_and_cpu_is_read_from_this_machine(tmp_path):
    assert set(hardware_names()) >= {"h100", "h200", "mtt-s4000", "mtt-s5000", "cpu"}
    for name in hardware_names():
        hw = load_hardware(name)
        assert hw.memory_bytes > 0 and hw.bandwidth_bytes_s > 0
    cpu = load_hardware("cpu")
    assert cpu.cores and cpu.memory_bytes
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nkind: gpu\nmemory_bytes: lots\n")
    with pytest.raises(UserError, match="memory_bytes"):
        load_hardware(str(bad))
    with pytest.raises(UserError, match="h100"):
        load_hardware("no-such-card")
    bad.write_text((HARDWARE_DIR / "h100.yaml").read_text().replace("cards_per_node: 8", "cards_per_node: 0"))
    with pytest.raises(UserError, match="cards_per_node=0; give a positive number"):
        load_hardware(str(bad))


def test_the_host_reserve_is_measured_on_this_machine():
    """A fresh process that imported torch and our engine: more than torch alone, and the same twice."""
    reserve = load_hardware("cpu").reserve_bytes
    assert 200 * 2 ** 20 < reserve < 2 ** 31
    assert measure_host_reserve() == pytest.approx(reserve, rel=0.1)
