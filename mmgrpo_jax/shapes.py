"""Shape bucketing shared by every jitted entry point: a run compiles a bounded number of
programs per axis instead of one per size.

Small sizes round up to powers of two; from `granule` on, sizes round up to multiples of it, so
the paper's 48 requests stay 48 (not 64) and a 6,144-token prompt stays 6,144 (not 8,192).
"""

from __future__ import annotations


def bucket(n: int, minimum: int = 1, granule: int | None = None) -> int:
    """The next power of two >= max(n, minimum), or past `granule` the next multiple of it."""
    n = max(n, minimum)
    if granule is not None and n > granule:
        return -(-n // granule) * granule
    return max(minimum, 1 << max(n - 1, 0).bit_length())
