"""Sweeps over configs and seeds, and the statistics that say whether a difference is real.

Names load on first use: a sweep's child runs import `sweep.child` before anything heavy.
"""

import importlib
from typing import Any

_EXPORTS = {
    "CellRow": "report",
    "RunResult": "report",
    "SweepReport": "runner",
    "run_sweep": "runner",
    "SweepConfig": "spec",
    "load_sweep": "spec",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
