"""GGUF checkpoints (llama.cpp's format) read as if they were HF ones: config, tensors, tokenizer.

A GGUF holds everything a policy needs in one file: the weights (quantized or not), the
architecture as metadata, and the tokenizer as a vocabulary, merges and special-token ids. This
module answers the same questions as a safetensors folder does, under HF's names, so the rest of
`models` does not know which it read:

* tensors: `token_embd.weight` -> `model.embed_tokens.weight`, `blk.3.attn_q.weight` ->
  `model.layers.3.self_attn.q_proj.weight`, ... (`GLOBAL_NAMES`, `LAYER_NAMES`), dequantized
  with ggml's own reader (`gguf.quants.dequantize`: Q4_0/1, Q8_0, K-quants, F16, BF16, F32);
* llama.cpp's converter permutes the rows of q and k so that its RoPE rotates adjacent pairs;
  HF's layout (and ours) rotates halves, so those rows are permuted back (`unpermute_qk`, what
  transformers' GGUF loader does);
* the config from `llama.*` metadata; the tokenizer built with `tokenizers` from
  `tokenizer.ggml.*` (byte-level BPE), with the chat template the file carries.

Nothing here imports torch: the gguf package reads the file with numpy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from models.config import CheckpointError, ModelConfig

# architectures whose tensors and metadata map onto our decoder
SUPPORTED_ARCHITECTURES = ("llama",)

GLOBAL_NAMES = {  # GGUF name -> HF name
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {  # blk.{i}.<GGUF name> -> model.layers.{i}.<HF name>
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")

# llama.cpp's pre-tokenizer names whose split is GPT-2's regex after cutting digits one by one
DIGIT_SPLIT_PRE = ("smollm",)
BYTE_LEVEL_PRE = ("default", "gpt-2", "smollm")
CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token


def hf_name(gguf_name: str) -> str:
    """The HF name of a GGUF tensor; a name with no place in our decoder is refused."""
    layer = _LAYER.fullmatch(gguf_name)
    if layer and layer.group(2) in LAYER_NAMES:
        return f"model.layers.{layer.group(1)}.{LAYER_NAMES[layer.group(2)]}"
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    raise KeyError(gguf_name)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows (2j, 2j+1) go back to
    (j, j + Dh/2), the halves rotate-half RoPE pairs."""
    half = weight.shape[0] // num_heads // 2
    paired = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return paired.swapaxes(1, 2).reshape(weight.shape)


def shortest(value: float) -> float:
    """A float32 from the file as the decimal it was written from (1e-5, not 9.99999975e-06):
    the shortest decimal that rounds to the same float32."""
    return float(str(np.float32(value)))


