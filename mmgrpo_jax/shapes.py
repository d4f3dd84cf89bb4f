"""Shape bucketing shared by every jitted entry point: sizes round up to powers of two, so a run
compiles O(log N) programs per axis instead of one per size."""

from __future__ import annotations


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())
