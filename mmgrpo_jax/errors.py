"""The one exception type for problems with what the user asked for.

A `UserError` names the bad value (a setting, a path, a run directory) and how to fix it; the
command line prints its message on one line and exits with code 2. Anything else that escapes is
our bug and keeps its full traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad setting, path or run directory; the message says which and what to do."""


def bad_field(owner: object, field: str, rule: str) -> ValueError:
    """A config field's error: `OptimConfig.lr must be > 0, got 0` (`rule` is "must be > 0")."""
    return ValueError(f"{type(owner).__name__}.{field} {rule}, got {getattr(owner, field)!r}")
