"""The chat adapter: one predictor call <-> chat messages and a completion.

Every field travels under a header line ``[[ ## name ## ]]`` so that parsing is a split on
headers, not a guess. The system message carries the instructions and the field spec, optional
few-shot demos follow as user/assistant turns, and the last user turn carries the inputs. The
completion must hold every output field under its header, in any order; text before the first
header and after ``[[ ## completed ## ]]`` is ignored. String values are stripped of surrounding
whitespace.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from mmgrpo_jax.program.signature import Field, Signature, is_literal, is_str_list, type_name

Message = dict[str, str]
COMPLETED = "completed"
_HEADER = re.compile(r"^\[\[ ## (\w+) ## \]\][ \t]*$", flags=re.MULTILINE)


class ParseError(ValueError):
    """A completion that does not fit the signature; `raw` keeps the exact text for the trace."""

    def __init__(self, message: str, raw: str, field: str | None = None) -> None:
        super().__init__(f"{message}; raw completion: {raw!r}")
        self.raw = raw
        self.field = field


def header(name: str) -> str:
    return f"[[ ## {name} ## ]]"


def format_value(value: Any, annotation: Any) -> str:
    """Render a field value as the text the LM sees (and should write)."""
    if annotation is bool:
        return "true" if value else "false"
    if is_str_list(annotation):
        return json.dumps(list(value), ensure_ascii=False)
    return str(value)


def parse_value(text: str, field: Field) -> Any:
    """Typed value of one field's text; raises ValueError with the reason."""
    text = text.strip()
    annotation = field.type
    if annotation is str:
        return text
    if annotation is int:
        return int(text)
    if annotation is float:
        return float(text)
    if annotation is bool:
        lowered = text.lower()
        if lowered not in ("true", "false"):
            raise ValueError(f"expected true or false, got {text!r}")
        return lowered == "true"
    if is_str_list(annotation):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected a JSON list of strings, got {text!r}")
        return value
    if is_literal(annotation):
        unquoted = text[1:-1] if len(text) >= 2 and text[0] == text[-1] in "'\"" else text
        for choice in typing.get_args(annotation):
            if str(choice) in (text, unquoted):
                return choice
        raise ValueError(f"{text!r} is not one of {list(typing.get_args(annotation))}")
    raise AssertionError(f"unchecked field type {annotation!r} reached the adapter")


def _describe(field: Field) -> str:
    kind = type_name(field.type)
    if is_literal(field.type):
        kind = "one of: " + ", ".join(str(c) for c in typing.get_args(field.type))
    elif is_str_list(field.type):
        kind = "a JSON list of strings"
    elif field.type is bool:
        kind = "true or false"
    line = f"- `{field.name}` ({kind})"
    return f"{line}: {field.desc}" if field.desc else line


def system_message(signature: Signature) -> str:
    lines = [signature.instructions.strip(), "", "Input fields:"]
    lines += [_describe(f) for f in signature.inputs]
    lines += ["", "Output fields:"]
    lines += [_describe(f) for f in signature.outputs]
    lines += [
        "",
        "Write each output field under its header line, in this order, then the end line:",
    ]
    lines += [header(f.name) for f in signature.outputs] + [header(COMPLETED)]
    return "\n".join(lines)


def bare_system_message(signature: Signature) -> str:
    """Bare mode: one output field, and the reply is its value alone (for tiny policies)."""
    lines = [signature.instructions.strip(), "", "Input fields:"]
    lines += [_describe(f) for f in signature.inputs]
    lines += ["", "Reply with the value of this field only:", _describe(signature.outputs[0])]
    return "\n".join(lines)


def check_bare(signature: Signature) -> None:
    if len(signature.outputs) != 1:
        raise ValueError(
            f"bare mode needs exactly one output field; `{signature}` has {len(signature.outputs)}"
        )


def _fields_block(fields: Sequence[Field], values: Mapping[str, Any]) -> str:
    blocks = [
        f"{header(f.name)}\n{format_value(values[f.name], f.type)}"
        for f in fields
        if f.name in values
    ]
    return "\n\n".join(blocks)


def format_outputs(signature: Signature, outputs: Mapping[str, Any], bare: bool = False) -> str:
    """The completion an ideal LM would write for these outputs."""
    if bare:
        check_bare(signature)
        field = signature.outputs[0]
        return format_value(outputs[field.name], field.type)
    return _fields_block(signature.outputs, outputs) + f"\n\n{header(COMPLETED)}"


def render(
    signature: Signature,
    inputs: Mapping[str, Any],
    demos: Sequence[Mapping[str, Any]] = (),
    bare: bool = False,
) -> list[Message]:
    """Chat messages for one call: system spec, demo turns, then the inputs."""
    missing = [name for name in signature.input_names if name not in inputs]
    if missing:
        raise ValueError(f"missing input fields {missing} for signature `{signature}`")
    system = bare_system_message(signature) if bare else system_message(signature)
    messages = [{"role": "system", "content": system}]
    for i, demo in enumerate(demos):
        lacking = [name for name in signature.input_names if name not in demo]
        if lacking:
            raise ValueError(f"demo {i} lacks input fields {lacking}: {dict(demo)!r}")
        messages.append({"role": "user", "content": _fields_block(signature.inputs, demo)})
        messages.append({"role": "assistant", "content": format_outputs(signature, demo, bare)})
    messages.append({"role": "user", "content": _fields_block(signature.inputs, inputs)})
    return messages


def parse(signature: Signature, completion: str, bare: bool = False) -> dict[str, Any]:
    """Typed output fields of a completion, or ParseError naming what is wrong."""
    if bare:
        check_bare(signature)
        field = signature.outputs[0]
        try:
            return {field.name: parse_value(completion, field)}
        except ValueError as err:
            raise ParseError(f"field {field.name!r}: {err}", completion, field.name) from err
    headers = list(_HEADER.finditer(completion))
    sections: dict[str, str] = {}
    for i, match in enumerate(headers):
        name = match.group(1)
        if name == COMPLETED:
            break
        end = headers[i + 1].start() if i + 1 < len(headers) else len(completion)
        if name in sections:
            raise ParseError(f"field {name!r} appears twice", completion, name)
        sections[name] = completion[match.end() : end]
    outputs = {}
    for field in signature.outputs:
        if field.name not in sections:
            raise ParseError(f"missing output field {field.name!r}", completion, field.name)
        try:
            outputs[field.name] = parse_value(sections[field.name], field)
        except ValueError as err:
            raise ParseError(f"field {field.name!r}: {err}", completion, field.name) from err
    return outputs
