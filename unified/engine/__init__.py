"""The inference engine: paged KV cache, continuous batching, sampling, and the offline `LLM` API."""
from unified.lazy import lazy_exports

_EXPORTS = {"LLM": "unified.engine.llm", "CompletionOutput": "unified.engine.outputs",
            "LLMEngine": "unified.engine.llm_engine", "RequestOutput": "unified.engine.outputs",
            "InvalidRequest": "unified.engine.sampling_params", "SamplingParams": "unified.engine.sampling_params"}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
