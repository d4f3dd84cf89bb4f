import pytest

from models.tokenizer import train_bpe_tokenizer

CORPUS = ["Answer the question with a short word: amber birch cedar dune ember."] * 30


@pytest.fixture(scope="module")
def tokenizer():
    """A small chat BPE: the tiny policies' vocabulary."""
    return train_bpe_tokenizer(CORPUS, 300, "chatml")
