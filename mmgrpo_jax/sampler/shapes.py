"""Shape bucketing shared by every jitted entry point: a run compiles a bounded number of
programs per axis instead of one per size.

Small sizes round up to powers of two; from `granule` on, sizes round up to multiples of it, so
the paper's 48 requests stay 48 (not 64) and a 6,144-token prompt stays 6,144 (not 8,192). The
sampler (one slot pool, whether requests arrive together or one by one) and the trainer's rows
read their sizes from here, so both paths compile the same shapes.
"""

from __future__ import annotations

ROW_GRANULE = 8  # rows of a sampler pass: powers of two up to here, then multiples
MIN_TOKEN_BUCKET = 16
TOKEN_GRANULE = 512  # tokens of a pass or a row: powers of two up to here, then multiples
CACHE_GRANULE = 128  # cache slots of a sampler pool: always a multiple of this


def bucket(n: int, minimum: int = 1, granule: int | None = None) -> int:
    """The next power of two >= max(n, minimum), or past `granule` the next multiple of it."""
    n = max(n, minimum)
    if granule is not None and n > granule:
        return -(-n // granule) * granule
    return max(minimum, 1 << max(n - 1, 0).bit_length())


def row_bucket(n: int, multiple: int = 1) -> int:
    """The rows a sampler pass computes for n requests, a multiple of the mesh's batch devices."""
    return -(-bucket(n, 1, ROW_GRANULE) // multiple) * multiple


def token_bucket(n: int) -> int:
    """The padded length of n tokens: a prefill pass's prompts, a decode call's steps, rows."""
    return bucket(n, MIN_TOKEN_BUCKET, TOKEN_GRANULE)


def cache_bucket(n: int) -> int:
    """The slots of a cache that holds n tokens a row."""
    return -(-max(n, 1) // CACHE_GRANULE) * CACHE_GRANULE
