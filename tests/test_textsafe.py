"""Guest text inside vmlaunch's own messages: escapes out, progress lines short and cut at a word."""

from __future__ import annotations

import pytest

from vmlaunch.core.textsafe import last_line, printable


def test_printable_takes_out_escapes_and_controls() -> None:
    assert printable("a\x1b[31mred\x1b[0m\x1b]0;title\x07\r\x9b2J\u202eb\tc\n") == "aredb\tc\n"


@pytest.mark.parametrize(("text", "shown"), [
    ("", ""),
    ("\n\n", ""),
    ("first\nlast\n\n", "last"),
    ("login: \x1b[1mroot\x1b[0m\n\x1b[K\n", "login: root"),
    ("Loading 10%\rLoading 55%\r", "Loading 55%"),  # a redrawn line, as it shows last
    ("[    1.234567] Run /init as init process", "[ 1.234567] Run /init as init process"),
    ("[    2.000000] Freeing unused kernel image (initmem) memory: 2716K and more words",
     "[ 2.000000] Freeing unused kernel image (initmem)..."),  # cut at a word
    ("x" * 80, "x" * 57 + "..."),  # one long word: cut inside it
])
def test_last_line(text: str, shown: str) -> None:
    assert last_line(text) == shown
    assert len(last_line(text)) <= 60
