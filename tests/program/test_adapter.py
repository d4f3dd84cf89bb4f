from typing import Literal

import pytest

from mmgrpo_jax.program import Field, ParseError, Signature, adapter

ALL_TYPES = Signature(
    inputs=(Field("question", str), Field("context", list[str])),
    outputs=(
        Field("text", str),
        Field("count", int),
        Field("score", float),
        Field("flag", bool),
        Field("items", list[str]),
        Field("label", Literal["refund_request", "card lost", "other"]),
    ),
    instructions="Answer everything.",
)
VALUES = {
    "text": "multi\nline text, with [brackets]",
    "count": -42,
    "score": 0.125,
    "flag": False,
    "items": ["a", "b c", 'quote "d"', "ünï"],
    "label": "card lost",
}


def test_round_trip_every_field_type():
    completion = adapter.format_outputs(ALL_TYPES, VALUES)
    assert adapter.parse(ALL_TYPES, completion) == VALUES


@pytest.mark.parametrize("flag", [True, False])
def test_round_trip_bool_values(flag):
    sig = Signature.parse("q -> flag: bool")
    assert adapter.parse(sig, adapter.format_outputs(sig, {"flag": flag})) == {"flag": flag}


def test_literal_of_ints_round_trips_to_the_choice_object():
    sig = Signature.parse("q -> grade: Literal[1, 2, 3]")
    assert adapter.parse(sig, adapter.format_outputs(sig, {"grade": 2})) == {"grade": 2}


def test_render_layout_system_demos_user():
    demos = [{"question": "q1", "context": ["c"], **VALUES}]
    messages = adapter.render(ALL_TYPES, {"question": "why?", "context": ["x", "y"]}, demos)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Answer everything.")
    assert "- `label` (one of: refund_request, card lost, other)" in system
    assert "- `items` (a JSON list of strings)" in system
    assert (
        messages[-1]["content"] == '[[ ## question ## ]]\nwhy?\n\n[[ ## context ## ]]\n["x", "y"]'
    )
    assert adapter.parse(ALL_TYPES, messages[2]["content"]) == VALUES


def test_render_names_missing_inputs():
    with pytest.raises(ValueError, match=r"missing input fields \['context'\]"):
        adapter.render(ALL_TYPES, {"question": "q"})


def test_parse_ignores_preamble_and_text_after_completed():
    sig = Signature.parse("q -> a: int")
    assert adapter.parse(sig, "Sure!\n[[ ## a ## ]]\n7\n[[ ## completed ## ]]\njunk") == {"a": 7}


@pytest.mark.parametrize(
    ("spec", "completion", "field"),
    [
        ("q -> a", "no headers at all", "a"),
        ("q -> a: int", "[[ ## a ## ]]\nseven", "a"),
        ("q -> a: float", "[[ ## a ## ]]\n1.5.2", "a"),
        ("q -> a: bool", "[[ ## a ## ]]\nmaybe", "a"),
        ("q -> a: list[str]", "[[ ## a ## ]]\n[1, 2]", "a"),
        ("q -> a: list[str]", "[[ ## a ## ]]\nnot json", "a"),
        ("q -> a: Literal['x', 'y']", "[[ ## a ## ]]\nz", "a"),
        ("q -> a, b", "[[ ## a ## ]]\n1", "b"),
        ("q -> a", "[[ ## a ## ]]\n1\n[[ ## a ## ]]\n2", "a"),
    ],
)
def test_bad_completion_raises_parse_error_with_raw_text(spec, completion, field):
    with pytest.raises(ParseError) as info:
        adapter.parse(Signature.parse(spec), completion)
    assert info.value.raw == completion
    assert info.value.field == field
    assert repr(completion) in str(info.value)


def test_bare_mode_round_trips_a_single_field():
    sig = Signature.parse("clue -> start: Literal['amber', 'birch']")
    assert adapter.format_outputs(sig, {"start": "birch"}, bare=True) == "birch"
    assert adapter.parse(sig, " birch\n", bare=True) == {"start": "birch"}
    messages = adapter.render(sig, {"clue": "c"}, [{"clue": "d", "start": "amber"}], bare=True)
    assert "Reply with the value of this field only" in messages[0]["content"]
    assert "[[ ## start ## ]]" not in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content": "amber"}
    with pytest.raises(ParseError) as info:
        adapter.parse(sig, "cedar", bare=True)
    assert info.value.raw == "cedar" and info.value.field == "start"
    with pytest.raises(ValueError, match="exactly one output field"):
        adapter.parse(Signature.parse("q -> a, b"), "x", bare=True)
