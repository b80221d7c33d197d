"""The command-line contract every recipe shares, exercised through real subprocesses."""
import os
from pathlib import Path

from tests.conftest import run_cli
from unified.cli import _split_argv


def test_demo_answers_the_capital_of_france():
    result = run_cli("recipe=demo", 'prompt="What is the capital of France?"')
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_unknown_key_fails_naming_it():
    result = run_cli("recipe=demo", "promt=hello")
    assert result.returncode != 0
    assert "Key 'promt' not in 'RunConfig'" in result.stderr


def test_wrong_type_fails_naming_the_key():
    result = run_cli("recipe=demo", "port=eighty")
    assert result.returncode != 0
    assert "full_key: port" in result.stderr and "could not be converted to Integer" in result.stderr


def test_unknown_key_in_a_component_group_fails():
    result = run_cli("recipe=demo", "device.nmae=cpu")
    assert result.returncode != 0
    assert "Key 'nmae' not in 'DeviceConfig'" in result.stderr


def test_unknown_recipe_lists_the_recipes():
    result = run_cli("recipe=serve_everything")
    assert result.returncode == 2
    assert "recipe='serve_everything'" in result.stderr and "demo" in result.stderr


def test_unknown_model_is_a_clear_error():
    result = run_cli("recipe=demo", "model=/no/such/checkpoint", "prompt=hi")
    assert result.returncode == 2
    assert "neither a checkpoint folder nor a built-in model" in result.stderr
    assert "Traceback" not in result.stderr


def test_launcher_local_rank_argument_is_ignored():
    assert _split_argv(["--local_rank=3", "recipe=check_parity", "steps=5"]) == ("check_parity", ["steps=5"])
    assert _split_argv(["--local_rank", "1", "prompt=hi"]) == ("demo", ["prompt=hi"])


def test_check_parity_recipe_passes_and_fails_on_threshold(tiny_checkpoint):
    model = tiny_checkpoint("qwen2_moe")
    passed = run_cli("recipe=check_parity", f"model={model}", "device=cpu")
    assert passed.returncode == 0, passed.stderr
    assert "layer 2" in passed.stdout and "logits" in passed.stdout and "PASSED" in passed.stdout
    failed = run_cli("recipe=check_parity", f"model={model}", "device=cpu", "check.max_abs_diff=0.0",
                     "check.min_cosine=1.5")
    assert failed.returncode == 1 and "FAILED" in failed.stdout


def test_run_records_go_to_the_cache_not_the_working_directory(tmp_path):
    result = run_cli("recipe=check_parity", "model=/missing")
    assert result.returncode == 2
    runs = Path(os.environ["UNIFIED_CACHE_DIR"]) / "runs"
    assert any(runs.rglob("overrides.yaml"))
