"""mkdocs hooks: what the site shows but the docs folder does not hold, made at build time so it
is never written twice: the CLI reference (from the parser and config classes), the sweeps'
curves, profiles and tables (from experiments/results/)."""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "experiments" / "results"
# a line `[results table: NAME](../experiments/results/NAME/table.md)` (or `diagnostics` for
# diagnostics.md): a link on GitHub, the table itself in the site; images under
# ../experiments/results/ are the site's results/ files
TABLE = re.compile(
    r"^\[results (table|diagnostics): (\S+)\]\(\.\./experiments/results/\2/\1\.md\)$", re.M
)
RESULTS_LINK = "](../experiments/results/"


def on_files(files: Files, config) -> Files:
    from mmgrpo_jax.cli.reference import cli_reference

    files.append(File.generated(config, "cli.md", content=cli_reference()))
    for image in sorted([*RESULTS.glob("*/curves.png"), *RESULTS.glob("*/profiles.png")]):
        uri = f"results/{image.parent.name}/{image.name}"
        files.append(File.generated(config, uri, abs_src_path=str(image)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A results-table line becomes experiments/results/NAME/table.md (or diagnostics.md; its
    title in bold, below the page's headings); links into experiments/results/ point at the
    site's copies."""

    def table(match: re.Match) -> str:
        path = RESULTS / match.group(2) / f"{match.group(1)}.md"
        if not path.is_file():
            raise FileNotFoundError(f"{page.file.src_uri}: no results table {path}")
        return re.sub(r"^# (.*)$", r"**\1**", path.read_text(), flags=re.MULTILINE)

    return TABLE.sub(table, markdown).replace(RESULTS_LINK, "](results/")
