"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, and `chat()` with the chat template.

`LLM.from_run_config(cfg)` builds the same from a recipe's composed config (runtime, model,
tokenizer, engine), which is how the recipes get theirs.
"""
from __future__ import annotations

from unified.chat import chat_prompt, content_images
from unified.checkpoint import load_model
from unified.checkpoint.builtin import resolve_model
from unified.checkpoint.mtp import load_mtp_layer
from unified.config.schema import DeviceConfig, EngineConfig, ParallelConfig, SpeculativeConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.outputs import RequestOutput
from unified.engine.sampling_params import SamplingParams
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
    loaded = load_model(path, runtime.device, runtime.dtype, weights_progress,
                        verify_checksums=engine.verify_checksums)
    draft = None
    if engine.speculative.method == "draft" and engine.speculative.draft_model:
        draft = load_model(resolve_model(engine.speculative.draft_model), runtime.device, runtime.dtype).model
    elif engine.speculative.method == "mtp":
        draft = load_mtp_layer(path, runtime.device, runtime.dtype)
    if engine.lora_adapter:
        from unified.checkpoint.lora import load_adapter

        load_adapter(loaded.model, engine.lora_adapter)
    tokenizer = AutoTokenizer.from_pretrained(path)
    processor = None
    if loaded.config.vision is not None:
        from unified.vision import processor_for

        processor = processor_for(path)
    return LLMEngine(loaded.model, tokenizer, engine, runtime.device, runtime.dtype, runtime.accelerator,
                     eos_ids(tokenizer, path), processor, draft_model=draft)


class LLM:
    def __init__(self, model: str = "smollm2", device: str = "auto", dtype: str = "auto", seed: int = 0,
                 **engine_options):
        if isinstance(engine_options.get("speculative"), dict):  # LLM(..., speculative={"method": "ngram"})
            engine_options["speculative"] = SpeculativeConfig(**engine_options["speculative"])
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
