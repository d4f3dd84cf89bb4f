"""Tokenizers and chat templates from local files, and small ones built from scratch.

Prompts are rendered by the checkpoint's own chat template to text, then encoded without adding
special tokens again (the template already holds BOS), which is what vLLM and TRL do.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import transformers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from models.config import CheckpointError
from models.gguf import GGUFCheckpoint, find_gguf

# Jinja chat templates of the two families we support, reduced to what the programs use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
    "+ message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
TEMPLATES = {
    "chatml": (
        CHATML_TEMPLATE,
        ("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
        "<|im_end|>",
        None,
    ),
    "llama3": (
        LLAMA3_TEMPLATE,
        (
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|end_of_text|>",
        ),
        "<|eot_id|>",
        "<|begin_of_text|>",
    ),
}

HFTokenizer = transformers.PreTrainedTokenizerBase

# what build_word_tokenizer does with a word it does not know
UNKNOWN_WORDS = ("unk", "drop")

# what AutoTokenizer can build a fast tokenizer from without sentencepiece or tiktoken
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def load_tokenizer(path: str | Path) -> HFTokenizer:
    """The tokenizer of a local checkpoint directory, or of a GGUF file (or a folder holding only
    one); it must carry a chat template."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
    found = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    gguf_file = None if found else find_gguf(path)
    if gguf_file is not None:
        return GGUFCheckpoint(gguf_file).tokenizer()
    if not path.is_dir():
        raise CheckpointError(f"tokenizer path {str(path)!r} is neither a folder nor a .gguf file")
    if not found:
        raise CheckpointError(
            f"no tokenizer in {str(path)!r}: none of {list(TOKENIZER_FILES)} is there (copy the "
            "tokenizer files of the model next to its weights)"
        )
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as err:
        first = " ".join(str(err).split())[:300]
        raise CheckpointError(f"the tokenizer in {str(path)!r} cannot be loaded: {first}") from None
    if not tokenizer.chat_template:
        raise CheckpointError(
            f"the tokenizer in {str(path)!r} has no chat_template: use the instruct (chat) "
            "checkpoint, or add a chat_template.jinja"
        )
    return tokenizer


def chat_prompt_ids(tokenizer: HFTokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of the chat prompt for `messages`, ending where the assistant's reply starts."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer: HFTokenizer, path: str | Path | None = None) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list) when present, plus the tokenizer's EOS."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = Path(path) / "generation_config.json" if path is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if not ids:
        raise ValueError("no stop tokens: the tokenizer has no eos_token and no generation_config")
    return tuple(sorted(ids))


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int, template: str = "chatml"
) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained on `texts`, with the family's special tokens and chat template."""
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    chat_template, specials, eos, bos = TEMPLATES[template]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(texts, trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=eos, bos_token=bos, pad_token=eos
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_word_tokenizer(
    words: Sequence[str], template: str = "chatml", unknown: str = "unk"
) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer that knows only `words`.

    For policies trained from scratch on toy programs: a vocabulary of a handful of content words
    keeps a random policy's replies among the few answers that parse. `unknown` says what becomes
    of every other word and of punctuation: "unk" encodes each as [UNK]; "drop" leaves it out, so
    a prompt reads as its known words between the template's markers (the two-door program's
    bare `door` prompt: 68 tokens, 63 of them [UNK], becomes 8; the input word is no longer one
    token in a sea of identical ones that a from-scratch policy must learn to look past). With
    "drop" the markers are special tokens, so a sampled marker decodes (skipping specials) to
    nothing rather than to its text; either way it is not a reply that parses.
    """
    if template not in TEMPLATES:
        raise ValueError(f"template must be one of {sorted(TEMPLATES)}, got {template!r}")
    if unknown not in UNKNOWN_WORDS:
        raise ValueError(f"unknown must be one of {UNKNOWN_WORDS}, got {unknown!r}")
    chat_template, specials, eos, bos = TEMPLATES[template]
    duplicates = sorted({w for w in words if list(words).count(w) > 1})
    if duplicates or not words:
        raise ValueError(f"words must be distinct and non-empty, got duplicates {duplicates}")
    # the pre-tokenizer cuts text into runs of word characters and runs of punctuation
    unencodable = [w for w in words if not re.fullmatch(r"\w+", w)]
    if unencodable:
        raise ValueError(
            f"words must be letters, digits or _ only (the pre-tokenizer splits at anything "
            f"else), got {unencodable}"
        )
    vocab = {token: i for i, token in enumerate(["[UNK]", *specials, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if unknown == "drop":
        # the markers are matched before normalisation, so they survive it
        core.add_special_tokens(list(specials))
        known = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
        # what the Whitespace pre-tokenizer would cut into a word or a punctuation run, unless
        # it is a known word
        core.normalizer = normalizers.Replace(Regex(rf"\b(?!(?:{known})(?!\w))\w+|[^\w\s]+"), " ")
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with single spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=eos, bos_token=bos, pad_token=eos, unk_token="[UNK]"
    )
    tokenizer.chat_template = chat_template
    return tokenizer
