"""pytest plugin (registered through the `pytest11` entry point): the `vmlaunch_lab` fixture.

    def test_ping(vmlaunch_lab):
        lab = vmlaunch_lab("lab.toml", wait_for="login:")
        lab.vm("alpha").qmp("query-status")

A relative spec path is taken from the directory of the test file, wherever pytest runs. Every lab
the fixture brought up is brought down when the test ends, pass or fail.

Coverage: pytest imports this plugin (an entry point) before coverage starts, so `make test` reports
it as unrun although tests/test_api.py uses the fixture.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vmlaunch.api import Lab

LabFactory = Callable[..., "Lab"]


@pytest.fixture
def vmlaunch_lab(request: pytest.FixtureRequest) -> Iterator[LabFactory]:
    """`vmlaunch_lab(spec, vms=(), *, wait_for=None, timeout=None, wait_ssh=False)` brings a lab up
    (`Lab.up`) and returns it; a relative `spec` is taken from the test file's directory."""
    from vmlaunch.api import Lab, _locate_spec

    labs: list[Lab] = []
    test_file = request.path

    def start(spec: str | os.PathLike[str], vms: Sequence[str] = (), *, wait_for: str | None = None,
              timeout: float | None = None, wait_ssh: bool = False) -> Lab:
        path = _locate_spec(spec, test_file.parent, f"the directory of the test file, {test_file}")
        lab = Lab(path, vms, wait_for=wait_for, timeout=timeout, wait_ssh=wait_ssh)
        labs.append(lab)
        lab.up()
        return lab

    yield start
    errors = []
    for lab in reversed(labs):
        try:
            lab.down()
        except Exception as exc:  # keep tearing down the others; report all at the end
            errors.append(f"{lab.spec}: {exc}")
    if errors:
        pytest.fail("vmlaunch_lab teardown failed:\n" + "\n".join(errors), pytrace=False)
