"""`unified recipe=batch`: JSONL in, JSONL out, resumable, bad lines reported and skipped."""
import json

from tests.conftest import run_cli

ENGINE = ("device=cpu", "engine.num_blocks=64")


def _lines(path):
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_batch_resumes_and_skips_bad_lines(tmp_path, smollm2_checkpoint):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join([
        json.dumps({"id": "france", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 12}),
        "{not json",
        json.dumps({"prompt": "One, two, three,", "max_tokens": 4}),
        json.dumps({"id": "bad-option", "prompt": "hi", "beam_width": 3}),
        json.dumps({"id": "two", "prompt": "Colors:", "max_tokens": 3, "n": 2, "temperature": 0.8, "seed": 1}),
        json.dumps({"id": "role", "messages": [{"role": 5, "content": "x"}]}),  # the chat template raises
        json.dumps({"id": "bools", "prompt": [True, False]}),
        json.dumps({"id": "separator", "prompt": "one\u2028two\u0085three", "max_tokens": 2}, ensure_ascii=False),
        "oops",
    ]) + "\n")
    # A previous run that crashed after one result and in the middle of writing a second.
    target.write_text(json.dumps({"id": "line-3", "text": " four", "finish_reason": "length"}) + "\n{\"id\": \"fra")

    result = run_cli("recipe=batch", f"input={source}", f"output={target}", *ENGINE)
    assert result.returncode == 0, result.stderr
    assert f"{source}:2: skipped: not valid JSON" in result.stderr
    assert f"{source}:4: skipped: unknown sampling option(s) beam_width" in result.stderr
    assert f"{source}:6: skipped: the model's chat template rejected these messages" in result.stderr
    assert f"{source}:7: skipped: a line needs 'messages'" in result.stderr
    assert f"{source}:9: skipped: not valid JSON" in result.stderr  # U+2028 and U+0085 inside line 8 split nothing
    records = {r["id"]: r for r in _lines(target)}
    assert sorted(records) == ["france", "line-3", "separator", "two"]
    assert records["line-3"]["text"] == " four"  # kept from the first run, not redone
    assert "Paris" in records["france"]["text"]
    assert len(records["two"]["outputs"]) == 2 and records["two"]["usage"]["completion_tokens"] == 6

    again = run_cli("recipe=batch", f"input={source}", f"output={target}", *ENGINE)
    assert again.returncode == 0 and "4 already done" in again.stdout
    assert len(_lines(target)) == 4


def test_batch_without_input_says_how_to_call_it(tmp_path):
    result = run_cli("recipe=batch", "device=cpu")
    assert result.returncode == 2 and "input= and output=" in result.stderr
    (tmp_path / "in.jsonl").write_text("{}\n")
    result = run_cli("recipe=batch", "device=cpu", f"input={tmp_path / 'in.jsonl'}", f"output={tmp_path}")
    assert result.returncode == 2 and f"output={tmp_path} is a folder" in result.stderr
    result = run_cli("recipe=batch", "device=cpu", f"input={tmp_path}", f"output={tmp_path / 'out.jsonl'}")
    assert result.returncode == 2 and f"input={tmp_path} is a folder" in result.stderr


def test_batch_with_images(tmp_path, tiny_vl_chat_checkpoint):
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray((rng.random((20, 28, 3)) * 255).astype("uint8")).save(buffer, format="PNG")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "noise.png").write_bytes(buffer.getvalue())
    (tmp_path / "images" / "cut.png").write_bytes(buffer.getvalue()[:200])
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def ask(image_part: dict) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part]}]

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(json.dumps({**line, "max_tokens": 6, "ignore_eos": True}) for line in [
        {"id": "path", "messages": ask({"type": "image", "image": "images/noise.png"})},
        {"id": "cut", "messages": ask({"type": "image", "image": "images/cut.png"})},
        {"id": "text", "messages": [{"role": "user", "content": "Hello there"}]},
        {"id": "data-url", "messages": ask({"type": "image_url", "image_url": {"url": url}})},
        {"id": "remote", "messages": ask({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}})},
        {"id": "missing", "messages": ask({"type": "image", "image": "images/none.png"})},
    ]) + "\n")

    result = run_cli("recipe=batch", f"model={tiny_vl_chat_checkpoint}", f"input={source}", f"output={target}",
                     *ENGINE)
    assert result.returncode == 0, result.stderr
    assert f"{source}:2: skipped: the file '{tmp_path / 'images' / 'cut.png'}' is truncated" in result.stderr
    assert f"{source}:5: skipped: image URLs are not fetched" in result.stderr
    assert f"{source}:6: skipped: no image file at" in result.stderr
    records = {r["id"]: r for r in _lines(target)}
    assert sorted(records) == ["data-url", "path", "text"]
    assert records["path"]["text"] == records["data-url"]["text"]  # the same image, as a file or a data URL
    assert records["path"]["usage"]["prompt_tokens"] > records["text"]["usage"]["prompt_tokens"]
    assert "3 skipped for errors" in result.stdout


def test_batch_resume_ends_a_last_line_that_lost_only_its_newline(tmp_path, tiny_chat_checkpoint):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": "Hi", "max_tokens": 2}) + "\n" for i in "abc"))
    # A previous run that crashed after two results, the second written but for its newline.
    target.write_text("".join(json.dumps({"id": i, "text": " kept", "finish_reason": "length"}) + "\n" for i in "ab")
                      .removesuffix("\n"))
    result = run_cli("recipe=batch", f"model={tiny_chat_checkpoint}", f"input={source}", f"output={target}", *ENGINE)
    assert result.returncode == 0, result.stderr
    assert "2 already done" in result.stdout
    records = _lines(target)
    assert [r["id"] for r in records] == ["a", "b", "c"]
    assert records[1]["text"] == " kept"


def test_batch_resume_keeps_results_after_a_line_that_is_not_a_record(tmp_path, tiny_chat_checkpoint):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"id": i, "prompt": "Hi", "max_tokens": 2}) + "\n" for i in "abc"))
    a, b = (json.dumps({"id": i, "text": " kept", "finish_reason": "length"}) for i in "ab")
    before = f"{a}{b}\n{b}\n"  # two records on one line, as an earlier version could leave: no crash tears a line there
    target.write_text(before)
    result = run_cli("recipe=batch", f"model={tiny_chat_checkpoint}", f"input={source}", f"output={target}", *ENGINE)
    assert result.returncode == 2 and f"error: {target}:1 is not a result line" in result.stderr, result.stderr
    assert target.read_text() == before
