"""The documentation runs: every Python block of the README and of each page under docs/ runs,
in order, as one script per file (mktestdocs), in a fresh folder; the site builds with mkdocs
`--strict` (a broken link, anchor, include or docstring reference fails it); the grouping
picture is drawn from the code. A block that stops working (a renamed API, an undefined name)
fails here."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = sorted(
    p for p in DOCS.rglob("*.md") if "```python" in p.read_text() and "figures" not in p.parts
)


def _run_code_blocks(markdown: Path, cwd: Path) -> None:
    script = f"from mktestdocs import check_md_file; check_md_file({str(markdown)!r}, memory=True)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_readmes_code_blocks_run(tmp_path):
    _run_code_blocks(REPO / "README.md", tmp_path)
    assert (tmp_path / "runs" / "quickstart" / "adapter" / "adapter_config.json").is_file()


# ~60 s, training a program by each optimizer in turn: make test-slow runs it
SLOW_PAGES = {DOCS / "tasks.md"}


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES else p for p in PAGES],
    ids=[str(p.relative_to(DOCS)) for p in PAGES],
)
def test_a_pages_code_blocks_run(page, tmp_path):
    _run_code_blocks(page, tmp_path)


def test_the_pages_with_code_are_the_ones_expected():
    """A page whose blocks stopped being Python (a typo in the fence) would silently drop out."""
    assert {str(p.relative_to(DOCS)) for p in PAGES} >= {
        "quickstart.md",
        "tasks.md",
        "concepts/programs.md",
        "concepts/policies.md",
        "concepts/grouping.md",
        "concepts/losses.md",
        "concepts/training.md",
        "concepts/extending.md",
    }


def test_the_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    site = tmp_path / "site"
    assert "mmgrpo.loss.beta" in (site / "cli" / "index.html").read_text()  # generated page
    results = (site / "results" / "index.html").read_text()
    assert "<!-- results table" not in results and "eval_reward_after mean [95% CI]" in results
    assert "Per run, the mean of each key" in results  # a sweep's diagnostics, inlined too
    assert (site / "results" / "demo_seeds" / "curves.png").is_file()
    assert "policy_loss" in (site / "api" / "rl" / "index.html").read_text()  # from docstrings
    trainer = (site / "api" / "trainer" / "index.html").read_text()
    assert "the peak learning rate, after warmup" in trainer  # a config field's help (setting())


def test_the_grouping_picture_draws(tmp_path):
    out = tmp_path / "grouping.png"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(DOCS / "figures" / "grouping.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert out.stat().st_size > 10_000


def _names(code: str) -> tuple[set[str], set[str]]:
    """(names the block binds: assigned, imported, defined; names it reads that it does not bind
    and that are not builtins)."""
    import ast
    import builtins

    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return bound, read - bound - set(dir(builtins))


def test_the_quickstart_page_continues_the_readmes_quickstart():
    """The README's training block and docs/quickstart.md's bind the same names, so the page's
    evaluation block reads only names either one defines (they had drifted: `config` against
    `config_quick`, `trained` against `program`)."""
    from mktestdocs import grab_code_blocks

    readme, _ = _names(grab_code_blocks((REPO / "README.md").read_text())[0])
    train_block, evaluate_block = grab_code_blocks((DOCS / "quickstart.md").read_text())[:2]
    train, _ = _names(train_block)
    _, needed = _names(evaluate_block)
    assert {"program", "data", "metric"} <= needed
    assert needed <= train, needed - train
    assert needed <= readme, needed - readme
    assert {"data", "metric", "config", "trainer", "program"} <= readme & train
