"""Image chat on a tiny LLaVA server: answers equal the offline engine's, several images per message and
across messages, streaming, the conversation log keeps hashes not base64, and every bad image or image
URL gets its 4xx with a message that says what to send, while the server keeps serving. One server start."""
from __future__ import annotations

import base64
import hashlib
import io
import json

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI
from PIL import Image

from tests.serve.conftest import ServerProcess, ready
from unified.config.schema import EngineConfig
from unified.chat import chat_prompt, content_images
from unified.engine.sampling_params import SamplingParams

CHAT = "/v1/chat/completions"
MAX_IMAGES, MAX_IMAGE_BYTES, MAX_BODY_BYTES = 3, 200_000, 65_536


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def picture(seed: int, size=(28, 20)) -> bytes:
    rng = np.random.default_rng(seed)
    return png(Image.fromarray((rng.random((size[1], size[0], 3)) * 255).astype("uint8")))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def ask(*images: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *[image_part(u) for u in images]]}]


@pytest.fixture(scope="module")
def log_path(tmp_path_factory):
    return tmp_path_factory.mktemp("vl-log") / "conversations.jsonl"


@pytest.fixture(scope="module")
def vl_server(tiny_vl_chat_checkpoint, log_path):
    process = ServerProcess(tiny_vl_chat_checkpoint, "engine.num_blocks=256", "serve.max_tokens=32",
                            f"serve.max_images={MAX_IMAGES}", f"serve.max_image_bytes={MAX_IMAGE_BYTES}",
                            f"serve.max_body_bytes={MAX_BODY_BYTES}", f"serve.conversation_log={log_path}",
                            env={"UNIFIED_API_KEY": ""})
    with ready(process):
        yield process


@pytest.fixture(scope="module")
def offline(runtime, tiny_vl_chat_checkpoint):
    """offline(messages, max_tokens) -> (greedy text, prompt tokens) from an engine in this process."""
    from transformers import AutoTokenizer

    from unified.checkpoint import load_model
    from unified.engine.llm_engine import LLMEngine
    from unified.vision import processor_for

    loaded = load_model(tiny_vl_chat_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_chat_checkpoint)
    processor = processor_for(tiny_vl_chat_checkpoint)
    engine = LLMEngine(loaded.model, tokenizer, EngineConfig(num_blocks=256), torch.device("cpu"), torch.float32,
                       None, {tokenizer.eos_token_id}, processor)

    def answer(messages: list[dict], max_tokens: int) -> tuple[str, int]:
        ids = chat_prompt(tokenizer, messages, processor.prompt_marker)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(ids, params, images=content_images(messages))
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
        return outputs[0].outputs[0].text, len(outputs[0].prompt_token_ids)

    return answer