class GGUFCheckpoint:
    """One .gguf file: its metadata, its tensors under HF names, its config and tokenizer."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # the reader is only needed for GGUF checkpoints

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except (ValueError, OSError, IndexError, KeyError) as err:
            raise CheckpointError(
                f"{str(self.path)!r} is not a readable GGUF file ({type(err).__name__}: "
                f"{' '.join(str(err).split())[:200]}); download it again"
            ) from None
        self.metadata = {name: field for name, field in self.reader.fields.items()}
        self.architecture = self.value("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise CheckpointError(
                f"{str(self.path)!r} holds a {self.architecture!r} model; the GGUF loader "
                f"supports {list(SUPPORTED_ARCHITECTURES)}"
            )
        self.tensors = {}
        for tensor in self.reader.tensors:
            try:
                self.tensors[hf_name(tensor.name)] = tensor
            except KeyError:
                if tensor.name.startswith("rope_freqs"):  # llama.cpp's own rope table
                    continue
                raise CheckpointError(
                    f"{str(self.path)!r}: tensor {tensor.name!r} has no place in a "
                    f"{self.architecture} decoder"
                ) from None
        self._config: ModelConfig | None = None

    def value(self, key: str, default: Any = ...) -> Any:
        field = self.metadata.get(key)
        if field is None:
            if default is ...:
                raise CheckpointError(f"{str(self.path)!r} lacks the metadata field {key!r}")
            return default
        return field.contents()

    def config(self) -> ModelConfig:
        """The decoder's shape from `<arch>.*` metadata, in HF's config.json terms."""
        if self._config is None:
            self._config = ModelConfig.from_hf(self.hf_config())
        return self._config

    def hf_config(self) -> dict[str, Any]:
        arch = self.architecture
        heads = int(self.value(f"{arch}.attention.head_count"))
        hidden = int(self.value(f"{arch}.embedding_length"))
        if self.value(f"{arch}.rope.scaling.type", None) not in (None, "none"):
            raise CheckpointError(
                f"{str(self.path)!r}: RoPE scaling {self.value(f'{arch}.rope.scaling.type')!r} "
                "in a GGUF is not supported"
            )
        return {
            "model_type": arch,
            "vocab_size": len(self.metadata["tokenizer.ggml.tokens"].data)
            if "tokenizer.ggml.tokens" in self.metadata
            else int(self.value(f"{arch}.vocab_size")),
            "hidden_size": hidden,
            "intermediate_size": int(self.value(f"{arch}.feed_forward_length")),
            "num_hidden_layers": int(self.value(f"{arch}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.value(f"{arch}.attention.head_count_kv", heads)),
            "head_dim": int(self.value(f"{arch}.rope.dimension_count", hidden // heads)),
            "rms_norm_eps": shortest(self.value(f"{arch}.attention.layer_norm_rms_epsilon")),
            "rope_theta": shortest(self.value(f"{arch}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "max_position_embeddings": int(self.value(f"{arch}.context_length", 8192)),
            "bos_token_id": self.value("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self.value("tokenizer.ggml.eos_token_id", None),
        }

    def names(self) -> list[str]:
        return list(self.tensors)

    def get(self, key: str) -> np.ndarray:
        """One tensor, dequantized to float32 in HF's [out, in] layout (q and k unpermuted)."""
        import gguf

        if key not in self.tensors:
            raise KeyError(f"tensor {key!r} is not in the GGUF file {str(self.path)!r}")
        tensor = self.tensors[key]
        try:
            value = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise CheckpointError(
                f"{str(self.path)!r}: tensor {tensor.name!r} is of type "
                f"{tensor.tensor_type.name}, which gguf {gguf.__version__} cannot dequantize"
            ) from None
        value = np.asarray(value, np.float32).reshape([int(n) for n in reversed(tensor.shape)])
        cfg = self.config()
        if key.endswith("q_proj.weight"):
            value = unpermute_qk(value, cfg.num_heads)
        elif key.endswith("k_proj.weight"):
            value = unpermute_qk(value, cfg.num_kv_heads)
        return value

    def tokenizer(self) -> transformers.PreTrainedTokenizerFast:
        """The byte-level BPE the file describes, with its special tokens and chat template."""
        kind = self.value("tokenizer.ggml.model")
        pre = self.value("tokenizer.ggml.pre", "default")
        if kind != "gpt2" or pre not in BYTE_LEVEL_PRE:
            raise CheckpointError(
                f"{str(self.path)!r}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not "
                f"supported; supported: gpt2 with {list(BYTE_LEVEL_PRE)}"
            )
        tokens = list(self.value("tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in self.value("tokenizer.ggml.merges", [])]
        kinds = list(self.value("tokenizer.ggml.token_type", [1] * len(tokens)))
        vocab = {token: i for i, token in enumerate(tokens)}
        core = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
        split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre in DIGIT_SPLIT_PRE:
            split.insert(0, pre_tokenizers.Digits(individual_digits=True))
        core.pre_tokenizer = pre_tokenizers.Sequence(split)
        core.decoder = decoders.ByteLevel()
        core.add_special_tokens(
            [
                AddedToken(token, special=True, normalized=False)
                for token, kind in zip(tokens, kinds, strict=True)
                if kind == CONTROL
            ]
        )

        def special(key: str) -> str | None:
            index = self.value(f"tokenizer.ggml.{key}_token_id", None)
            return None if index is None else tokens[int(index)]

        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_object=core,
            bos_token=special("bos"),
            eos_token=special("eos"),
            unk_token=special("unknown"),
            pad_token=special("padding"),
            clean_up_tokenization_spaces=False,
        )
        template = self.value("tokenizer.chat_template", None)
        if template is None:
            raise CheckpointError(
                f"{str(self.path)!r} has no tokenizer.chat_template: use the instruct (chat) "
                "model's GGUF"
            )
        tokenizer.chat_template = template
        return tokenizer


def find_gguf(path: str | Path) -> Path | None:
    """The .gguf a path names: the file itself, or the only one in a folder without safetensors."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or any(path.glob("*.safetensors*")):
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(
            f"{str(path)!r} holds several GGUF files ({[p.name for p in found]}); name one"
        )
    return found[0] if found else None
