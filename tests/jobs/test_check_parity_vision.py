"""`recipe=check_parity` on a vision-language checkpoint also compares image+text input."""
from tests.conftest import run_cli


def test_check_parity_compares_text_and_images(tiny_vl_checkpoint):
    result = run_cli("recipe=check_parity", f"model={tiny_vl_checkpoint('qwen2_5_vl')}", "device=cpu")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "text:\n" in result.stdout and "text + 2 images (" in result.stdout, result.stdout
    assert result.stdout.count("\nlogits ") == 2, result.stdout  # one row per comparison
    assert "PASSED" in result.stdout
