VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test test-fast lint lock

setup:  ## create .venv and install decodekit, its dev tools and the default model
	bash scripts/setup.sh $(VENV)

test:  ## the whole suite, real-model tests included, on every core (at most 4 workers)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile

test-fast:  ## unit tests on tiny in-process models only
	$(BIN)/python -m pytest -m "not slow"

lint:
	$(BIN)/ruff check .

lock:  ## re-resolve requirements/dev.lock from pyproject.toml's ranges (torch held at requirements/torch.txt)
	$(BIN)/python -m piptools compile --quiet --upgrade --extra dev --strip-extras --unsafe-package torch \
		--constraint requirements/torch.txt --no-emit-find-links --no-emit-index-url \
		--output-file requirements/dev.lock pyproject.toml
