# Two entry points: `make run` (the main job on the embedded default model) and `make test` (the test suite).
# Both create .venv on first use. torch is named in the same pip command so pip takes the pinned CPU wheel
# instead of resolving a CUDA build.
VENV := .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" -e ".[dev]"
	touch $@

.PHONY: run test bench lint
run: $(VENV)/.installed
	$(VENV)/bin/pie run examples/text_completion.py -- --prompt "Tell me about paged attention." --max-tokens 32

test: $(VENV)/.installed
	$(PY) -m pytest -q --durations=15

bench: $(VENV)/.installed
	$(PY) bench/forward.py
	$(PY) bench/tax.py

lint: $(VENV)/.installed
	$(PY) -m ruff check .
