"""`vmlaunch graph --live` of a lab that runs: one test guest on a bridge in a private network namespace,
drawn running, then paused with its link down, then after `down` stopped."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tests.test_e2e import READY, netns_named
from vmlaunch.export.graph import DOWN_COLOUR, MARK_COLOURS, Mark

pytestmark = [pytest.mark.qemu, pytest.mark.guest]


def test_live_picture_follows_the_lab(tmp_path: Path, test_guest: Path) -> None:
    name = f"graph{uuid.uuid4().hex[:6]}"
    spec = tmp_path / "lab.toml"
    spec.write_text(f'[lab]\nname = "{name}"\n[lab.memory]\nksm = false\n'
                    f'[network.lan]\nbridge = "vlbr-{name[-6:]}"\n'
                    f'[vm.a]\nmemory = "128M"\naccel = "tcg"\nkernel = "{test_guest}/vmlinuz"\n'
                    f'initrd = "{test_guest}/initrd.gz"\n[[vm.a.nic]]\nnetwork = "lan"\n')
    with netns_named() as netns:
        def ok(*args: str) -> str:
            done = netns.vmlaunch(args[0], str(spec), *args[1:], timeout=300)
            assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
            return done.stdout

        ok("up", "--wait-for", READY, "--timeout", "300")
        try:
            dot = ok("graph", "--live", "--format", "dot")
            assert f'fillcolor="{MARK_COLOURS[Mark.RUNNING][0]}"' in dot and "<BR/>running>" in dot
            ok("pause", "a")
            ok("link", "a", "lan", "down")
            dot = ok("graph", "--live", "--format", "dot")
            assert f'fillcolor="{MARK_COLOURS[Mark.PAUSED][0]}"' in dot and "<BR/>paused<BR/>" in dot
            assert f'color="{DOWN_COLOUR}"' in dot and "link down" in dot
            assert "  class vm0 paused" in ok("graph", "--live", "--format", "mermaid")
        finally:
            ok("down", "--timeout", "0")
        done = netns.vmlaunch("graph", str(spec), "--live", "--format", "dot")
        assert done.returncode == 0 and f"lab {name} is not up" in done.stderr
        assert f'fillcolor="{MARK_COLOURS[Mark.STOPPED][0]}"' in done.stdout
        assert "link down" not in done.stdout
