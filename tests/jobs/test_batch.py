"""`unified recipe=batch`: JSONL in, JSONL out, resumable, bad lines reported and skipped."""
import json

from tests.conftest import run_cli

ENGINE = ("device=cpu", "engine.num_blocks=64")


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_resumes_and_skips_bad_lines(tmp_path, smollm2_checkpoint):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([
        json.dumps({"id": "france", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 12}),
        "{not json",
        json.dumps({"prompt": "One, two, three,", "max_tokens": 4}),
        json.dumps({"id": "bad-option", "prompt": "hi", "beam_width": 3}),
        json.dumps({"id": "two", "prompt": "Colors:", "max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 1}),
    ]) + "\n")
    # A previous run that crashed after one result and in the middle of writing a second.
    target.write_text(json.dumps({"id": "line-3", "text": " four", "finish_reason": "length"}) + "\n{\"id\": \"fra")

    result = run_cli("recipe=batch", f"input={source}", f"output={target}", *ENGINE)
    assert result.returncode == 0, result.stderr
    assert f"{source}:2: skipped: not valid JSON" in result.stderr
    assert f"{source}:4: skipped: unknown sampling option(s) beam_width" in result.stderr
    records = {r["id"]: r for r in _lines(target)}
    assert sorted(records) == ["france", "line-3", "two"]
    assert records["line-3"]["text"] == " four"  # kept from the first run, not redone
    assert "Paris" in records["france"]["text"]
    assert len(records["two"]["outputs"]) == 2 and records["two"]["usage"]["completion_tokens"] == 6

    again = run_cli("recipe=batch", f"input={source}", f"output={target}", *ENGINE)
    assert again.returncode == 0 and "3 already done" in again.stdout
    assert len(_lines(target)) == 3


def test_batch_without_input_says_how_to_call_it():
    result = run_cli("recipe=batch", "device=cpu")
    assert result.returncode == 2 and "input= and output=" in result.stderr
