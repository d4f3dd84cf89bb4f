"""Replies compared as words: the metrics of the real-LM programs read a 135M model's free text
by its lower-case words, so case, punctuation and separators never decide a score."""

from __future__ import annotations

import re
import unicodedata


def words(text: str) -> list[str]:
    """Runs of lower-case ASCII letters and digits; anything else separates them:
    'Card_arrival.' -> ['card', 'arrival']."""
    return re.findall(r"[a-z0-9]+", text.lower())


def phrase(text: str) -> str:
    """The words joined by single spaces, for whole-word containment (f" {a} " in f" {b} ")."""
    return " ".join(words(text))


def ascii_folded(text: str) -> str:
    """Accents off, other non-ASCII letters dropped: 'Bogotá' -> 'Bogota'."""
    return unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
