"""Offline API: `LLM(model).generate(prompts, SamplingParams(...))`, and `chat()` with the chat template.

`LLM.from_run_config(cfg)` builds the same from a recipe's composed config (runtime, model,
tokenizer, engine), which is how the recipes get theirs.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from unified.chat import chat_prompt, content_images
from unified.checkpoint import load_model
from unified.checkpoint.builtin import resolve_model
from unified.checkpoint.mtp import load_mtp_layer
from unified.config.schema import DeviceConfig, EngineConfig, ParallelConfig, SpeculativeConfig
from unified.engine.llm_engine import LLMEngine
from unified.engine.outputs import RequestOutput
from unified.engine.sampling_params import SamplingParams
from unified.errors import UserError
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
    tokenizer = AutoTokenizer.from_pretrained(path)
    draft = None
    if engine.speculative.method == "draft" and engine.speculative.draft_model:
        draft_path = resolve_model(engine.speculative.draft_model, "engine.speculative.draft_model")
        _check_same_tokenizer(draft_path, tokenizer)
        draft = load_model(draft_path, runtime.device, runtime.dtype).model
    elif engine.speculative.method == "mtp":
        draft = load_mtp_layer(path, runtime.device, runtime.dtype)
    if engine.lora_adapter:
        from unified.checkpoint.lora import load_adapter

        load_adapter(loaded.model, engine.lora_adapter)
    processor = None
    if loaded.config.vision is not None:
        from unified.vision import processor_for

        processor = processor_for(path)
    return LLMEngine(loaded.model, tokenizer, engine, runtime.device, runtime.dtype, runtime.accelerator,
                     eos_ids(tokenizer, path), processor, draft_model=draft)


def _check_same_tokenizer(draft: Path, tokenizer) -> None:
    """A draft model proposes token ids, which must mean to it what they mean to the target (`tokenizer`)."""
    from transformers import AutoTokenizer

    try:
        theirs = AutoTokenizer.from_pretrained(draft)
    except (OSError, ValueError, TypeError):
        return  # weights without a tokenizer: the engine compares the vocabulary sizes
    if theirs.get_vocab() != tokenizer.get_vocab():
        raise UserError(f"engine.speculative.draft_model={draft}: its tokenizer is not the target model's; a draft "
                        f"model must share the target's tokenizer, whose token ids it proposes")


def engine_config(options: dict) -> EngineConfig:
    """`LLM`'s engine options (EngineConfig's fields; `speculative` also as a dict of SpeculativeConfig's), checked
    as the command line checks them: an unknown key or a value of the wrong type is a UserError naming it."""
    speculative = options.get("speculative")
    if speculative is not None and not isinstance(speculative, (dict, SpeculativeConfig)):
        raise UserError(f"speculative={speculative!r}: give a dict of engine.speculative's settings, such as "
                        f"{{'method': 'ngram', 'num_tokens': 4}}")
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(EngineConfig), options))
    except OmegaConfBaseException as err:
        key = f"engine option {err.full_key}" if getattr(err, "full_key", None) else "the engine options"
        raise UserError(f"{key}: {str(err).splitlines()[0]}") from err


class LLM:
    def __init__(self, model: str = "smollm2", device: str = "auto", dtype: str = "auto", seed: int = 0,
                 **engine_options):
        self._use(build_engine(model, DeviceConfig(device, dtype), ParallelConfig(), engine_config(engine_options),
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
