"""The inference engine: paged KV cache, continuous batching, sampling, and the offline `LLM` API."""
from unified.engine.llm import LLM
from unified.engine.llm_engine import CompletionOutput, LLMEngine, RequestOutput
from unified.engine.sampling_params import InvalidRequest, SamplingParams

__all__ = ["LLM", "CompletionOutput", "InvalidRequest", "LLMEngine", "RequestOutput", "SamplingParams"]
