"""The repository cites only what it holds: every `docs/<page>.md#section` the README, a code
comment, a config or a script names is a page here with that section, and nothing names a design
file outside the repository."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("mmgrpo_jax", "models", "programs", "tests", "experiments", "benchmarks", ".ci")
SUFFIXES = {".py", ".yaml", ".yml", ".toml", ".sh", ".cfg"}
# a page path with an optional section, as code cites the docs: docs/design.md#scale
DOC_REF = re.compile(r"\bdocs/([\w/-]+\.md)(?:#([\w-]+))?")
HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)
EXPLICIT_ID = re.compile(r"\{\s*#([\w-]+)\s*\}$")


def _sources() -> list[Path]:
    files = [p for p in REPO.iterdir() if p.is_file() and p.suffix in SUFFIXES | {"", ".md"}]
    for top in SOURCES:
        files += [p for p in (REPO / top).rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    return [p for p in files if "__pycache__" not in p.parts and p.name != "test_layout.py"]


def section_ids(markdown: str) -> set[str]:
    """The ids mkdocs gives a page's headings: an explicit `{ #id }`, else Python-Markdown's
    slug (punctuation dropped, lower case, runs of spaces and hyphens as one hyphen)."""
    ids = set()
    for heading in HEADING.findall(re.sub(r"```.*?```", "", markdown, flags=re.S)):
        explicit = EXPLICIT_ID.search(heading)
        if explicit:
            ids.add(explicit.group(1))
            continue
        slug = re.sub(r"[^\w\s-]", "", heading).strip().lower()
        ids.add(re.sub(r"[-\s]+", "-", slug))
    return ids


def test_section_ids_follow_mkdocs():
    page = "# Top\n## The paper's programs\n```\n## not a heading\n```\n## Scale { #scale }\n"
    assert section_ids(page) == {"top", "the-papers-programs", "scale"}


def _references() -> list[tuple[str, str, str | None]]:
    found = []
    for path in _sources():
        text = path.read_text(errors="replace")
        for match in DOC_REF.finditer(text):
            found.append((str(path.relative_to(REPO)), match.group(1), match.group(2)))
    return found


def test_the_code_cites_the_design_page():
    cited = {(page, section) for _, page, section in _references()}
    assert ("design.md", "determinism") in cited and ("design.md", "grouping") in cited


@pytest.mark.parametrize(
    "where, page, section", _references(), ids=lambda x: x if isinstance(x, str) else ""
)
def test_every_docs_reference_names_a_page_and_section_here(where, page, section):
    target = REPO / "docs" / page
    assert target.is_file(), f"{where} cites docs/{page}, which the repository does not hold"
    if section is not None:
        ids = section_ids(target.read_text())
        assert section in ids, f"{where} cites docs/{page}#{section}; its sections: {sorted(ids)}"


def test_nothing_cites_a_design_file_outside_the_repository():
    outside = re.compile(r"\.\./shared|DESIGN(?:\.md| section| \d)")
    offenders = [
        f"{path.relative_to(REPO)}:{n}"
        for path in [*_sources(), *REPO.joinpath("docs").rglob("*.md"), REPO / "README.md"]
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if outside.search(line)
    ]
    assert not offenders, f"design references outside the repository: {offenders}"
