"""A scripted LM with optional byte-level tokens: program runs without any model."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

from mmgrpo_jax.program.adapter import format_outputs
from mmgrpo_jax.program.lm import LMOutput
from mmgrpo_jax.prompt_opt.proposer import PROPOSE, SUMMARIZE

Messages = Sequence[dict[str, str]]


class ScriptedLM:
    """An LM whose completions come from `respond(messages)`; thread-safe.

    With `token_ids=True` it also returns UTF-8 bytes as token ids (prompt: the message contents
    joined) and a fixed log-prob per token, so traces look like a real policy's.
    """

    def __init__(
        self,
        respond: Callable[[Messages], str],
        *,
        token_ids: bool = False,
        logprob: float = -0.5,
    ) -> None:
        self.respond = respond
        self.token_ids = token_ids
        self.logprob = logprob
        self.calls: list[tuple[tuple[dict[str, str], ...], dict[str, Any]]] = []
        self._lock = threading.Lock()

    @classmethod
    def from_replies(cls, replies: Sequence[str], **kwargs: Any) -> ScriptedLM:
        """Replies handed out in call order; running out is an error, not a silent repeat."""
        queue = list(replies)
        lock = threading.Lock()

        def respond(messages: Messages) -> str:
            with lock:
                if not queue:
                    raise RuntimeError(f"ScriptedLM ran out of its {len(replies)} replies")
                return queue.pop(0)

        return cls(respond, **kwargs)

    def __call__(self, messages: Messages, **sampling: Any) -> LMOutput:
        with self._lock:
            self.calls.append((tuple(dict(m) for m in messages), dict(sampling)))
        text = self.respond(messages)
        if not self.token_ids:
            return LMOutput(text)
        prompt = "\n".join(m["content"] for m in messages).encode()
        completion = tuple(text.encode())
        return LMOutput(
            text,
            prompt_ids=tuple(prompt),
            completion_ids=completion,
            logprobs=(self.logprob,) * len(completion),
        )


def word_prompt_model(words: Sequence[str], seed: int) -> ScriptedLM:
    """A prompt model for prompt optimization without an LM: summaries are a fixed sentence,
    instructions 3-8 of `words` drawn from a generator seeded by the prompt itself, so different
    tips and demo sets give different candidates (and a word policy can read every word)."""

    def respond(messages: Messages) -> str:
        content = messages[-1]["content"]
        if "[[ ## examples ## ]]" in content:
            return format_outputs(SUMMARIZE, {"observations": "Inputs are words; answers too."})
        rng = random.Random(f"{seed}/{content}")
        chosen = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        return format_outputs(PROPOSE, {"proposed_instruction": " ".join(chosen)})

    return ScriptedLM(respond)
