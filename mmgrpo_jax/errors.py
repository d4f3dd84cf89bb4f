"""The one exception type for problems with what the user asked for.

A `UserError` names the bad value (a setting, a path, a run directory) and how to fix it; the
command line prints its message on one line and exits with code 2. Anything else that escapes is
our bug and keeps its full traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad setting, path or run directory; the message says which and what to do."""
