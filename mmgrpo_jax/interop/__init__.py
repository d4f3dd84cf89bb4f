"""Bridges to other LM-program frameworks, each behind an optional extra.

`mmgrpo_jax.interop.dspy` (``pip install -e '.[dspy]'``) trains an unmodified `dspy.Module`.
Nothing here is imported by the rest of the package: without the extra, dspy is never loaded.
"""
