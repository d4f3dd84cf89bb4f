"""Stopping a run on SIGINT / SIGTERM without ever saving half-updated state.

A signal raises `Interrupted` at once while nothing of the run's state is in flight (rollouts,
evaluation: the learner still holds the last completed step), and is held back inside
`deferred()` blocks (an update that donates the train state, a checkpoint write) until the block
ends. The caller then saves the last completed step and lets `Interrupted` reach the command
line, which exits with the conventional code (130 for SIGINT, 143 for SIGTERM). A second signal
while a stop is under way is noted; a third exits at once, without a checkpoint (a stuck write).
A signal that lands in a finalizer or a gc callback (XLA registers one) raises there, where
Python drops the exception; the stop is then delivered again, to land in the run's own code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A stop asked for by a signal; a KeyboardInterrupt so that no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def exit_code(err: KeyboardInterrupt) -> int:
    """130 for a plain Ctrl-C, 128 + signal for an `Interrupted`."""
    return err.exit_code if isinstance(err, Interrupted) else 128 + signal.SIGINT


class StopSignals:
    """Installs the SIGINT / SIGTERM handlers for the duration of a `with` block (main thread
    only; elsewhere Python delivers no signals and this is a no-op) and restores the old ones."""

    def __init__(self) -> None:
        self._depth = 0  # nesting of deferred() blocks
        self._pending: int | None = None  # a signal held back by deferred()
        self._stopping = False
        self._waiting = 0  # signals that came while a stop was already under way
        self._previous: dict[int, Any] = {}
        self._previous_hook: Any = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                if signal.getsignal(signum) is signal.SIG_IGN:
                    continue  # ignored by whoever started us (a background job): keep it so
                self._previous[signum] = signal.signal(signum, self._handle)
            self._previous_hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        if self._previous_hook is not None:
            sys.unraisablehook, self._previous_hook = self._previous_hook, None
        if exc_type is None and self._pending is not None and not self._stopping:
            raise Interrupted(self._pending)  # held back by hold(): the work is done, stop now

    def hold(self) -> None:
        """Hold signals back until the `with` block ends (the closing writes of a run), or
        until `stop_now` acts on them."""
        self._depth += 1

    @property
    def pending(self) -> int | None:
        """The signal held back so far, if any."""
        return self._pending

    def stop_now(self, signum: int) -> None:
        """Raise `Interrupted(signum)` here: a run of several processes stops at the same step
        on every process, whichever process the signal reached (see MMGRPO.compile)."""
        self._pending, self._stopping = None, True
        raise Interrupted(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self._stopping or self._pending is not None:
            self._waiting += 1
            if self._waiting >= 2:  # the third signal: the user would rather lose the checkpoint
                logger.error("%s a third time: exiting now, without a checkpoint", name)
                os._exit(128 + signum)
            logger.warning("%s again: stopping as soon as it is safe (a third one aborts)", name)
            return
        if self._depth > 0:
            logger.warning("%s: stopping once the running update is complete", name)
            self._pending = signum
            return
        self._stopping = True
        raise Interrupted(signum)

    def _unraisable(self, unraisable: Any) -> None:
        """Python dropped an exception a callback raised; if it was our stop, ask again, from
        a timer thread: the signal then reaches the main thread in ordinary code (or, should it
        land in a callback once more, comes back here)."""
        if not isinstance(unraisable.exc_value, Interrupted) or not self._previous:
            self._previous_hook(unraisable)
            return
        signum = unraisable.exc_value.signum
        name = unraisable.exc_value.signal_name
        logger.warning("%s landed in a callback, which dropped it: delivering it again", name)
        self._stopping = False
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """A block no signal interrupts; one that arrived inside is raised when it ends."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._pending is not None and not self._stopping:
            signum, self._pending = self._pending, None
            self._stopping = True
            raise Interrupted(signum)
