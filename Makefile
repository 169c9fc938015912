# Two commands do all the set-up: `make demo` and `make test`. Both create .venv and install
# the pinned CPU environment (requirements/cpu-lock.txt) the first time.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider

.PHONY: install demo lint test test-fast test-gpu test-stress lock clean

install: $(STAMP)

$(STAMP): requirements/cpu-lock.txt setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps -r requirements/cpu-lock.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/oar demo --out demo_out

lint: $(STAMP)
	$(BIN)/ruff check .

# the 30 slowest tests at the end; tests/file_times.py turns a --junitxml report into per-file times
test: lint
	$(PYTEST) --durations=30 tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-gpu: $(STAMP)
	$(PYTEST) tests/gpu

# the multi-process tests 3 times under two busy-looping CPU hogs (flakes: docs/testing.md)
test-stress: $(STAMP)
	bash tests/stress.sh 3

lock:
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec)==' > requirements/.lock.new
	mv requirements/.lock.new requirements/cpu-lock.txt

clean:
	rm -rf $(VENV) demo_out .pytest_cache
