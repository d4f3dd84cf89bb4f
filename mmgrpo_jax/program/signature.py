"""Signatures: the typed input/output contract of one LM module.

A signature is written like DSPy's, ``"question, context: list[str] -> answer: int"``, or built
from `Field` objects. Supported field types: str, int, float, bool, list[str] and
``Literal[...]`` choices. Parsing the string never evaluates code: types are matched by name and
Literal choices are read with `ast.literal_eval`.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from typing import Any, Literal

SUPPORTED_TYPES = "str, int, float, bool, list[str], Literal[...]"
_SCALAR_TYPES = {"str": str, "int": int, "float": float, "bool": bool}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_literal(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Literal


def is_str_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list and typing.get_args(annotation) == (str,)


def type_name(annotation: Any) -> str:
    if is_literal(annotation):
        return "Literal[" + ", ".join(repr(c) for c in typing.get_args(annotation)) + "]"
    if is_str_list(annotation):
        return "list[str]"
    return annotation.__name__


def _check_type(annotation: Any, field: str) -> None:
    if annotation in _SCALAR_TYPES.values() or is_str_list(annotation):
        return
    if is_literal(annotation):
        if not typing.get_args(annotation):
            raise ValueError(f"field {field!r}: Literal needs at least one choice")
        return
    raise ValueError(
        f"field {field!r} has unsupported type {annotation!r}; supported: {SUPPORTED_TYPES}"
    )


@dataclasses.dataclass(frozen=True)
class Field:
    """One named, typed slot of a signature; `desc` is shown to the LM in the field spec."""

    name: str
    type: Any = str
    desc: str = ""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"field name {self.name!r} is not a Python identifier")
        _check_type(self.type, self.name)


def _parse_type(text: str, field: str) -> Any:
    text = text.strip()
    if text in _SCALAR_TYPES:
        return _SCALAR_TYPES[text]
    if text.replace(" ", "") in ("list[str]", "List[str]"):
        return list[str]
    match = re.fullmatch(r"Literal\[(.*)\]", text, flags=re.DOTALL)
    if match:
        try:
            choices = ast.literal_eval("(" + match.group(1) + ",)")
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"field {field!r}: cannot read Literal choices {text!r}") from err
        return Literal[tuple(choices)]
    raise ValueError(f"field {field!r} has unsupported type {text!r}; supported: {SUPPORTED_TYPES}")


def _split_fields(text: str) -> list[str]:
    """Split on commas that are not inside brackets (Literal choices contain commas)."""
    parts, depth, current, quote = [], 0, [], None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


def _parse_fields(text: str) -> tuple[Field, ...]:
    fields = []
    for part in _split_fields(text):
        name, _, annotation = part.partition(":")
        name = name.strip()
        fields.append(Field(name, _parse_type(annotation, name) if annotation else str))
    return tuple(fields)


@dataclasses.dataclass(frozen=True)
class Signature:
    """Inputs, outputs and the instructions that tell the LM what to do with them."""

    inputs: tuple[Field, ...]
    outputs: tuple[Field, ...]
    instructions: str = ""

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError("a signature needs at least one output field")
        names = [f.name for f in self.inputs + self.outputs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"field names repeat across inputs and outputs: {repeated}")

    @classmethod
    def parse(cls, spec: str, instructions: str = "") -> Signature:
        """Build from ``"in1, in2: type -> out: type"``; types default to str."""
        if spec.count("->") != 1:
            raise ValueError(f"signature {spec!r} must contain exactly one '->'")
        left, right = spec.split("->")
        inputs, outputs = _parse_fields(left), _parse_fields(right)
        if not instructions:
            instructions = (
                f"Given the fields {_names(inputs)}, produce the fields {_names(outputs)}."
            )
        return cls(inputs, outputs, instructions)

    def with_instructions(self, instructions: str) -> Signature:
        return dataclasses.replace(self, instructions=instructions)

    def prepend_output(self, field: Field) -> Signature:
        return dataclasses.replace(self, outputs=(field, *self.outputs))

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.outputs)

    def __str__(self) -> str:
        def spec(fields: tuple[Field, ...]) -> str:
            return ", ".join(f"{f.name}: {type_name(f.type)}" for f in fields)

        return f"{spec(self.inputs)} -> {spec(self.outputs)}"


def _names(fields: tuple[Field, ...]) -> str:
    return ", ".join(f"`{f.name}`" for f in fields)


def ensure_signature(signature: str | Signature) -> Signature:
    if isinstance(signature, Signature):
        return signature
    if isinstance(signature, str):
        return Signature.parse(signature)
    raise TypeError(f"expected a Signature or a 'inputs -> outputs' string, got {signature!r}")
