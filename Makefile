# distlab: `make book` regenerates every notebook and builds the site; `make test` runs the suite.
# Both create the virtual environment on first use and reuse it afterwards.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.distlab-installed
PROFILE ?= cpu
PYTEST_ARGS ?=
# FORCE=1: execute every chapter, not only those whose inputs changed since their last execution.
REGEN_ARGS := --profile $(PROFILE) $(if $(FORCE),--force,)

.PHONY: all env test test-fast test-attendee lint book notebooks site publish lock clean help deepspeed-op debian models \
	model-tiny model-smollm2 test-prerequisites benchmarks

help:
	@echo "make book   - set up, run every notebook whose inputs changed (papermill), build the Jupyter Book site"
	@echo "              (FORCE=1: run every notebook; PROFILE=gpu|quick: another parameter profile)"
	@echo "make test   - set up, lint (ruff), run the test suite: every tier (tests/unit, launches, notebooks, clusters)"
	@echo "make test-fast - lint and tests/unit less what is marked slow (no torchrun, notebooks, book, clusters), under 2 min"
	@echo "make test-attendee - every chapter's quick profile as a workshop attendee: normal user, one core each,"
	@echo "              no GNU timeout/ip/tc/Slurm/compiler on PATH; prints what each chapter skipped"
	@echo "make env    - only create/refresh the virtual environment ($(VENV))"
	@echo "make benchmarks - measure the book appendix's benchmark tables again (distlab vs HF Trainer vs TRL, the recipe,"
	@echo "              the scale rehearsal: memory per rank at load and in a step against the plan)"
	@echo "make publish REMOTE=... - push the built site to REMOTE's gh-pages branch (ghp-import)"

env: $(STAMP)

# Before any pip: $(VENV) is a virtual environment whose python runs and has pip. tools/check_venv.sh makes a
# missing one with $(PYTHON) and ends with one line naming the fix for the rest (a dangling bin/python after the
# system Python changed, a half-made venv, no python3-venv, a Python older than 3.10). Phony and order-only: it
# runs on every use, and an up-to-date stamp stays up to date.
.PHONY: venv-check
venv-check:
	@bash tools/check_venv.sh "$(VENV)" "$(PYTHON)"

# TORCH_INDEX=<index URL>: where pip takes torch from. PyPI's Linux x86_64 wheel is the CUDA build (with several
# GB of NVIDIA libraries); https://download.pytorch.org/whl/cpu gives the CPU build on a machine without a GPU.
TORCH_INDEX ?=

# Torch first, alone, so pip takes the local CPU build of 2.13.0; then everything else
# under the lock as a constraint so nothing replaces it.
$(STAMP): requirements.lock pyproject.toml tools/pretrained.txt | venv-check
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)",)
	$(PY) -m pip install -q -r requirements.lock -c requirements.lock
	$(PY) -m pip install -q --no-deps --require-hashes -r tools/pretrained.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (distlab)" >/dev/null
	@touch $@

# DeepSpeed JIT-compiles a C++ communication op on first use (about a minute on 2 cores). Build it once per
# machine into the persistent cache (distlab.strategies.deepspeed_runtime.extensions_dir) before tests and notebooks need it.
# It needs a C++ compiler and Python's headers: where they are missing it says so in one line. Asked for by name
# (`make deepspeed-op`) or under `make test`, that fails; under `make book`/`make notebooks` the book goes on
# (--optional), and a chapter skips its DeepSpeed runs with the same line (deepspeed_unavailable_reason).
deepspeed-op: $(STAMP)
	$(PY) -m distlab.strategies.deepspeed_runtime $(if $(filter book notebooks,$(MAKECMDGOALS)),--optional,)

# Debian packages the tests drive for real (chromium, shellcheck, iproute2, slurm-wlm, munge): installed when
# missing (needs root); a no-op when present.
debian:
	bash tools/ensure_debian_packages.sh

# The default model is a tiny Qwen2 pretrained here on first use (a few minutes, once, cached in build/models/);
# SmolLM2-135M-Instruct is converted once from the GGUF file its package carries (about 25 s). Both are built up
# front so that no notebook kernel or torchrun rank builds one inside its own time limit.
models: model-tiny model-smollm2

