"""Where the shared traces live and how their files open (read in place, never copied)."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import IO

#: The shared traces folder, beside the project root (``../shared/traces``).
SHARED_TRACES = Path(__file__).resolve().parents[3] / "shared" / "traces"
CLAUDE_CODE_DIR = SHARED_TRACES / "claude-code"
MOONCAKE_DIR = SHARED_TRACES / "mooncake"


class TracesMissing(FileNotFoundError):
    """The shared traces folder (or a named trace file) is not on this machine."""


def open_text(path: Path) -> IO[str]:
    """``path`` opened for reading text, gunzipped when its name ends in ``.gz``."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt")
    return open(path)
