# Every setup path installs the CPU torch wheel first: a looser torch requirement
# resolved on a machine without torch would pull gigabytes of CUDA packages.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0

.PHONY: setup demo test bench lint

setup:
	$(PYTHON) -m pip install -q torch==$(TORCH_VERSION)
	$(PYTHON) -m pip install -q -e ".[test]"

demo: setup
	$(PYTHON) -m aiorl.cli.main demo --steps 20

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m pip install -q "ray==2.60.0" || echo "ray not installed: its columns stay empty"
	$(PYTHON) benchmarks/bench_calls.py
	$(PYTHON) benchmarks/bench_p2p.py
	$(PYTHON) benchmarks/bench_channels.py
	$(PYTHON) benchmarks/bench_security.py
	$(PYTHON) benchmarks/bench_serialization.py

lint: setup
	$(PYTHON) -m ruff check aiorl tests benchmarks examples
	lint-imports
	$(PYTHON) -m mypy
