"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, and `chat()` with the chat template.

`LLM.from_run_config(cfg)` builds the same from a recipe's composed config (runtime, model,
tokenizer, engine), which is how the recipes get theirs.
"""
from __future__ import annotations

from unified.checkpoint import load_model
from unified.checkpoint.builtin import resolve_model
from unified.config.schema import DeviceConfig, EngineConfig, ParallelConfig
from unified.engine.llm_engine import LLMEngine, RequestOutput
from unified.engine.sampling_params import InvalidRequest, SamplingParams
from unified.runtime import start_runtime


def eos_ids(tokenizer, path) -> set[int]:
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    ids |= set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
    return ids


def build_engine(model: str, device: DeviceConfig, parallel: ParallelConfig, engine: EngineConfig,
                 seed: int = 0, weights_progress=None) -> LLMEngine:
    """`weights_progress(done, total)` follows the weight loading (see `load_model`)."""
    from transformers import AutoTokenizer

    runtime = start_runtime(device, parallel, seed)
    path = resolve_model(model)
    loaded = load_model(path, runtime.device, runtime.dtype, weights_progress)
    if engine.lora_adapter:
        from unified.train.lora import load_adapter

        load_adapter(loaded.model, engine.lora_adapter)
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = None
    if loaded.config.vision is not None:
        from unified.vision import processor_for

        processor = processor_for(path)
    return LLMEngine(loaded.model, tokenizer, engine, runtime.device, runtime.dtype, runtime.accelerator,
                     eos_ids(tokenizer, path), processor)


def chat_prompt(tokenizer, messages: list[dict], image_marker: str | None = None,
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation under the model's chat template. A message's `content` may be a string
    or a list of parts: {"type": "text", "text": ...} and {"type": "image", ...} (whatever carries the
    image), each image written as `image_marker`, the model's text for one image. `tools` (OpenAI function
    definitions) go to the template as its `tools` variable."""
    messages = [{**m, "content": flatten_content(m["content"], image_marker)} for m in messages]
    if not tokenizer.chat_template:
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


IMAGE_PART_TYPES = ("image", "image_url")


def flatten_content(content: str | list[dict], image_marker: str | None) -> str:
    if isinstance(content, str):
        return content
    text = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"])
        elif kind not in IMAGE_PART_TYPES:
            raise InvalidRequest(f'a content part must be {{"type": "text", "text": ...}} or an image part '
                                 f'(type {" or ".join(IMAGE_PART_TYPES)}); got {str(part)[:80]}')
        elif image_marker is None:
            raise InvalidRequest("this model takes no image input; send text parts only")
        else:
            text.append(image_marker)
    return "".join(text)


def content_images(messages: list[dict]) -> list:
    """The images of a conversation's content parts, in order: `image` (a path, bytes, data URL or PIL
    image) or OpenAI's `image_url` ({"url": ...} or the URL itself)."""
    images = []
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part.get("type") == "image":
                image = part.get("image")
            elif part.get("type") == "image_url":
                url = part.get("image_url")
                image = url.get("url") if isinstance(url, dict) else url
            else:
                continue
            if image is None:
                raise InvalidRequest(f'an image part carries no image ({str(part)[:80]}); send {{"type": "image", '
                                     f'"image": <file path or data URL>}} or {{"type": "image_url", "image_url": '
                                     f'{{"url": <data URL>}}}}')
            images.append(image)
    return images


class LLM:
    def __init__(self, model: str = "smollm2", device: str = "auto", dtype: str = "auto", seed: int = 0,
                 **engine_options):
        self._use(build_engine(model, DeviceConfig(device, dtype), ParallelConfig(), EngineConfig(**engine_options),
                               seed))

    @classmethod
    def from_run_config(cls, cfg) -> "LLM":
        """On the driver rank, the engine for the recipe; use it as a context manager so that ranks
        following the driver are released at the end. On every other rank this serves the driver's
        steps until then, and ends the process."""
        engine = build_engine(cfg.model, cfg.device, cfg.parallel, cfg.engine, cfg.seed)
        if not engine.is_driver:
            engine.follow()
            raise SystemExit(0)
        llm = cls.__new__(cls)
        llm._use(engine)
        return llm

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.engine.shutdown()

    def _use(self, engine: LLMEngine) -> None:
        self.engine, self.tokenizer = engine, engine.tokenizer

    def generate(self, prompts: str | dict | list, sampling_params: SamplingParams | list | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: a str, a token-id list, {"prompt": str or ids, "images": [...]}
        (the prompt holds the model's image marker once per image), or a list of these."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        ids = [self.engine.add_request(p["prompt"], sp, images=p.get("images")) if isinstance(p, dict)
               else self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Messages' content may hold image parts (see `chat_prompt`)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        marker = self.engine.image_processor.prompt_marker if self.engine.image_processor else None
        return self.generate([{"prompt": chat_prompt(self.tokenizer, c, marker), "images": content_images(c)}
                              for c in conversations], sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm

        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), disable=not use_tqdm, desc="requests") as bar:
            while self.engine.has_unfinished():
                for output in self.engine.step():
                    done[output.request_id] = output
                    bar.update(1)
        return [done[r] for r in request_ids]
