# Two commands do all the set-up: `make demo` and `make test`. Both create .venv and install
# the pinned CPU environment (requirements/cpu-lock.txt) the first time.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST := $(BIN)/python -m pytest -p no:cacheprovider

.PHONY: install demo lint test test-e2e test-all test-fast test-gpu test-stress test-kernels test-kernels-quick lock clean

install: $(STAMP)

# pip compiles what it installs one file at a time; compileall does it on every core (85 s
# instead of 96 s for the whole install on 2 cores). A few third-party files are not Python 3
# (templates, test data): pip skips them silently, compileall reports them, hence `|| true`.
# The project's own sources are compiled too, for environments with PYTHONDONTWRITEBYTECODE set,
# where every process (about a hundred in a test run) would compile them again.
$(STAMP): requirements/cpu-lock.txt setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --no-deps --no-compile -r requirements/cpu-lock.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation --no-compile -e .
	$(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true
	$(BIN)/python -m compileall -q -j 0 megatron_oar checkpoints_convert benchmarks tests
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/oar demo --out demo_out

lint: $(STAMP)
	$(BIN)/ruff check .

# The suite in two tiers (docs/testing.md, "Time budget"): `make test`, everything but the
# end-to-end command runs (at most 15 minutes on 2 cores), and `make test-e2e`, those runs
# (marker e2e: oar train under torchrun with faults, oar demo, oar repro, oar bench, oar eval,
# oar analyze oracle, the installed sdist). CI (.ci/run) runs both, then the numerical tests under
# other CPU kernels (test-kernels-quick, below): `make test-all`.
# The slowest tests at the end; tests/file_times.py turns a --junitxml report into per-file times.
test: lint
	$(PYTEST) -m "not e2e" --durations=30 tests

test-e2e: $(STAMP)
	$(PYTEST) -m e2e --durations=15 tests

test-all: test test-e2e test-kernels-quick

test-fast: $(STAMP)
	$(PYTEST) -m "not slow" tests

test-gpu: $(STAMP)
	$(PYTEST) tests/gpu

# the multi-process tests 3 times under two busy-looping CPU hogs (flakes: docs/testing.md)
test-stress: $(STAMP)
	bash tests/stress.sh 3

# the numerical equality tests under other CPU kernels: ATen's scalar / AVX2 / AVX-512 dispatch and
# MKL's reproducible and AVX2 paths, after a table of what each changes (docs/testing.md, "Other
# CPUs' kernels"; 1.5 min for the table, then 2 to 3 minutes per level on 2 cores: about 15 minutes,
# so not in CI)
test-kernels: $(STAMP)
	bash tests/kernels.sh

# CI's share of it (make test-all): the level that moves the numbers most on x86 (ATen's scalar
# kernels with MKL's reproducible path) on the tolerance check, test_padding and test_loss_layouts,
# and one vLLM rollout (vLLM's compiled sampler kernels under that level, after make test filled
# the native level's inductor cache: runtime/inductor_cache.py)
test-kernels-quick: $(STAMP)
	KERNEL_TABLE=0 KERNEL_LEVELS="ATEN_CPU_CAPABILITY=default+MKL_CBWR=COMPATIBLE" bash tests/kernels.sh \
		-m "not e2e" tests/test_tolerances.py tests/test_padding.py tests/test_loss_layouts.py \
		tests/test_inductor_cache.py tests/test_rollout.py::test_rollout_tp1_sync_seeds_stop_strings

# the lock's header comment (its leading '#' lines) is kept above the new freeze
lock:
	sed -n '/^#/!q;p' requirements/cpu-lock.txt > requirements/.lock.new
	$(BIN)/pip freeze --exclude-editable | grep -v -E '^(torchvision|torchaudio|torchcodec)==' >> requirements/.lock.new
	mv requirements/.lock.new requirements/cpu-lock.txt

clean:
	rm -rf $(VENV) demo_out .pytest_cache
