# The two commands of the README:
#   make demo   set up what the demo needs (QEMU, the package, the test guest), then bring the demo lab
#               up, look at it and take it down
#   make test   set up what the tests need (make setup: the demo's and more) and run the tests
#               (make test-fast: their quick part, for the edit-run cycle)
# Both end with `make install`'s work (tools/install.sh): `vmlaunch` on PATH and its bash and zsh
# completion; `make uninstall` removes exactly that, and says what it leaves and how to remove it.
VENV := .venv
VMLAUNCH := $(VENV)/bin/vmlaunch
PYTEST := $(VENV)/bin/python -m pytest

.PHONY: setup demo test test-fast lint readme docs docs-serve bench bench-boot bench-density clean install uninstall

setup:
	@tools/setup.sh

# A symlink to .venv/bin/vmlaunch on PATH (/usr/local/bin as root, else ~/.local/bin) and the
# completion files; never replaces a vmlaunch that is not such a symlink. Needs `make setup` first.
install:
	@tools/install.sh

uninstall:
	@tools/install.sh --uninstall
	@tools/setup.sh --leftovers

demo:
	@tools/setup.sh --for demo
	@tools/demo.sh

# Branch coverage of the package, measured in the test processes (see pyproject.toml). Part of the
# tests: make test PYTEST_ARGS=tests/test_spec.py, make test PYTEST_ARGS="-k snapshot". On TEST_WORKERS
# workers (pytest-xdist; a file's tests stay on one, the longest files start first: tests/conftest.py),
# since much of a real test is waiting for a guest; TEST_WORKERS=0 runs it in one process. It ends with
# the 25 slowest tests and set-ups, and the run's CPU time (user + system, the QEMUs it started included:
# tools/cputime.py), so that a change that makes the suite slower shows in its own log.
TEST_WORKERS ?= 2
WORKERS := -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(VENV)/bin/python tools/cputime.py --label "make test" -- \
		$(PYTEST) $(WORKERS) --cov --cov-report=term --durations=25 $(PYTEST_ARGS)

# The edit-run cycle, under 3 minutes here: the tests that start no QEMU and the few quick real ones
# marked `fast` (pyproject.toml's markers), on 2 workers (pytest-xdist; a file's tests stay on one), without
# coverage. None of them changes a host-wide setting (KSM, hugepages, nftables, cgroups). make test
# stays the whole suite, the one CI runs. make test-fast PYTEST_ARGS=--lf: what failed last time.
test-fast: setup
	$(PYTEST) -n 2 --dist loadfile -m "(not qemu and not guest and not debian and not libvirt) or fast" \
		--durations=10 $(PYTEST_ARGS)

# The transcripts of the README and the manual (docs/) written anew from the commands' real output
# (root: the demo lab, in a private network namespace, ~15 s); tests/test_readme.py fails when they
# drift from it.
readme: setup
	$(VENV)/bin/python tools/readme_transcripts.py --write

lint: setup
	$(VENV)/bin/python -m pip install -q -e '.[lint]' --config-settings editable_mode=compat
	$(VENV)/bin/ruff check vmlaunch tests tools bench
	$(VENV)/bin/mypy vmlaunch tests tools bench

# The manual (docs/, mkdocs.yml) built into site/ with MkDocs and its Material theme; --strict fails on
# a broken link or anchor and on a page left out of nav. The reference pages (docs/reference/spec-keys.md
# and commands.md) are written anew first from the schema, the model's defaults and the argument parser
# (tests/test_reference.py fails when they drift), and the picture of the demo lab drawn by `vmlaunch
# graph` (docs/assets/demo-lab.svg). docs-serve serves it while it is edited.
docs: setup
	$(VENV)/bin/python -m pip install -q -e '.[docs]' --config-settings editable_mode=compat
	$(VENV)/bin/python tools/gen_reference.py --write
	$(VENV)/bin/vmlaunch graph examples/lab.toml --format svg --out docs/assets/demo-lab.svg
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

docs-serve: setup
	$(VENV)/bin/python -m pip install -q -e '.[docs]' --config-settings editable_mode=compat
	$(VENV)/bin/python tools/gen_reference.py --write
	$(VENV)/bin/vmlaunch graph examples/lab.toml --format svg --out docs/assets/demo-lab.svg
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

bench: setup
	$(VENV)/bin/python bench/startup.py
	$(VENV)/bin/python bench/up.py

# A real Debian guest booted 3 times each way (~15 minutes; installs libvirt's Debian packages)
bench-boot: setup
	$(VENV)/bin/python bench/boot.py

# Eight idle guests started the plain way and vmlaunch's way: the host memory they take and their
# throughput (~10 minutes; root, for KSM; draws bench/results/density.png with matplotlib)
bench-density: setup
	$(VENV)/bin/python -m pip install -q -e '.[bench]' --config-settings editable_mode=compat
	$(VENV)/bin/python bench/density.py

clean:
	rm -rf $(VENV) build *.egg-info examples/guest site
