# The two front-door commands (README): `make smoke` and `make test`. Both install first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install smoke test lint

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install.sh scripts/pip_step.sh
	bash scripts/install.sh $(VENV)
	touch $@

# The main job on the embedded default: tiny MLA model, CPU vLLM, local Ray, loopback only.
smoke: install
	$(VENV)/bin/orchestrator run matrices/smoke.yaml

# Everything but the GPU-marked tests (those need a CUDA GPU: docs/gpu-validation.md), on
# TEST_LANES pytest-xdist workers (tests/lanes.py); then where the time went, per module.
TEST_LANES ?= 2
JUNIT ?= .cache/junit.xml
test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@mkdir -p $(dir $(JUNIT)) && rm -f $(JUNIT)
	$(PY) -m pytest -m "not gpu" -n $(TEST_LANES) --dist loadscope --no-loadscope-reorder \
		--durations=25 --junitxml=$(JUNIT) tests; rc=$$?; \
		$(PY) scripts/test_times.py $(JUNIT); exit $$rc

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .
