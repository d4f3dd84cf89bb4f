"""The LM-program layer: signatures, predictors, modules, the chat adapter and traces.

Knows nothing of JAX: any object with the `LM` protocol drives a program.
"""

from mmgrpo_jax.program import adapter
from mmgrpo_jax.program.adapter import ParseError
from mmgrpo_jax.program.example import Example, Prediction
from mmgrpo_jax.program.lm import LM, LMOutput
from mmgrpo_jax.program.module import ChainOfThought, Module, Predict
from mmgrpo_jax.program.signature import Field, Signature
from mmgrpo_jax.program.trace import CallRecord, Trace, record_trace, using_lm

__all__ = [
    "LM",
    "CallRecord",
    "ChainOfThought",
    "Example",
    "Field",
    "LMOutput",
    "Module",
    "ParseError",
    "Predict",
    "Prediction",
    "Signature",
    "Trace",
    "adapter",
    "record_trace",
    "using_lm",
]
