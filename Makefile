VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test test-fast lint bench

setup:  ## create .venv and install decodekit, its dev tools and the default model
	bash scripts/setup.sh $(VENV)

test:  ## the whole suite, real-model tests included
	$(BIN)/python -m pytest

test-fast:  ## unit tests on tiny in-process models only
	$(BIN)/python -m pytest -m "not slow"

lint:
	$(BIN)/ruff check .
