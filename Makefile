# The two commands of the README:
#   make demo   set everything up (QEMU, the package, the test guest), then bring the demo lab up,
#               look at it and take it down
#   make test   set everything up and run the tests
VENV := .venv
VMLAUNCH := $(VENV)/bin/vmlaunch
PYTEST := $(VENV)/bin/python -m pytest

.PHONY: setup demo test lint bench clean

setup:
	@tools/setup.sh

demo: setup
	@tools/demo.sh

# Branch coverage of the package, measured in the test process (see pyproject.toml).
test: setup
	$(PYTEST) --cov --cov-report=term $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/python -m pip install -q -e '.[lint]' --config-settings editable_mode=compat
	$(VENV)/bin/ruff check vmlaunch tests tools bench
	$(VENV)/bin/mypy vmlaunch tests tools bench

bench: setup
	$(VENV)/bin/python bench/startup.py
	$(VENV)/bin/python bench/up.py

clean:
	rm -rf $(VENV) build *.egg-info examples/guest