model-tiny: $(STAMP)
	$(PY) -c 'from distlab.tiny_base import build_default_model; build_default_model()'

model-smollm2: $(STAMP)
	$(PY) -c 'from distlab.pretrained import build_smollm2; build_smollm2()'

# What the suite needs, two at a time: on a fresh machine the Debian packages install while pip fills the virtual
# environment (neither needs the other); then the tiny base's pretraining holds one core for about five minutes
# (one thread: its weights depend on the thread count), and the other core builds DeepSpeed's op, converts
# SmolLM2 and lints meanwhile. Each target's output is printed whole when it ends (--output-sync), so two never
# interleave.
test-prerequisites:
	@$(MAKE) --no-print-directory -j2 --output-sync=target debian deepspeed-op models lint

test: test-prerequisites
	$(PY) -m pytest $(PYTEST_ARGS)

# The everyday tier: lint, then tests/unit less its tests marked `slow` (in-process work over the 5 s an unmarked
# test may take). tests/launches (torchrun and multi-process runs), tests/notebooks (papermill, the book build) and
# tests/clusters (the emulated LAN, Slurm, Kubernetes pods) are all slow: `make test` runs them. Under 2 minutes on
# 2 cores; an unmarked test over 5 s fails (tests/conftest.py), so it stays so.
test-fast: $(STAMP) models lint
	$(PY) -m pytest tests/unit -m "not slow" $(PYTEST_ARGS)

# Every chapter's quick profile as a workshop attendee runs it: a normal user (as root: a system user made for it),
# one core per chapter, no GNU timeout, ip, tc, Slurm, munge or C++ compiler on PATH. Prints what each chapter
# skipped and why. `make test` runs the same (tests/notebooks/test_notebooks.py), then builds the book from its
# output.
test-attendee: $(STAMP) deepspeed-op models
	$(PY) -m distlab.publish.attendee

# ruff, configured in pyproject.toml: line length, import order, unused names, over lib, tests and notebooks.
lint: $(STAMP)
	$(PY) -m ruff check .

notebooks: $(STAMP) deepspeed-op models
	$(PY) -m distlab.publish.regenerate $(REGEN_ARGS)

site: $(STAMP)
	$(PY) -m distlab.publish.book --check --fetch-mathjax

# The site is built (and checked in a headless browser) even when a notebook fails, so the
# failure can be inspected; the target still fails.
book: $(STAMP) deepspeed-op models
	@rc=0; $(PY) -m distlab.publish.regenerate $(REGEN_ARGS) || rc=$$?; \
	$(PY) -m distlab.publish.book --check --fetch-mathjax || rc=$$?; exit $$rc

# The appendix's benchmark tables: not a chapter's, so `make book` does not redraw them; the freshness check
# (and so `make publish`) flags them once the library changes. Several minutes on 2 cores: run on a quiet machine.
benchmarks: $(STAMP) models deepspeed-op
	$(PY) -m distlab.bench.trainer_vs_hf --out figures
	$(PY) -m distlab.bench.compiled_step --full --out figures
	$(PY) -m distlab.bench.scale_rehearsal --out figures

# Push book/_build/html to the gh-pages branch of REMOTE (a remote name, URL or bare repository path) with
# ghp-import; refused while any committed figure is stale or was drawn from a dirty tree.
publish: $(STAMP)
	@test -n "$(REMOTE)" || { echo "make publish REMOTE=<remote name, URL or path>"; exit 2; }
	$(PY) -m distlab.publish.pages --remote "$(REMOTE)"

lock:
	rm -rf build/lockenv && $(PYTHON) -m venv build/lockenv
	build/lockenv/bin/pip install -q "torch==2.13.0"
	build/lockenv/bin/pip install -q -c <(echo torch==2.13.0) -e ".[deepspeed,notebooks]" pytest ruff trl playwright nbformat nbclient kubernetes-validate ghp-import
	build/lockenv/bin/python tools/write_lock.py build/lockenv

clean:
	rm -rf build book/_build book/notebooks
