"""The paper's datasets for the tests: a local copy when there is one, else those tests skip.

Tests never download (the hub is switched off for the session in conftest), so the data tests
read a local folder: `$MMGRPO_DATA_DIR`, else a `shared/data` folder beside the checkout or one
of its parents (where the project's CI machines keep the offline copies). conftest exports the
folder found as `$MMGRPO_DATA_DIR`, so the loaders' default and the commands the tests start
read it too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV_VAR = "MMGRPO_DATA_DIR"
_CHECKOUT = Path(__file__).resolve().parents[1]
HOW_TO_GET = (
    f"needs the paper's datasets: set ${ENV_VAR} to a local copy laid out as docs/tasks.md says "
    "(its 'A local copy' section writes one from the hub)"
)


def find_local_data() -> Path | None:
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return Path(chosen)
    for folder in _CHECKOUT.parents:
        if (folder / "shared" / "data").is_dir():
            return folder / "shared" / "data"
    return None


LOCAL_DATA = find_local_data()
needs_paper_data = pytest.mark.skipif(LOCAL_DATA is None, reason=HOW_TO_GET)


def skip_without_paper_data() -> None:
    """For a fixture that needs the data (a test's own checks use `needs_paper_data`)."""
    if LOCAL_DATA is None:
        pytest.skip(HOW_TO_GET)
