"""The repository cites only what it holds: every `docs/<page>.md#section` the README, a code
comment, a config or a script names is a page here with that section, and nothing names a design
file outside the repository."""

import ast
import re
import subprocess
import sys
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


# The packages from the bottom up, as docs/layout.md lists them: a module imports only from its
# own package and the ones before it (`mmgrpo_jax` is the package root, its first names).
LAYERS = (
    "models",
    "mmgrpo_jax.errors",
    "mmgrpo_jax.config_files",
    "mmgrpo_jax.program",
    "mmgrpo_jax.sampler",
    "mmgrpo_jax.engines",
    "mmgrpo_jax.rl",
    "mmgrpo_jax.parallel",
    "mmgrpo_jax.prompt_opt",
    "mmgrpo_jax.testing",
    "programs",
    "mmgrpo_jax.interop",
    "mmgrpo_jax.trainer",
    "mmgrpo_jax",
    "mmgrpo_jax.commands",
    "mmgrpo_jax.sweep",
    "mmgrpo_jax.cli",
)
PACKAGES = ("mmgrpo_jax", "models", "programs")


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not this project's)."""
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] != "mmgrpo_jax":
        return parts[0]
    return module if len(parts) == 1 else ".".join(parts[:2])


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in a file, in functions and TYPE_CHECKING blocks too;
    `from pkg import name` counts as `pkg.name` where that is a module of this project."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = REPO.joinpath(*node.module.split("."), alias.name)
                is_module = sub.with_suffix(".py").is_file() or sub.is_dir()
                found.append(
                    (node.lineno, f"{node.module}.{alias.name}" if is_module else node.module)
                )
    return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_layer_of_reads_packages_and_the_root():
    assert layer_of("mmgrpo_jax.sampler.generate") == "mmgrpo_jax.sampler"
    assert layer_of("mmgrpo_jax") == "mmgrpo_jax" and layer_of("models.hf") == "models"
    assert layer_of("jax.numpy") is None


def test_no_module_imports_from_a_package_above_it():
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            here = layer_of(_module_name(path))
            assert here in rank, f"{path.relative_to(REPO)}: package {here} is not in LAYERS"
            for line, module in imports_of(path):
                there = layer_of(module)
                if there is not None and rank[there] > rank[here]:
                    upward.append(f"{path.relative_to(REPO)}:{line} ({here}) imports {module}")
    assert not upward, "imports from a package above:\n" + "\n".join(upward)


def test_the_layers_are_the_ones_docs_layout_lists():
    text = (REPO / "docs" / "layout.md").read_text()
    listed = re.search(r"from the bottom up: (.+?)\.\n", text, re.S)
    assert listed, "docs/layout.md names the layers from the bottom up"
    names = [n.strip(" `\n") for n in listed.group(1).replace("\n", " ").split(",")]
    assert tuple(names) == LAYERS


def test_the_engine_protocol_and_the_program_layer_load_no_jax():
    code = (
        "import sys; import mmgrpo_jax.engines.base, mmgrpo_jax.program, mmgrpo_jax.sampler.types;"
        "print(sorted(m for m in ('jax', 'numpy', 'flax') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
