from typing import Literal

import pytest

from mmgrpo_jax.program import Field, Signature


def test_parse_types_and_default_instructions():
    sig = Signature.parse(
        "question, docs: list[str], n: int -> label: Literal['a, b', \"c\"], ok: bool, p: float"
    )
    assert sig.input_names == ("question", "docs", "n")
    assert [f.type for f in sig.inputs] == [str, list[str], int]
    assert [f.type for f in sig.outputs] == [Literal["a, b", "c"], bool, float]
    assert "`question`" in sig.instructions and "`label`" in sig.instructions
    assert str(sig) == (
        "question: str, docs: list[str], n: int -> label: Literal['a, b', 'c'], ok: bool, p: float"
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("question answer", "exactly one '->'"),
        ("q -> a -> b", "exactly one '->'"),
        ("q -> a: dict", "unsupported type 'dict'"),
        ("q -> a: list[int]", "unsupported type 'list\\[int\\]'"),
        ("q -> ", "at least one output"),
        ("q -> q", "repeat"),
        ("q -> 1a", "not a Python identifier"),
        ("q -> a: Literal[os.system]", "cannot read Literal choices"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        Signature.parse(spec)


def test_field_rejects_unsupported_python_type():
    with pytest.raises(ValueError, match="field 'x' has unsupported type"):
        Field("x", dict)
