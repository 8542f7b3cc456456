# The two commands of the README:
#   make demo   set everything up (QEMU, the package, the test guest) and run vmlaunch on the demo lab
#   make test   set everything up and run the tests
VENV := .venv
VMLAUNCH := $(VENV)/bin/vmlaunch
PYTEST := $(VENV)/bin/python -m pytest

.PHONY: setup demo test lint bench clean

setup:
	@tools/setup.sh

demo: setup
	$(VMLAUNCH) validate examples/lab.toml
	$(VMLAUNCH) cmdline examples/lab.toml

test: setup
	$(PYTEST) $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/python -m pip install -q -e '.[lint]'
	$(VENV)/bin/ruff check vmlaunch tests tools
	$(VENV)/bin/mypy vmlaunch

bench: setup
	$(VENV)/bin/python bench/startup.py

clean:
	rm -rf $(VENV) build *.egg-info examples/guest
