# gemma-finetune: every command a user or CI needs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STACK  ?= dev
UV_VERSION := 0.13.9
# `make test` runs the tests on 3 worker processes on 2 cores (why: docs/development.md)
TEST_WORKERS ?= 3
MYPY   := $(PY) -m mypy infra trainer/recipe.py
LOCAL_MODEL := $(PY) -m trainer.local_model
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=10 tests
STAMP  := $(VENV)/.installed-$(shell cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-12)
# zizmor and checkov in a venv of their own: checkov pins packaging and networkx below what the dev venv holds
SCANNERS := .venv-scanners
SCAN_STAMP := $(SCANNERS)/.installed-$(shell sha256sum .ci/scanners.lock | cut -c1-12)

export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Tests and the demo never reach the Hub; the Pulumi program never reaches the cloud here.
export HF_HUB_DISABLE_TELEMETRY := 1
export TOKENIZERS_PARALLELISM := false
# torch's OpenMP threads sleep instead of spinning while they wait: on a shared CPU spinning takes
# the cores the working threads need (demo/pipeline.py `_yielding_cpu_threads` has the numbers)
export OMP_WAIT_POLICY := PASSIVE
# The venv's bytecode is written by the first import of each module, not compiled whole at install (.ci/uv_install.py):
# a PYTHONDONTWRITEBYTECODE from the environment would have every process compile what it imports again
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help venv test test-fast lint lint-files scan demo plan impact bench step-ops time-to-model gpu-wheelhouse gpu-check-dry clean

help: ## list the commands
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

# uv installs the pinned set in a fraction of pip's time (docs/development.md; timings in bench/RESULTS.md), from the sources pip is
# configured with (.ci/uv_install.py: a machine's CPU build of torch lies in pip's find-links); pip does it
# all when uv cannot be had. uv is removed again afterwards: the venv holds the packages pip's would.
$(STAMP): requirements.txt requirements-dev.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if $(PY) -m pip install -q --no-compile uv==$(UV_VERSION) && $(VENV)/bin/uv --version >/dev/null \
	    && (set -x; $(PY) .ci/uv_install.py -q -r requirements-dev.txt); then \
	  $(PY) -m pip uninstall -q -y uv; \
	else \
	  echo "uv $(UV_VERSION) could not be installed or failed: installing with pip (several minutes)"; \
	  $(PY) -m pip uninstall -q -y uv 2>/dev/null; set -x; \
	  $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -r requirements-dev.txt; \
	fi
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP) ## create .venv and install the pinned CPU requirements (once)

$(SCAN_STAMP): .ci/scanners.lock
	@test -x $(SCANNERS)/bin/python || $(PYTHON) -m venv $(SCANNERS)
	$(SCANNERS)/bin/python -m pip install -q --require-hashes --only-binary :all: -r .ci/scanners.lock
	@rm -f $(SCANNERS)/.installed-* && touch $@

scan: $(STAMP) $(SCAN_STAMP) ## zizmor + checkov (offline) on workflows, Dockerfiles, every planned manifest, vs .ci/scanners-baseline.yaml
	$(PY) .ci/scan.py

lint: lint-files ## ruff, mypy on infra/, workflow/shell/Dockerfile linters, every planned manifest
	$(PY) -m infra.offline.validate_manifests
	$(MYPY) -n 2  # 2 workers; a cold cache reads ~1,000 library modules (pyproject.toml says which)

# every linter but mypy and the manifests (seconds); `make test` checks the manifests in
# tests/lint/test_manifests.py, which runs the same validation over the same plans
lint-files: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/actionlint -no-color -pyflakes= -shellcheck=$(VENV)/bin/shellcheck
	$(VENV)/bin/shellcheck .ci/run .ci/pulumi-run.sh infra/bootstrap/ci-setup.sh
	@files=$$(find . \( -name .git -o -name .venv -o -name venv -o -name build -o -name outputs -o -name .cache \
	    -o -name node_modules \) -prune -o -type f \( -name Dockerfile -o -name 'Dockerfile.*' -o -name '*.Dockerfile' \) \
	    ! -name '*.dockerignore' -print | sort); \
	  echo "hadolint $$files"; [ -z "$$files" ] || $(VENV)/bin/hadolint $$files

