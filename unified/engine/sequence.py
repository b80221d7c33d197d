"""One sequence being generated: its tokens, how many of them have K/V in the cache, and its blocks."""
from __future__ import annotations

import enum

import torch

from unified.engine.multimodal import MultimodalPrompt
from unified.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                 seed: int, multimodal: MultimodalPrompt | None = None):
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_prompt_tokens = 0  # of those, found in the prefix cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks already published to the prefix cache
        self.blocks_to_publish: list[bytes] = []  # hashes of the full prompt blocks it computes (see BlockManager)
        self.publishes_blocks = True  # False once the weights changed under its K/V (until recomputed)
        self.finish_reason: str | None = None
        self.logprobs: list = []  # sampler.TokenLogprob per output token, when asked for
        self.prompt_logprobs: list = []  # sampler.TokenLogprob per prompt token after the first, when asked for
        self.seed = seed
        self._generator: torch.Generator | None = None
        self.output_counts: dict[int, int] = {}
        self.multimodal = multimodal  # the prompt's images, if any
        self.draft: list[int] = []  # speculative tokens proposed for its next step (see speculative.py)
        self.proposal: tuple | None = None  # what a drafter keeps between steps for the next draft (mtp.py)

    def generator(self, device: torch.device) -> torch.Generator:
        """This sequence's own random stream, on the device its logits are on (made at its first draw)."""
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device).manual_seed(self.seed)
        return self._generator

    def block_extra(self, start: int, end: int) -> bytes:
        """Content besides token ids that tokens [start, end) depend on (for prefix-cache hashes)."""
        return self.multimodal.block_extra(start, end) if self.multimodal else b""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1

    def reset_for_recompute(self) -> None:
        """After preemption: K/V are gone; prompt and generated tokens are recomputed as one prompt."""
        self.num_computed_tokens = 0
        self.block_table = []
        self.draft = []
        self.proposal = None
        self.publishes_blocks = True
        self.status = Status.WAITING
