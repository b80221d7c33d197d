"""The folder a job writes a new checkpoint into."""
from __future__ import annotations

from pathlib import Path

from unified.errors import UserError


def check_new_folder(target: Path, source: Path | None = None) -> None:
    """`output=` must be a new or empty folder, and not the checkpoint being read."""
    if not target.exists():
        return
    if not target.is_dir():
        raise UserError(f"output={target} is a file; give a new folder")
    if (source is not None and target.resolve() == source.resolve()) or any(target.iterdir()):
        raise UserError(f"output={target} is the source or not empty; choose a new folder")
