"""An LM of the program layer behind an OpenAI-compatible `/chat/completions` endpoint.

For the roles that are not trained (PAPILLON's untrusted LM and judges, a prompt model). The API
key is read from the environment variable named by `api_key_env` at each call and never logged
or kept in the object's repr.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from mmgrpo_jax.engines.http_json import ServerError, fetch_json
from mmgrpo_jax.program.lm import LMOutput

SAMPLING_KEYS = ("temperature", "top_p", "max_tokens", "max_new_tokens", "stop", "seed")


class OpenAICompatibleLM:
    """`lm(messages, **sampling) -> LMOutput` through a chat-completions server."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key_env: str | None = "OPENAI_API_KEY",
        timeout_s: float = 60.0,
        max_retries: int = 4,
        backoff_s: float = 1.0,
        **defaults: Any,
    ) -> None:
        unknown = sorted(set(defaults) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"unknown sampling arguments {unknown}; allowed: {SAMPLING_KEYS}")
        if timeout_s <= 0 or max_retries < 0:
            raise ValueError(
                f"need timeout_s > 0 and max_retries >= 0, got {timeout_s} and {max_retries}"
            )
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.api_key_env = model, api_key_env
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.defaults = defaults

    def __repr__(self) -> str:
        return f"OpenAICompatibleLM({self.url!r}, model={self.model!r})"

    def _headers(self) -> dict[str, str]:
        if self.api_key_env is None:
            return {}
        key = os.environ.get(self.api_key_env)
        if not key:
            raise RuntimeError(
                f"environment variable {self.api_key_env} (api_key_env) is not set; set it or "
                "pass api_key_env=None for a server without keys"
            )
        return {"Authorization": f"Bearer {key}"}

    def __call__(self, messages: Sequence[dict[str, str]], **sampling: Any) -> LMOutput:
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise TypeError(f"unknown sampling arguments {unknown}; allowed: {SAMPLING_KEYS}")
        settings = {**self.defaults, **sampling}
        if "max_new_tokens" in settings:  # the local EngineLM's name for the same limit
            settings["max_tokens"] = settings.pop("max_new_tokens")
        payload = {"model": self.model, "messages": list(messages), **settings}
        body = fetch_json(
            self.url,
            payload=payload,
            headers=self._headers(),
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            what=f"LM server {self.url}",
        )
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError(f"content is {type(text).__name__}")
        except (KeyError, IndexError, TypeError) as err:
            raise ServerError(
                f"LM server {self.url} sent no choices[0].message.content ({err}): "
                f"{str(body)[:200]}"
            ) from None
        finish = "length" if choice.get("finish_reason") == "length" else "stop"
        return LMOutput(text=text, finish_reason=finish)
