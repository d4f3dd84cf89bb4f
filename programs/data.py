"""Where the paper's datasets come from: a local folder of JSON Lines files, or the HF hub.

`data_dir` resolves in this order: the argument, the `MMGRPO_DATA_DIR` environment variable, then
`shared/data` beside the checkout (`../shared/data`) or beside one of its parent folders. The
literal `"hub"` reads the Hugging Face hub names instead (needs network). `datasets` is imported
here, never on the sampler/train path.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from mmgrpo_jax.program.example import Example

ENV_VAR = "MMGRPO_DATA_DIR"
HUB = "hub"
_CHECKOUT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Splits:
    """Train / dev / test examples of one task; dev is the valset during training."""

    train: list[Example]
    dev: list[Example]
    test: list[Example]

    def get(self, name: str) -> list[Example]:
        if name not in ("train", "dev", "test"):
            raise ValueError(f"split must be 'train', 'dev' or 'test', got {name!r}")
        return getattr(self, name)


def resolve_data_dir(data_dir: str | Path | None = None) -> Path | str:
    """A local folder, or HUB; a folder named but absent is an error naming where it was looked."""
    chosen = data_dir if data_dir is not None else os.environ.get(ENV_VAR)
    if chosen == HUB:
        return HUB
    if chosen is not None:
        path = Path(chosen)
        if not path.is_dir():
            source = "data_dir" if data_dir is not None else f"${ENV_VAR}"
            raise FileNotFoundError(f"{source}={str(chosen)!r} is not a directory")
        return path
    for folder in _CHECKOUT.parents:
        if (folder / "shared" / "data").is_dir():
            return folder / "shared" / "data"
    raise FileNotFoundError(
        f"no dataset folder: pass data_dir=..., set ${ENV_VAR}, or use data_dir='hub' online "
        f"(looked for shared/data beside {_CHECKOUT} and its parents)"
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a local JSON Lines file, through `datasets` like the hub path."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    import datasets

    datasets.disable_progress_bars()  # small local files: a bar per file is noise
    return datasets.load_dataset("json", data_files=str(path), split="train").to_list()


def read_hub(name: str, split: str, config: str | None = None) -> list[dict[str, Any]]:
    import datasets

    return datasets.load_dataset(name, config, split=split).to_list()
