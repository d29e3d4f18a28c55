# The README's two commands: `make run` (the main job) and `make test` (the test suite).
# Each creates or refreshes .venv itself: the pinned CPU torch first (a bare `torch` requirement
# would pull a multi-GB CUDA build), then the package with its extras.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The optional integrations are installed for the tests too, so CI exercises every extra (docs: the site's
# build, which the tests run too).
EXTRAS ?= triton,hf,dev,ray,tensorboard,mlflow,torchtitan,docs
PY := $(VENV)/bin/python
STAMP := $(VENV)/.addnorm-installed
ARGS ?=

.PHONY: run test test-all lint format bench gpu-bench install clean report-screenshots docs browser

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP)

# ARGS: the study's arguments (make run ARGS="--smoke", ARGS="literature --workers 2").
run: $(STAMP)
	$(VENV)/bin/addnorm study $(ARGS)

# TRITON_INTERPRET=1 runs the Triton kernels on the CPU, so CI checks them without a GPU.
# Two tiers: `make test` (the README's) runs every test not marked slow (<= 5 min on 2 cores), and
# fails if it imported no test of some module of the package (tests/tiers.py); `make test-all` runs
# everything (<= 10 min; .ci/run). A module is slow by cause (spawned ranks, compilers, smoke studies,
# process pools, benchmarks run end to end), marked with its pytestmark.
# TEST_WORKERS pytest-xdist workers of one thread each (tests/conftest.py), a test file per worker so a
# module's shared spawn of ranks runs once, the files longest first (tests/order.py; xdist keeps that
# order with --no-loadscope-reorder) so the two workers end together; TEST_WORKERS=0: this process alone.
TEST_WORKERS ?= 2
PYTEST = TRITON_INTERPRET=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(STAMP)
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PYTEST) $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks tools
	$(VENV)/bin/ruff format --check src tests benchmarks tools

format: $(STAMP)
	$(VENV)/bin/ruff format src tests benchmarks tools
	$(VENV)/bin/ruff check --fix src tests benchmarks tools

bench: $(STAMP)
	$(PY) -m benchmarks.step.encoder_layer

# Everything the GPU measures, in one device call of at most 8 minutes, on a bare device image (torch
# and Triton preinstalled, no venv): GPU tests, op table, host time, LM and HF steps, each step with its
# own budget; tables named by device in $OUT when set, else benchmarks/results/<device>/<date>-<commit>/.
# GPU_BENCH_ARGS="--commit $(git rev-parse --short HEAD)" names the code that ran when the device's copy
# of the tree has no .git; --dry-run prints the plan and its budgets; --only STEP reruns one step;
# "--budget 570 --study gpu-literature benchmarks/results/h200/study-gpu-literature" then resumes that GPU
# study with the time left, its folder returned as one .tar.
gpu-bench:
	PYTHONPATH=src $(PYTHON) -m benchmarks.device.gpu_suite $(GPU_BENCH_ARGS)

# The README's report screenshots (docs/report-*.png), rebuilt from the quick, literature and llama studies'
# reports under addnorm-out/ (run those studies first); needs chromium (apt-get install chromium).
report-screenshots: $(STAMP)
	$(PY) -m tools.report_screenshot --docs addnorm-out

# The docs site (mkdocs.yml) into site/, strict: a broken link, a missing page, a page left out of the nav
# or a docstring that griffe cannot read fails the build.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

# Chromium (Debian's package) for the docs site's browser test and the report screenshots: installed when
# apt-get is there and we are root, else nothing (tests/test_docs_site.py then skips, saying why).
browser:
	@if command -v chromium >/dev/null 2>&1; then echo "browser: $$(command -v chromium)"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
			|| echo "browser: apt-get could not install chromium: the browser test will skip"; \
	else echo "browser: no chromium, and no apt-get as root to install it: the browser test will skip"; fi

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
