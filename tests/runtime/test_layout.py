"""Parallel layout rules: what divides what, checked before any weight is read, with nearest valid layouts."""
from __future__ import annotations

import pytest

from tests.conftest import run_cli
from unified.checkpoint.hf_config import model_config_from_hf, read_hf_config
from unified.runtime import Layout, LayoutError, check_layout
from unified.runtime.layout import layout_problems, valid_layouts


@pytest.fixture(scope="module")
def configs(tiny_checkpoint):
    # llama: 4 heads, 2 KV heads, 3 layers; deepseek_v3: MLA, 8 experts, 3 layers
    return {f: model_config_from_hf(read_hf_config(tiny_checkpoint(f))) for f in ("llama", "deepseek_v3")}


def test_valid_layouts_pass(configs):
    for layout in (Layout(), Layout(tensor=2), Layout(tensor=4), Layout(pipeline=2), Layout(tensor=2, pipeline=2)):
        check_layout(layout, 4, configs["llama"])
    check_layout(Layout(expert=2), 2, configs["deepseek_v3"])
    check_layout(Layout(tensor=2, expert=2), 4, configs["deepseek_v3"])


@pytest.mark.parametrize("layout,world,family,expected", [
    (Layout(tensor=3), 3, "llama", "tensor parallel 3 does not divide the 4 attention heads"),
    (Layout(tensor=3), 3, "llama", "neither divides the 2 KV heads nor is a multiple of them"),
    (Layout(tensor=2), 3, "llama", "world size 3 is not a multiple of tensor x pipeline = 2 x 1"),
    (Layout(pipeline=4), 4, "llama", "pipeline parallel 4 is more stages than the 3 layers"),
    (Layout(expert=3), 3, "deepseek_v3", "expert parallel 3 does not divide the 8 experts"),
    (Layout(tensor=2, expert=2), 2, "deepseek_v3", "expert parallel 2 does not divide the 1 data-parallel ranks"),
    (Layout(expert=2), 2, "llama", "needs a mixture-of-experts model"),
])
def test_impossible_layouts_say_what_divides_what(configs, layout, world, family, expected):
    with pytest.raises(LayoutError, match="nearest valid layouts") as err:
        check_layout(layout, world, configs[family])
    assert expected in str(err.value)


def test_suggestions_are_valid_and_near(configs):
    with pytest.raises(LayoutError) as err:
        check_layout(Layout(tensor=4, expert=2), 4, configs["deepseek_v3"])
    message = str(err.value)
    assert "[tensor=4 pipeline=1 expert=1]" in message or "[tensor=2 pipeline=1 expert=2]" in message
    for layout in valid_layouts(4, configs["deepseek_v3"]):
        assert not layout_problems(layout, 4, configs["deepseek_v3"])


def test_cli_refuses_an_impossible_layout_before_loading(tiny_checkpoint):
    result = run_cli("recipe=check_parity", f"model={tiny_checkpoint('llama')}", "parallel.tensor=2", timeout=300)
    assert result.returncode == 2
    assert "error: impossible parallel layout [tensor=2 pipeline=1 expert=1] on 1 ranks" in result.stderr
    assert "[tensor=1 pipeline=1 expert=1]" in result.stderr and "Traceback" not in result.stderr
