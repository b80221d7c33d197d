"""Incremental detokenization for streaming: text deltas that concatenate to the full decode.

Decoding one token at a time breaks multi-byte characters and word-initial spaces, so each delta is the
decode of a short window of recent tokens minus the decode of the window without the new ones; a delta
ending in U+FFFD (an unfinished UTF-8 sequence) waits for the next token. With stop strings, the last
`len(longest stop) - 1` characters are held back, so a stop string is never streamed before the engine
sees it complete.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, holdback: int = 0):
        self.tokenizer = tokenizer
        self.holdback = holdback
        self.tokens: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` already handed out

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        """Adds tokens; returns the text that is now safe to send."""
        self.tokens.extend(token_ids)
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        safe = max(self.sent, len(self.text) - self.holdback)
        delta, self.sent = self.text[self.sent:safe], safe
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of `final_text` (the engine's own decode, cut at any stop string) not yet sent."""
        sent = self.text[:self.sent]
        rest = final_text[len(sent):] if final_text.startswith(sent) else ""
        self.sent += len(rest)
        return rest
