import pytest

from programs.text import ascii_folded, phrase, words


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("reverted_card_payment?", ["reverted", "card", "payment"]),
        ("Refund_not_showing_up", ["refund", "not", "showing", "up"]),
        ("  Tab\tand\nnewline, 42x ", ["tab", "and", "newline", "42x"]),
        ("—!?", []),
        ("Bogotá", ["bogot"]),  # not folded: a word is ASCII letters and digits only
    ],
)
def test_words_are_lower_case_runs_of_ascii_letters_and_digits(text, expected):
    assert words(text) == expected
    assert phrase(text) == " ".join(expected)


def test_folding_keeps_the_letter_under_an_accent():
    assert ascii_folded("Bogotá, Reykjavík, Asunción") == "Bogota, Reykjavik, Asuncion"
    assert phrase(ascii_folded("São Tomé.")) == "sao tome"
    assert ascii_folded("東京") == ""
