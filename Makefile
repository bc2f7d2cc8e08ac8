# Every setup path installs torch first, from PyTorch's CPU wheel index by default: on Linux
# x86-64, PyPI's torch is the CUDA build, and pinning its version alone still pulls gigabytes of
# CUDA packages. On a GPU machine: make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (the index for your CUDA version), or TORCH_INDEX= for PyPI's default build.
#
# Every install is constrained by requirements-lock.txt: the versions the suite last passed with
# (pyproject.toml keeps compatible ranges for those who install aiorl as a library). It is one
# file for every supported Python, resolved for all of them at once: where one version of a
# package cannot serve them all, each line carries an environment marker (python_full_version)
# and pip takes the one that matches. `make lock` refreshes it on purpose and writes it only if
# the suite passes with it (.ci/lock says how).
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The resolver that writes the lock (`make lock`), pinned so that the same inputs give the same file.
UV_VERSION ?= 0.13.9
LOCK = requirements-lock.txt
PIP = $(PYTHON) -m pip install --progress-bar on -c $(LOCK)
# Parallel test processes: tests start real clusters and mostly wait on them, so two per core
# (at least two) shorten the suite without starving it; TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -lt 2 ] && n=2; echo $$((n * 2)))
# The unit tests (`make test-unit`): everything under tests/unit/, in-process, no cluster,
# no subprocess; under a minute on a 2-core machine. `make test-fast` adds the import smoke
# test and one real traced cluster drawn with matplotlib (test_trace_render); CI runs it on
# every supported Python besides the one that runs the whole suite (.ci/pythons).
UNIT_TESTS = tests/unit

.PHONY: torch setup demo test test-unit test-fast smoke test-stress lock chaos bench gpu-check gpu-wheels lint docs docs-build

# torch alone from its index, with one short try (no retries: an unreachable index costs
# seconds, not minutes of retry warnings; PyPI instead, said in one line), then its
# dependencies from PyPI at the locked versions (the torch index need not carry those).
torch:
	@echo "== torch $(TORCH_VERSION) from $(or $(TORCH_INDEX),PyPI) (about 200 MB for the CPU build; nothing to fetch if installed)"
	@$(PIP) --no-deps "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --timeout 10 --retries 0) || \
	  echo "== $(TORCH_INDEX) is unreachable: installing torch $(TORCH_VERSION) from PyPI instead (on Linux x86-64 that is the CUDA build)"
	@$(PIP) "torch==$(TORCH_VERSION)"

setup: torch
	@echo "== aiorl, its dependencies and the test tools"
	$(PIP) -e ".[test]"

demo: torch
	@echo "== aiorl and its runtime dependencies (pyzmq, msgpack, uvloop, omegaconf, cloudpickle, numpy)"
	$(PIP) -e .
	@echo "== aiorl demo --steps 20"
	$(PYTHON) -m aiorl.cli.main demo --steps 20

test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The import smoke test: aiorl and every runtime dependency import, and the CLI starts.
smoke: setup
	$(PYTHON) -c "import sys, aiorl, torch, zmq, msgpack, uvloop, omegaconf, cloudpickle, numpy, setproctitle; \
	  print('== smoke: Python', sys.version.split()[0], '| torch', torch.__version__, '| pyzmq', zmq.__version__, \
	  '| numpy', numpy.__version__, '| aiorl imports')"
	$(PYTHON) -m aiorl.cli.main --help >/dev/null

# The unit tests alone, in one process.
test-unit:
	$(PYTHON) -m pytest -q -p no:cacheprovider $(UNIT_TESTS)

# The smoke test, then the unit tests and the traced cluster in one process.
test-fast: smoke
	$(PYTHON) -m pytest -q -p no:cacheprovider $(UNIT_TESTS) tests/system/test_trace_render.py

# The suite while two busy processes hog the CPUs (what a shared CI machine does to it).
test-stress: setup
	$(PYTHON) tests/stress.py -- $(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Refresh the lock on purpose: the newest versions pyproject.toml allows, resolved for every
# supported Python at once; the whole suite with PYTHON and the fast tests on each other
# supported Python this machine has, each in a fresh venv; requirements-lock.txt is rewritten
# only if they all pass.
lock:
	PYTHON=$(PYTHON) TORCH_VERSION=$(TORCH_VERSION) TORCH_INDEX=$(TORCH_INDEX) UV_VERSION=$(UV_VERSION) bash .ci/lock

# The long chaos runs (docs/failures.md, invariant 32): >= 200 SIGKILLs of workers, node
# agents and the registry while a pipeline runs, and 300 rounds of the GRPO-shaped pipeline with
# one process of any kind SIGKILLed or SIGSTOPped each round (its summary table at the end);
# the normal suite runs short ones. AIORL_CHAOS_SEED=N picks another sequence of victims.
chaos:
	AIORL_CHAOS_KILLS=200 AIORL_CHAOS_STEPS=50 AIORL_CHAOS_ROUNDS=300 $(PYTHON) -m pytest -q -s -m chaos tests/system/test_chaos.py

# Issue 26's GPU targets on one GPU, no network, about six minutes: the GPU tests, CUDA IPC,
# small CUDA messages, weights on the GPU, idle CPU; one table, and
# benchmarks/results/gpu-<device>.json to commit. Without CUDA it says so and exits 0.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

# The wheels a GPU machine's image lacks (the lock's versions), for the device tool's carry
# (.whl, ignored by git): then `bash benchmarks/gpu_session.sh` there.
GPU_WHEELS = pyzmq==27.3.0 omegaconf==2.4.0 setproctitle==1.3.8 pytest-asyncio==1.5.0
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $(GPU_WHEELS)
	@grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
	@ls .whl

bench: setup
	$(PYTHON) -m pip install -q "ray==2.60.0" || echo "ray not installed: its columns stay empty"
	$(PYTHON) benchmarks/bench_calls.py
	$(PYTHON) benchmarks/bench_p2p.py
	$(PYTHON) benchmarks/bench_channels.py
	$(PYTHON) benchmarks/bench_security.py
	$(PYTHON) benchmarks/bench_serialization.py
	$(PYTHON) benchmarks/bench_trace.py

lint: setup
	$(PYTHON) -m ruff check aiorl tests benchmarks examples
	$(PYTHON) -c "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
	$(PYTHON) -m mypy

# The documentation site (mkdocs.yml): `make docs` serves it on http://127.0.0.1:8000 and
# rebuilds on every change; `make docs-build` is what CI runs (warnings are errors).
docs: torch
	$(PIP) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs serve

docs-build: torch
	$(PIP) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site
