"""`python -m mmgrpo_jax.cli ...` = `mmgrpo ...` (a source tree that is not installed)."""

from mmgrpo_jax.cli import entry

entry()
