"""A sweep's runs end with their sweep: each child asks the kernel for SIGTERM when it dies.

Set in the child itself, after exec (a `preexec_fn` would run Python in a forked copy of a
process whose JAX threads may hold locks): the sweep names its pid in `PARENT_ENV`, the child
calls `die_with_parent()` first thing. SIGTERM makes a training run write its checkpoint.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "MMGRPO_SWEEP_PARENT"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """If started by a sweep: SIGTERM when it dies (Linux), or exit now if it is already gone."""
    parent = os.environ.get(PARENT_ENV)
    if parent is None or not sys.platform.startswith("linux"):
        return
    if ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(parent):  # the sweep died before the request took effect
        sys.exit(143)