def chat(server, messages: list[dict], max_tokens: int = 8, **extra) -> httpx.Response:
    body = {"model": server.model_name, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    return httpx.post(server.base_url + CHAT, json=body, timeout=60)


def test_image_chat_answers_like_the_offline_engine(vl_server, offline):
    for seed in (0, 1):
        messages = ask(data_url(picture(seed)))
        response = chat(vl_server, messages)
        assert response.status_code == 200, response.text
        text, prompt_tokens = offline(messages, 8)
        assert response.json()["choices"][0]["message"]["content"] == text
        assert response.json()["usage"]["prompt_tokens"] == prompt_tokens  # the image's 16 tokens counted
    first, second = (chat(vl_server, ask(data_url(picture(s)))).json()["choices"][0]["message"]["content"]
                     for s in (0, 1))
    assert first != second, "the answer does not depend on the image"


def test_several_images_in_one_message_and_across_messages(vl_server, offline):
    a, b = data_url(picture(2)), data_url(picture(3, size=(40, 24)))
    answers = []
    for messages in (ask(a, b), ask(b, a)):
        response = chat(vl_server, messages)
        assert response.status_code == 200, response.text
        answers.append(response.json()["choices"][0]["message"]["content"])
        assert answers[-1] == offline(messages, 8)[0]
    assert answers[0] != answers[1], "the images' order is lost"
    across = [*ask(a), {"role": "assistant", "content": "A picture."},
              {"role": "user", "content": [{"type": "text", "text": "And this one?"}, image_part(b, detail="low")]}]
    response = chat(vl_server, across)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == offline(across, 8)[0]


def test_streamed_image_chat_through_the_openai_client(vl_server):
    client = OpenAI(base_url=vl_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    options = dict(model=vl_server.model_name, messages=ask(data_url(picture(4))), max_tokens=12, temperature=0,
                   extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert sum(1 for p in pieces if p) > 1, "the answer arrived in one piece, not streamed"
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_text_chat_on_a_vision_language_server(vl_server, offline):
    messages = [{"role": "user", "content": "Hello there"}]
    response = chat(vl_server, messages)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == offline(messages, 8)[0]


def test_edge_images_are_fine(vl_server):
    for image in (Image.new("RGB", (1, 1), (200, 10, 10)), Image.new("RGB", (64, 64), "white"),
                  Image.new("RGBA", (30, 10), (0, 0, 0, 0))):
        response = chat(vl_server, ask(data_url(png(image))), max_tokens=2)
        assert response.status_code == 200, (image, response.text)


def test_conversation_log_keeps_image_hashes_not_base64(vl_server, log_path):
    file = picture(5, size=(120, 90))
    response = chat(vl_server, ask(data_url(file), text="Describe it."), max_tokens=2)
    assert response.status_code == 200, response.text
    line = next(line for line in log_path.read_text().splitlines() if response.json()["id"] in line)
    assert len(line) < 2000 and "base64" not in line
    content = json.loads(line)["messages"][0]["content"]
    assert content == [{"type": "text", "text": "Describe it."},
                       {"type": "image", "sha256": hashlib.sha256(file).hexdigest(), "bytes": len(file)}]


def _truncated_png() -> bytes:
    whole = picture(6, size=(64, 64))
    return whole[:len(whole) // 2]


def _huge_png() -> bytes:
    return png(Image.new("1", (10_000, 10_000)))  # 100 megapixels, a few kB as a PNG


def _noise_png() -> bytes:
    return picture(7, size=(300, 300))  # ~270 kB: over MAX_IMAGE_BYTES


BAD = [
    # (name, messages, status, words the message must contain)
    ("http URL", lambda: ask("http://169.254.169.254/latest/meta-data/"), 400, "not fetched"),
    ("https URL", lambda: ask("https://example.com/cat.png"), 400, "as a data URL"),
    ("file path", lambda: ask("/etc/hostname"), 400, "must be a data URL"),
    ("file URL", lambda: ask("file:///etc/hostname"), 400, "reads no files"),
    ("image part with a path", lambda: [{"role": "user", "content": [{"type": "image", "image": "/etc/hostname"}]}],
     400, "image_url"),
    ("truncated", lambda: ask(data_url(_truncated_png())), 400, "truncated"),
    ("zero bytes", lambda: ask("data:image/png;base64,"), 400, "empty (0 bytes)"),
    ("not an image", lambda: ask(data_url(b"just some text, no pixels")), 400, "not an image"),
    ("bad base64", lambda: ask("data:image/png;base64,@@@@"), 400, "base64"),
    ("not base64 at all", lambda: ask("data:image/png,rawbytes"), 400, "data:image/png;base64"),
    ("100 megapixels", lambda: ask(data_url(_huge_png())), 400, "100,000,000 pixels"),
    ("second image bad", lambda: ask(data_url(picture(8)), data_url(b"GIF89a")), 400, "messages[0].content[2]"),
    ("too many images", lambda: ask(*[data_url(picture(9))] * (MAX_IMAGES + 1)), 400, "serve.max_images"),
    ("image over its byte limit", lambda: ask(data_url(_noise_png())), 413, "serve.max_image_bytes"),
    ("text over the body limit", lambda: ask(data_url(picture(10)), text="x" * (MAX_BODY_BYTES + 10)), 413,
     "without its images"),
    ("body over the whole limit", lambda: ask(*[data_url(_noise_png())] * 3), 413, "serve.max_images x"),
    ("more markers than images", lambda: ask(data_url(picture(11)), text="<image> and"), 400, "once per image"),
    ("a marker and no image", lambda: [{"role": "user", "content": "look: <image> what"}], 400,
     "no image came with it"),
]


@pytest.mark.parametrize("name,messages,status,words", BAD, ids=[case[0] for case in BAD])
def test_bad_image_is_refused_clearly_and_the_server_keeps_serving(vl_server, name, messages, status, words):
    response = chat(vl_server, messages(), max_tokens=2)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert words in error["message"], error
    assert error["type"] == "invalid_request_error" and "Traceback" not in response.text
    after = chat(vl_server, ask(data_url(picture(0))), max_tokens=2)
    assert after.status_code == 200, after.text
