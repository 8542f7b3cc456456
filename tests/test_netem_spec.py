"""The netem figures: one parser for the spec, the CLI and the API (spec/netem.py), and the NIC key
`netem = { ... }` with its problems at their lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_spec
from vmlaunch.errors import SpecError
from vmlaunch.spec import netem as parser
from vmlaunch.spec.load import load_lab
from vmlaunch.spec.model import Netem, NetemWhere

HEAD = '[lab]\nname = "t"\n[network.n]\n[network.u]\ntype = "user"\n'
VM = '[vm.a]\nmemory = 64\nkernel = "k"\n'


@pytest.mark.parametrize(("given", "bare_ms", "expected"), [
    ({"delay": "20ms"}, False, Netem(delay_ms=20.0)),
    ({"delay": "1.5ms", "jitter": "500us"}, False, Netem(delay_ms=1.5, jitter_ms=0.5)),
    ({"delay": "1s"}, False, Netem(delay_ms=1000.0)),
    ({"delay": 100}, True, Netem(delay_ms=100.0)),
    ({"delay": "100"}, True, Netem(delay_ms=100.0)),
    ({"delay": "0ms"}, False, Netem(delay_ms=0.0)),
    ({"loss": "1%"}, False, Netem(loss=1.0)),
    ({"loss": 30}, False, Netem(loss=30.0)),
    ({"loss": "0.5"}, False, Netem(loss=0.5)),
    ({"corrupt": "100%", "duplicate": 0}, False, Netem(corrupt=100.0, duplicate=0.0)),
    ({"delay": "10ms", "reorder": "25%"}, False, Netem(delay_ms=10.0, reorder=25.0)),
    ({"rate": "10mbit"}, False, Netem(rate_bit=10_000_000)),
    ({"rate": "1Gbit"}, False, Netem(rate_bit=10**9)),
    ({"rate": "125kbps"}, False, Netem(rate_bit=10**6)),
    ({"rate": "800bit"}, False, Netem(rate_bit=800)),
    ({"loss": 1, "where": "guest"}, False, Netem(loss=1.0, where=NetemWhere.GUEST)),
])
def test_good_figures(given: dict[str, Any], bare_ms: bool, expected: Netem) -> None:
    assert parser.parse_netem(given, bare_ms=bare_ms) == (expected, [])


@pytest.mark.parametrize(("given", "bare_ms", "expected"), [
    ({"delay": 20}, False, ("delay", "20 has no unit")),
    ({"delay": "20"}, False, ("delay", "'20' has no unit")),
    ({"delay": "-5ms"}, True, ("delay", "'-5ms' is negative")),
    ({"delay": -5}, True, ("delay", "-5 is negative")),
    ({"delay": "5 parsecs"}, True, ("delay", "'5 parsecs' is not a duration")),
    ({"delay": "2m"}, True, ("delay", "'2m' is not a duration")),
    ({"delay": "61s"}, True, ("delay", "'61s' is more than a minute")),
    ({"delay": float("nan")}, True, ("delay", "nan is negative")),
    ({"loss": "101%"}, False, ("loss", "'101%' is not a percentage from 0 to 100")),
    ({"loss": -1}, False, ("loss", "-1 is not a percentage from 0 to 100")),
    ({"loss": "-1%"}, False, ("loss", "'-1%' is not a percentage from 0 to 100")),
    ({"corrupt": "lots"}, False, ("corrupt", "'lots' is not a percentage")),
    ({"duplicate": True}, False, ("duplicate", "True is not a percentage")),
    ({"rate": "10"}, False, ("rate", "'10' has no unit")),
    ({"rate": 10}, False, ("rate", "10 has no unit")),
    ({"rate": "10mb"}, False, ("rate", "'10mb': 'mb' is not a rate unit")),
    ({"rate": "0mbit"}, False, ("rate", "'0mbit' is less than a byte per second")),
    ({"rate": "100gbit"}, False, ("rate", "'100gbit' is more than netem can shape")),
    ({"jitter": "5ms"}, False, ("jitter", "jitter needs a delay (jitter varies the delay)")),
    ({"reorder": "5%"}, False, ("reorder", "reorder needs a delay (reorder sends some packets at once "
                                "while the rest wait)")),
    ({"where": "there", "loss": 1}, False, ("where", "'there' is not one of auto, host, guest")),
    ({}, False, ("", "sets no figure")),
    ({"where": "host"}, False, ("", "sets no figure")),
])
def test_bad_figures(given: dict[str, Any], bare_ms: bool, expected: tuple[str, str]) -> None:
    netem, problems = parser.parse_netem(given, bare_ms=bare_ms)
    assert netem is None
    assert [(key, message) for key, message, _ in problems] == [expected]


def test_every_problem_is_reported_at_once() -> None:
    _, problems = parser.parse_netem({"delay": "-1ms", "loss": 200, "rate": "5"}, bare_ms=True)
    assert [key for key, _, _ in problems] == ["delay", "loss", "rate"]


def test_figures_read_back() -> None:
    netem = Netem(delay_ms=100.0, jitter_ms=2.5, loss=0.5, rate_bit=10_000_000)
    shown = parser.figures(netem)
    assert shown == {"delay": "100ms", "jitter": "2.5ms", "loss": "0.5%", "rate": "10mbit"}
    assert parser.parse_netem(shown, bare_ms=False) == (netem, [])
    assert parser.from_json(parser.to_json(netem)) == netem
    assert parser.from_json({"delay_ms": "x"}) is None
    assert parser.format_rate(1234) == "1234bit"


def test_the_spec_key(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, HEAD + VM + '[[vm.a.nic]]\nnetwork = "n"\n'
                      'netem = { delay = "20ms", loss = "1%", rate = "10mbit", where = "host" }\n'
                      '[[vm.a.nic]]\nnetwork = "u"\nnetem = { loss = 5 }\n')
    nics = load_lab(spec).vms[0].nics
    assert nics[0].netem == Netem(delay_ms=20.0, loss=1.0, rate_bit=10_000_000, where=NetemWhere.HOST)
    assert nics[1].netem == Netem(loss=5.0)


def problems(tmp_path: Path, text: str) -> list[str]:
    spec = write_spec(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_lab(spec)
    return [str(p).replace(str(spec), "lab.toml") for p in info.value.problems]


def test_spec_problems_with_their_lines(tmp_path: Path) -> None:
    found = problems(tmp_path, HEAD + VM + '[[vm.a.nic]]\nnetwork = "n"\n'
                     'netem = { delay = 20, loss = "150%", rate = "10" }\n'
                     '[[vm.a.nic]]\nnetwork = "u"\n'
                     'netem = { loss = 5, where = "host" }\n'
                     '[[vm.a.nic]]\nnetwork = "n"\n'
                     '[vm.a.nic.netem]\njitter = "5ms"\n')
    assert found == [
        'lab.toml:11: vm.a.nic[0].netem.delay: 20 has no unit (write "20ms" (or us, s))',
        "lab.toml:11: vm.a.nic[0].netem.loss: '150%' is not a percentage from 0 to 100",
        "lab.toml:11: vm.a.nic[0].netem.rate: '10' has no unit (with a unit as tc writes rates: bit, "
        "kbit, mbit, gbit, tbit (bits/s) or bps, kbps, mbps, gbps (bytes/s))",
        "lab.toml:14: vm.a.nic[1].netem.where: network 'u' has no host interface to shape (QEMU's user "
        "and socket networks) (use where = \"guest\" (or \"auto\"))",
        "lab.toml:18: vm.a.nic[2].netem.jitter: jitter needs a delay (jitter varies the delay) "
        "(add a delay, e.g. \"20ms\")",
    ]


def test_schema_refuses_unknown_netem_keys(tmp_path: Path) -> None:
    found = problems(tmp_path, HEAD + VM + '[[vm.a.nic]]\nnetwork = "n"\nnetem = { delays = "20ms" }\n')
    assert len(found) == 1 and "vm.a.nic[0].netem" in found[0] and "delays" in found[0]
