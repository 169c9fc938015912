# Two commands do all the set-up: `make demo` and `make test`. Both create .venv and install
# the pinned CPU environment (requirements/cpu-lock.txt) the first time.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider

.PHONY: install demo lint test test-fast test-gpu lock clean

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

test: lint
	$(PYTEST) tests

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-gpu: $(STAMP)
	$(PYTEST) tests/gpu

lock:
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec)==' > requirements/.lock.new
	mv requirements/.lock.new requirements/cpu-lock.txt

clean:
	rm -rf $(VENV) demo_out .pytest_cache
