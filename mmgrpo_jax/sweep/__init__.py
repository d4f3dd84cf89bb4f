"""Sweeps over configs and seeds, and the statistics that say whether a difference is real."""

from mmgrpo_jax.sweep.report import CellRow, RunResult
from mmgrpo_jax.sweep.runner import SweepReport, run_sweep
from mmgrpo_jax.sweep.spec import SweepConfig, load_sweep

__all__ = ["CellRow", "RunResult", "SweepConfig", "SweepReport", "load_sweep", "run_sweep"]
