"""Where the paper's datasets come from: the Hugging Face hub by default, or a local folder.

`data_dir` resolves in this order: the argument (`task.data_dir=` on the command line), the
`MMGRPO_DATA_DIR` environment variable, then the hub (`"hub"` names it explicitly). The hub is
read through `datasets.load_dataset`, cached where `datasets` caches (`$HF_DATASETS_CACHE`), so
a dataset fetched once loads again offline. A local folder holds the JSON Lines copies laid out
as `docs/tasks.md` says (`banking77/train.jsonl`, `pupa/PUPA_New.jsonl`,
`hover/hf_layout/validation.jsonl`, ...). `datasets` is imported here, never on the
sampler/train path.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from mmgrpo_jax.errors import UserError
from mmgrpo_jax.program.example import Example

ENV_VAR = "MMGRPO_DATA_DIR"
HUB = "hub"
LAYOUT_DOC = "docs/tasks.md"
OFFLINE_HINT = (
    f"offline, point task.data_dir=PATH (or ${ENV_VAR}) at a local copy laid out as "
    f"{LAYOUT_DOC} says"
)


class DataUnavailable(UserError):
    """A dataset that cannot be read: no hub, a folder without the file. Says where to get it."""


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
    """A local folder, or HUB; a folder named but absent is an error naming the setting."""
    if data_dir is not None and not str(data_dir).strip():  # Path("") would be the cwd
        raise DataUnavailable(
            f"task.data_dir={str(data_dir)!r} is empty: name a folder, {HUB!r}, or leave it unset"
        )
    chosen = data_dir if data_dir is not None else os.environ.get(ENV_VAR) or None
    if chosen is None or chosen == HUB:  # `MMGRPO_DATA_DIR= cmd`, as shells unset it, too
        return HUB
    path = Path(chosen)
    if not path.is_dir():
        source = "task.data_dir" if data_dir is not None else f"${ENV_VAR}"
        raise DataUnavailable(
            f"{source}={str(chosen)!r} is not a directory (a local copy of the paper's "
            f"datasets, laid out as {LAYOUT_DOC} says; unset it to read the Hugging Face hub)"
        )
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a local JSON Lines file, through `datasets` like the hub path."""
    if not path.is_file():
        raise missing_file(path, "dataset file")
    import datasets

    datasets.disable_progress_bars()  # small local files: a bar per file is noise
    return datasets.load_dataset("json", data_files=str(path), split="train").to_list()


def missing_file(path: Path, what: str) -> DataUnavailable:
    """The error for a file a local copy lacks, saying how the folder should look."""
    return DataUnavailable(
        f"{what} {str(path)!r} does not exist: task.data_dir (or ${ENV_VAR}) must be a folder "
        f"laid out as {LAYOUT_DOC} says, or unset to read the Hugging Face hub"
    )


def load_hub(name: str, split: str, config: str | None = None) -> Any:
    """One split of a hub dataset (a `datasets.Dataset`); a hub that cannot be reached, or a
    dataset it cannot serve, is one `DataUnavailable` line saying how to work offline."""
    import datasets

    where = f"{name}" + (f" ({config})" if config else "") + f" split {split!r}"
    try:
        return datasets.load_dataset(name, config, split=split)
    except (ConnectionError, TimeoutError) as err:  # no network, or the hub refused
        raise DataUnavailable(
            f"the Hugging Face hub cannot be reached for {where} ({_first_line(err)}); "
            f"{OFFLINE_HINT}"
        ) from None
    except (OSError, ValueError, RuntimeError, datasets.exceptions.DatasetsError) as err:
        # not on the hub, an HTTP error, or a repository datasets no longer loads (a script)
        raise DataUnavailable(
            f"the Hugging Face hub cannot serve {where} ({type(err).__name__}: "
            f"{_first_line(err)}); {OFFLINE_HINT}"
        ) from None


def read_hub(name: str, split: str, config: str | None = None) -> list[dict[str, Any]]:
    return load_hub(name, split, config).to_list()


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
