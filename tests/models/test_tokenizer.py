import json

import pytest

from models.tokenizer import (
    build_word_tokenizer,
    chat_prompt_ids,
    load_tokenizer,
    stop_token_ids,
    train_bpe_tokenizer,
)

CORPUS = ["The claim names a film, its director and the director's birthplace."] * 20
MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Which film?"},
]
EXPECTED = {
    "chatml": (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nWhich film?<|im_end|>\n"
        "<|im_start|>assistant\n"
    ),
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nAnswer briefly.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhich film?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def saved(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    train_bpe_tokenizer(CORPUS, 320, request.param).save_pretrained(directory)
    return request.param, directory


def test_chat_prompt_renders_the_family_template(saved):
    family, directory = saved
    tokenizer = load_tokenizer(directory)
    ids = chat_prompt_ids(tokenizer, MESSAGES)
    assert tokenizer.decode(ids) == EXPECTED[family]
    specials = [t for t in tokenizer.all_special_tokens if t in EXPECTED[family]]
    for token in {"<|im_start|>", "<|eot_id|>", "<|begin_of_text|>"} & set(specials):
        assert EXPECTED[family].count(token) == ids.count(tokenizer.convert_tokens_to_ids(token))
    if family == "llama3":
        assert ids[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        assert ids.count(ids[0]) == 1  # BOS once: the template's, not a second one from encode


def test_stop_tokens_merge_generation_config(saved):
    family, directory = saved
    tokenizer = load_tokenizer(directory)
    eos = tokenizer.eos_token_id
    assert stop_token_ids(tokenizer, directory) == (eos,)
    extra = tokenizer.convert_tokens_to_ids(
        "<|endoftext|>" if family == "chatml" else "<|end_of_text|>"
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, extra]}))
    assert stop_token_ids(tokenizer, directory) == tuple(sorted({eos, extra}))
    (directory / "generation_config.json").unlink()


def test_missing_directory_and_template_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "none")
    tokenizer = train_bpe_tokenizer(CORPUS, 300)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match="no chat_template"):
        load_tokenizer(tmp_path / "plain")
    with pytest.raises(ValueError, match="template must be one of"):
        train_bpe_tokenizer(CORPUS, 300, "mistral")


WORDS = ["amber", "birch", "left", "right"]
DOOR_CALL = [
    {"role": "system", "content": "Pick one.\n- door (Literal['left', 'right']): the door"},
    {"role": "user", "content": "[[ ## clue ## ]]\namber amberish birch_2 birch"},
]


def test_a_word_tokenizer_reads_unknown_words_as_unk_or_leaves_them_out(tmp_path):
    unk = build_word_tokenizer(WORDS)
    tokens = unk.convert_ids_to_tokens(chat_prompt_ids(unk, DOOR_CALL))
    known = ["left", "right", "<|im_end|>", "amber", "birch", "<|im_end|>"]
    assert [t for t in tokens if t != "[UNK]"] == known
    assert tokens.count("[UNK]") > 20

    drop = build_word_tokenizer(WORDS, unknown="drop")
    tokens = drop.convert_ids_to_tokens(chat_prompt_ids(drop, DOOR_CALL))
    # a known word inside an unknown one (amberish, birch_2) is not read; the markers are kept
    assert tokens == [
        "<|im_start|>",
        "left",
        "right",
        "<|im_end|>",
        "<|im_start|>",
        "amber",
        "birch",
        "<|im_end|>",
        "<|im_start|>",
    ]
    # the same ids mean the same words; a marker is a special token only where words drop
    assert drop.get_vocab() == unk.get_vocab()
    reply = drop.encode("right<|im_start|>", add_special_tokens=False)
    assert drop.decode(reply, skip_special_tokens=True) == "right"
    assert unk.decode(reply, skip_special_tokens=True) == "right <|im_start|>"
    drop.save_pretrained(tmp_path)
    assert chat_prompt_ids(load_tokenizer(tmp_path), DOOR_CALL) == chat_prompt_ids(drop, DOOR_CALL)


def test_a_word_tokenizer_names_a_bad_unknown_mode_and_words_it_cannot_encode():
    with pytest.raises(ValueError, match=r"unknown must be one of .*got 'skip'"):
        build_word_tokenizer(WORDS, unknown="skip")
    with pytest.raises(ValueError, match=r"letters, digits or _ only .*\[\"don't\", 'a-b'\]"):
        build_word_tokenizer(["amber", "don't", "a-b"])
