# DDP from Scratch — `make help` lists the targets.
# Every target that runs Python first creates .venv and installs requirements.txt into it.

PYTHON      ?= python3
VENV        ?= .venv
# A pip constraints file, e.g. constraints/cpu.txt to pin the CPU build of torch (CI does).
CONSTRAINTS ?=
# Extra flags for a chapter script, e.g.  make run-chapter05 ARGS="--world-size 4 --quick"
ARGS        ?=
# The file `make grade-NN` grades (default: the learner's exercise file).  Exported, and read by
# the recipe's shell as "$$FILE": a name with spaces or quotes stays one argument.
FILE        ?=
export FILE

# Material for MkDocs 9.7+ prints an end-of-life notice (for its successor) on every build; the
# book stays on Material 9 + MkDocs 1.6 on purpose, so the notice is noise here.
export NO_MKDOCS_2_WARNING := 1

# On Linux, PyPI's torch is the CUDA build (several GB). A machine without an NVIDIA driver gets
# the CPU build from PyTorch's CPU index instead (also with CONSTRAINTS=constraints/cpu.txt, whose
# pin alone would fetch PyPI's CUDA 2.13.0); a GPU box keeps PyPI's. TORCH_INDEX= (empty) turns
# this off (CI does: it installs offline from a local wheel), TORCH_INDEX=URL picks another index.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
ifeq ($(origin TORCH_INDEX),undefined)
TORCH_INDEX := $(if $(filter Linux,$(shell uname -s)),$(if $(shell command -v nvidia-smi),,$(TORCH_CPU_INDEX)))
endif

PY       := $(VENV)/bin/python
STAMP    := $(VENV)/.installed
CHAPTERS := $(sort $(patsubst scripts/chapter%.py,%,$(wildcard scripts/chapter[0-9][0-9]_*.py)))

.DEFAULT_GOAL := help
.PHONY: help setup test test-browser lint figures bench gpu-check docs docs-offline serve clean distclean doctor

help: ## list the targets
	@echo "DDP from Scratch — targets (each one sets up .venv first if needed):"
	@grep -hE '^[a-zA-Z0-9_%-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "}; {sub("%", "NN", $$1); printf "  make %-16s %s\n", $$1, $$2}'
	@echo "  chapters: $(foreach c,$(CHAPTERS),run-chapter$(firstword $(subst _, ,$(c))))"
	@echo "  variables: ARGS=\"--quick --world-size 4\"  CONSTRAINTS=constraints/cpu.txt"

setup: $(STAMP) ## create .venv and install requirements.txt

$(STAMP): requirements.txt $(CONSTRAINTS)
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "error: Python 3.10+ is needed, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)
	@$(if $(TORCH_INDEX),echo "no NVIDIA driver found: torch's CPU build from $(TORCH_INDEX) (TORCH_INDEX= for PyPI's default)")
	$(PY) -m pip install --quiet -r requirements.txt $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@$(PY) -c 'import torch; print("torch", torch.__version__, "| CUDA GPUs:", torch.cuda.device_count())'
	@touch $@

run-chapter%: $(STAMP) ## run chapter NN (e.g. make run-chapter05); figures go to out/chapterNN/ (ignored by git)
	@script="$(wildcard scripts/chapter$*_*.py)"; \
	if [ -z "$$script" ]; then echo "error: there is no chapter $* (chapters: $(CHAPTERS))" >&2; exit 2; fi; \
	echo "$(PY) $$script $(ARGS)"; $(PY) $$script $(ARGS)

grade-%: $(STAMP) ## grade your exercises of chapter NN (FILE=path.py grades that file instead; ARGS=--refresh-reference redraws exercises/feedback/ from the solution)
	@$(PY) -m exercises.grader $* $${FILE:+"$$FILE"} $(ARGS)

doctor: ## pre-flight for a workshop day: versions, gloo, ports, cores, GPUs, disk, site (< 30 s)
	@if [ -x $(PY) ]; then $(PY) tools/doctor.py; else $(PYTHON) tools/doctor.py; fi

figures: $(STAMP) ## refresh the committed reference figures/: every chapter in full, one at a time (timings stay fair)
	@set -e; for c in $(CHAPTERS); do \
	  echo "== chapter $$c"; $(PY) scripts/chapter$$c.py --out figures $(ARGS); done
	$(PY) scripts/drawing/diagrams.py

gpu-check: $(STAMP) ## every chapter --quick on this box's GPUs, each mode it supports, into figures/gpu/
	$(PY) tools/gpu_check.py $(ARGS)

bench: $(STAMP) ## each chapter's --quick, one at a time, into a scratch dir: wall times, >60 s flagged
	$(PY) tools/bench.py $(ARGS)

# Two workers overlap one test's waiting (emulated links, timeouts) with another's computing;
# TEST_WORKERS=0 runs every test in this one process (tests/conftest.py says what stays together).
# A worker that crashes is not replaced: xdist's replacement can wait for ever on a file's tests.
TEST_WORKERS ?= 2
test: $(STAMP) lint ## lint, then every test (chapters' quick runs, the site, in Chromium if there is one)
	$(PY) -m pytest -n $(TEST_WORKERS) --max-worker-restart=0

# REQUIRE_BROWSER_TEST: a missing Chromium or playwright fails here instead of skipping.
test-browser: $(STAMP) ## the site in headless Chromium, every page (needs: apt-get install chromium)
	REQUIRE_BROWSER_TEST=1 $(PY) -m pytest tests/test_browser.py

lint: $(STAMP) ## ruff
	$(PY) -m ruff check scripts tests tools docs exercises

docs: $(STAMP) ## build the site into site/ (--strict; needs no internet to read)
	$(VENV)/bin/mkdocs build --strict

docs-offline: $(STAMP) ## build site-offline.zip: the book to read from file://, without a server
	$(PY) tools/build_offline.py

serve: $(STAMP) ## serve the site at http://127.0.0.1:8000 with live reload
	$(VENV)/bin/mkdocs serve

clean: ## remove build output and caches (keeps .venv and figures/)
	rm -rf site site-offline site-offline.zip .cache .pytest_cache .ruff_cache
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean ## clean, and remove .venv too
	rm -rf $(VENV)
