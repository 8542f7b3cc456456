"""pytest plugin (registered through the `pytest11` entry point): the `vmlaunch_lab` fixture.

    def test_ping(vmlaunch_lab):
        lab = vmlaunch_lab("lab.toml", wait_for="login:")
        lab.vm("alpha").qmp("query-status")

Every lab the fixture brought up is brought down when the test ends, pass or fail.

Coverage: pytest imports this plugin (an entry point) before coverage starts, so `make test` reports
it as unrun although tests/test_api.py uses the fixture.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vmlaunch.api import Lab

LabFactory = Callable[..., "Lab"]


@pytest.fixture
def vmlaunch_lab() -> Iterator[LabFactory]:
    from vmlaunch.api import Lab

    labs: list[Lab] = []

    def start(spec: str | Path, vms: Sequence[str] = (), *, wait_for: str | None = None,
              timeout: float = 60.0) -> Lab:
        lab = Lab(spec, vms, wait_for=wait_for, timeout=timeout)
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
