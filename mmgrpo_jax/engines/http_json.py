"""JSON over HTTP with timeouts and retries: what the external LM and retriever clients share.

Retried: timeouts, refused/reset connections, HTTP 429 and 5xx, with exponential backoff. Not
retried: other 4xx (the request is wrong) and a body that is not JSON. Headers are never logged,
so an API key in them cannot reach the logs.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """The server failed (after retries) or sent something unusable."""


def fetch_json(
    url: str,
    *,
    payload: Any = None,
    headers: dict[str, str] | None = None,
    timeout_s: float,
    max_retries: int,
    backoff_s: float = 0.5,
    what: str = "server",
) -> Any:
    """GET (or POST `payload` as JSON) and decode the JSON reply."""
    data = None if payload is None else json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    last: str = ""
    for attempt in range(max_retries + 1):
        if attempt:
            delay = backoff_s * 2 ** (attempt - 1)
            logger.warning("%s: %s; retry %d/%d in %.1fs", what, last, attempt, max_retries, delay)
            time.sleep(delay)
        request = urllib.request.Request(url, data=data, headers=all_headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode(errors="replace")
            if err.code == 429 or err.code >= 500:
                last = f"HTTP {err.code}"
                continue
            raise ServerError(f"{what} answered HTTP {err.code}: {detail}") from None
        except (TimeoutError, OSError) as err:  # URLError, refused and reset connections
            last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
            continue
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ServerError(f"{what} sent a body that is not JSON: {raw[:200]!r}") from None
    raise ServerError(f"{what} failed after {max_retries + 1} attempts; last error: {last}")