# mypy (one core, a cold cache: it reads sources only) runs beside the tests rather than before them; its report
# follows theirs.
# On a machine without the local Gemma 3 270M (CI) its one build starts at once, beside the first tests; the
# 270M tests wait for it on the build's lock (trainer/local_model.py) instead of building it in their turn; after an
# interrupted run (pytest's exit code 2) the build is left to finish on its own
test: lint-files $(SCAN_STAMP) ## lint + scanners + every test (slow ones too: CI runs them)
	@mkdir -p build; echo "$(MYPY) > build/mypy.log &"; $(MYPY) > build/mypy.log 2>&1 & mypy=$$!; \
	  echo "$(PY) .ci/scan.py > build/scan.log &"; $(PY) .ci/scan.py > build/scan.log 2>&1 & scan=$$!; \
	  echo "$(LOCAL_MODEL) > build/local-model.log &"; $(LOCAL_MODEL) > build/local-model.log 2>&1 & model=$$!; \
	  echo "$(PYTEST)"; $(PYTEST); rc=$$?; \
	  [ $$rc -eq 2 ] || wait $$model || { echo "$(LOCAL_MODEL) failed:"; cat build/local-model.log; }; \
	  wait $$mypy; mypy_rc=$$?; echo "$(MYPY):"; cat build/mypy.log; \
	  wait $$scan; scan_rc=$$?; echo "$(PY) .ci/scan.py:"; cat build/scan.log; \
	  if [ $$rc -eq 5 ]; then echo "no tests collected"; rc=1; fi; \
	  if [ $$mypy_rc -ne 0 ] && [ $$rc -eq 0 ]; then rc=$$mypy_rc; fi; \
	  if [ $$scan_rc -ne 0 ] && [ $$rc -eq 0 ]; then rc=$$scan_rc; fi; exit $$rc

test-fast: $(STAMP) ## the tests not marked slow
	$(PY) -m pytest -q -m "not slow" tests

demo: $(STAMP) ## fine-tune Gemma 3 270M here, merge, serve on 127.0.0.1, query it [DATA=my.jsonl] [RECIPE=my.yaml]
	$(PY) -m demo.pipeline $(if $(DATA),--data "$(DATA)") $(if $(RECIPE),--recipe "$(RECIPE)")

plan: $(STAMP) ## offline plan of a stack under mocks: make plan STACK=a4-gemma4 [SET="maxRunCostUsd=500 nodes=2"]
	$(PY) -m infra.offline.plan --stack $(STACK) $(foreach kv,$(SET),--set $(kv))

# every change of infra/offline/impact.py CHANGES on every stack it applies to (about a minute): the committed table and
# infra/offline/impact_results.json, which tests/infra/test_change_impact.py checks against the rules and a few re-plans
impact: $(STAMP) ## what each config key (and a pull of trainer/) does on day two: rewrites docs/operations.md's table
	$(PY) -m infra.offline.impact

bench: $(STAMP) ## training throughput, each shipped text recipe vs its seed (CPU)
	$(PY) bench/train_throughput.py --device cpu --recipe text-to-sql-gemma4-31b --out build/bench/text-to-sql.json
	$(PY) bench/train_throughput.py --device cpu --recipe emoji-gemma3-1b --out build/bench/emoji.json

step-ops: $(STAMP) ## kernels and host-device syncs per W1 micro-step, counted on the CPU (minutes): bench/step_ops.json
	$(PY) bench/step_ops.py --json bench/step_ops.json

time-to-model: $(STAMP) ## each stack's modelled wait from `pulumi up` to the model in the bucket: bench/time_to_model.json
	$(PY) bench/time_to_model.py --json bench/time_to_model.json

gpu-wheelhouse: $(STAMP) ## wheels the lent GPU machine lacks (cp312), for bench/gpu_check.sh offline: one carry
	bench/prepare_wheelhouse.sh --dest build/gpu-wheelhouse

gpu-check-dry: $(STAMP) ## the GPU check's plan on this CPU with tiny models (plumbing, not timing)
	bench/gpu_check.sh --dry-run --out build/gpu_check/dry.json

clean: ## remove build outputs (keeps .venv and the prepared local model)
	rm -rf build outputs .pytest_cache .ruff_cache .mypy_cache
