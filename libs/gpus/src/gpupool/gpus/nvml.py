"""The seam to ``pynvml``: loaded lazily, so that a stand-in module can be passed instead."""

from __future__ import annotations

from typing import Any

MIB = 1024 * 1024


def load_pynvml() -> Any:
    """The real ``pynvml`` module (importing it needs no driver; ``nvmlInit`` does)."""
    import pynvml

    return pynvml


def nvml_text(value: str | bytes) -> str:
    """pynvml returns bytes from some versions and str from others."""
    return value.decode() if isinstance(value, bytes) else value
