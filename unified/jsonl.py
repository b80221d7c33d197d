"""JSON Lines as users write them."""
from __future__ import annotations


def jsonl_lines(text: str) -> list[str]:
    """The lines of a JSON Lines text: split at newlines only. `str.splitlines` also splits at U+2028, U+2029,
    U+0085 and other separators, which JSON allows unescaped inside strings."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines
