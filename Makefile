VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: install test test-gpu lint demo study docs docs-serve clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The suite on PYTEST_WORKERS pytest-xdist workers (CI's 2 cores: 2; each worker on its share of the threads, see
# tests/conftest.py), idle workers taking tests from busy ones; the 15 slowest tests are printed at the end.
# One file serially: $(PY) -m pytest -p no:xdist tests/test_x.py (docs/development.md).
PYTEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=15

# The GPU checks (tests marked gpu; they skip without CUDA). On a GPU machine without our venv, use
# bench/gpu_run.sh, which checks the versions and also runs the 7B benchmarks and the training checks.
test-gpu:
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) -m pytest -q -m gpu

demo: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) experiments/demo.py --output_dir runs/demo

study: $(STAMP)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false $(PY) experiments/study.py --output_dir runs/study

# The documentation site (Material for MkDocs): a strict build into site/ (git-ignored); a broken link, a missing
# reference or an undocumented public parameter fails it. docs-serve rebuilds it on every edit.
$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(PY) -m pip install --quiet -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 HF_HUB_OFFLINE=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 HF_HUB_OFFLINE=1 $(VENV)/bin/mkdocs serve --strict

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache site
