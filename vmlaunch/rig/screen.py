"""A running VM's screen and keyboard: a screenshot as PNG (QMP `screendump`) and keys (QMP `send-key`).

The screen is the VM's display device (`video` in the spec). QEMU runs confined, under a uid of its
own that cannot open the user's folders, so it never opens the screenshot's path: vmlaunch creates
the file (a temp file beside it, as the user), hands QEMU a write-only descriptor of it over the QMP
socket (`add-fd`, SCM_RIGHTS) and names it `/dev/fdset/N`; the PNG is checked and renamed into place.

Keys are QEMU's qcodes (`ctrl`, `alt`, `delete`, `ret`, `a`, `f1`, `kp_add`, ...; QKEYCODES is the
list of QEMU 7.2), with common aliases (`enter`, `esc`, `del`, `space`, `super`, ...). A combination
is one string, keys joined by `-` (`ctrl-alt-delete`), pressed in order and released together. Text
is typed as keys of a US keyboard layout: shift for capitals and symbols.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from vmlaunch.core.fsutil import Unfit, check_new_target, fsync_dir
from vmlaunch.errors import OutputRefused, RuntimeFailure, UsageError
from vmlaunch.lab.running import running_pid
from vmlaunch.layout.rundir import RunDir
from vmlaunch.qemu.qmp import QmpError, QuickQmp

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
QMP_TIMEOUT = 10.0

# QEMU's QKeyCode enum (qapi/ui.json) as QEMU 7.2 has it, in its order; `unmapped` is no key.
_QKEYCODE_TEXT = """
shift shift_r alt alt_r ctrl ctrl_r menu esc 1 2 3 4 5 6 7 8 9 0 minus equal backspace tab q w e r t y u
i o p bracket_left bracket_right ret a s d f g h j k l semicolon apostrophe grave_accent backslash z x c v
b n m comma dot slash asterisk spc caps_lock f1 f2 f3 f4 f5 f6 f7 f8 f9 f10 num_lock scroll_lock kp_divide
kp_multiply kp_subtract kp_add kp_enter kp_decimal sysrq kp_0 kp_1 kp_2 kp_3 kp_4 kp_5 kp_6 kp_7 kp_8 kp_9
less f11 f12 print home pgup pgdn end left up down right insert delete stop again props undo front copy
open paste find cut lf help meta_l meta_r compose pause ro hiragana henkan yen muhenkan katakanahiragana
kp_comma kp_equals power sleep wake audionext audioprev audiostop audioplay audiomute volumeup volumedown
mediaselect mail calculator computer ac_home ac_back ac_forward ac_refresh ac_bookmarks lang1 lang2
"""
QKEYCODES = frozenset(_QKEYCODE_TEXT.split())

ALIASES = {
    "enter": "ret", "return": "ret", "space": "spc", "escape": "esc", "del": "delete", "ins": "insert",
    "bksp": "backspace", "control": "ctrl", "lctrl": "ctrl", "rctrl": "ctrl_r", "lalt": "alt",
    "ralt": "alt_r", "altgr": "alt_r", "lshift": "shift", "rshift": "shift_r", "super": "meta_l",
    "win": "meta_l", "meta": "meta_l", "cmd": "meta_l", "pageup": "pgup", "page_up": "pgup",
    "pagedown": "pgdn", "page_down": "pgdn", "capslock": "caps_lock", "numlock": "num_lock",
    "scrolllock": "scroll_lock", "printscreen": "print", "prtsc": "print", "sysreq": "sysrq",
    "backtick": "grave_accent", "grave": "grave_accent", "period": "dot", "-": "minus", "=": "equal",
    ".": "dot", ",": "comma", "/": "slash", ";": "semicolon", "'": "apostrophe", "`": "grave_accent",
    "\\": "backslash", "[": "bracket_left", "]": "bracket_right",
}

# What each character is on a US keyboard: the key, and whether shift is held.
_UNSHIFTED = {" ": "spc", "\n": "ret", "\r": "ret", "\t": "tab", "\b": "backspace", "\x1b": "esc",
              "-": "minus", "=": "equal", "[": "bracket_left", "]": "bracket_right", "\\": "backslash",
              ";": "semicolon", "'": "apostrophe", "`": "grave_accent", ",": "comma", ".": "dot",
              "/": "slash"}
_SHIFTED = {"!": "1", "@": "2", "#": "3", "$": "4", "%": "5", "^": "6", "&": "7", "*": "8", "(": "9",
            ")": "0", "_": "minus", "+": "equal", "{": "bracket_left", "}": "bracket_right",
            "|": "backslash", ":": "semicolon", '"': "apostrophe", "~": "grave_accent", "<": "comma",
            ">": "dot", "?": "slash"}


def key_of(name: str, combination: str) -> str:
    """The qcode of one key name (a qcode, an alias, or one character); UsageError naming it."""
    lowered = name.lower()
    if lowered in QKEYCODES:
        return lowered
    if lowered in ALIASES:
        return ALIASES[lowered]
    where = f" in {combination!r}" if combination != name else ""
    raise UsageError(f"unknown key {name!r}{where}",
                     "keys are QEMU's qcodes (ctrl, alt, shift, delete, ret, esc, tab, spc, a-z, 0-9, "
                     "f1-f12, up, pgdn, kp_add, ...) or aliases (enter, space, del, super); join a "
                     "combination with -: ctrl-alt-delete; text is typed with text= (--text)")


def combination(text: str) -> tuple[str, ...]:
    """`ctrl-alt-delete` -> ("ctrl", "alt", "delete"); `-` alone is the minus key."""
    if text == "-":
        return ("minus",)
    parts = text.split("-")
    if any(not part for part in parts):
        raise UsageError(f"{text!r} is not a key combination (an empty key name)",
                         "name keys joined by -: ctrl-alt-delete; the minus key is `minus`: ctrl-minus")
    return tuple(key_of(part, text) for part in parts)


def typed(text: str) -> list[tuple[str, ...]]:
    """The combinations that type `text` on a US layout, one per character."""
    keys: list[tuple[str, ...]] = []
    for index, char in enumerate(text):
        if "a" <= char <= "z" or "0" <= char <= "9":
            keys.append((char,))
        elif "A" <= char <= "Z":
            keys.append(("shift", char.lower()))
        elif char in _UNSHIFTED:
            keys.append((_UNSHIFTED[char],))
        elif char in _SHIFTED:
            keys.append(("shift", _SHIFTED[char]))
        else:
            raise UsageError(f"cannot type {char!r} (character {index + 1} of the text) on a US keyboard",
                             "type ASCII text; send other keys by name (send_keys(\"alt_r-e\"))")
    return keys


def keys_to_send(keys: Iterable[str], text: str | None) -> list[tuple[str, ...]]:
    """Every combination to send, checked before any is sent: `keys`, then `text` typed."""
    combos = [combination(key) for key in keys]
    if text:
        combos += typed(text)
    if not combos:
        raise UsageError("no keys to send", "name keys (ctrl-alt-delete) or give text")
    return combos


def send_keys(run_dir: RunDir, name: str, combos: Sequence[tuple[str, ...]],
              hold_ms: int | None = None) -> int:
    """Send each combination with QMP `send-key` (pressed in order, held `hold_ms`, QEMU's default
    100 ms when None, released); returns how many. QEMU queues the key events and plays them out at
    its own pace, so this returns before a long text has reached the guest."""
    running_pid(run_dir, name)
    hold = {"hold-time": hold_ms} if hold_ms is not None else {}
    with QuickQmp(run_dir.vm(name).qmp, timeout=QMP_TIMEOUT) as qmp:
        for combo in combos:
            qmp.cmd("send-key", keys=[{"type": "qcode", "data": key} for key in combo], **hold)
    return len(combos)


def screenshot(run_dir: RunDir, name: str, path: Path) -> Path:
    """Write the VM's screen to `path` as a PNG, atomically; returns the absolute path. RuntimeFailure
    when the VM is not running or has no screen; OutputRefused when something other than a regular
    file stands at `path` (a FIFO, a device, a folder, a symlink: never written through nor
    replaced); OSError when `path` cannot be written."""
    running_pid(run_dir, name)
    path = Path(os.path.abspath(path))
    if not path.parent.is_dir():
        raise UsageError(f"{path.parent}: no such folder")
    _check_target(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # write-only: QEMU's /dev/fdset/N open for writing matches only a descriptor opened O_WRONLY
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        try:
            _dump(run_dir, name, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        _check_png(tmp, name)
        _check_target(path)  # again: the dump took a while
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)
    return path


def _check_target(path: Path) -> None:
    try:
        check_new_target(path)
    except Unfit as exc:
        raise OutputRefused.of(exc) from None


def _dump(run_dir: RunDir, name: str, fd: int) -> None:
    with QuickQmp(run_dir.vm(name).qmp, timeout=QMP_TIMEOUT) as qmp:
        fdset = qmp.add_fd(fd)
        try:
            qmp.cmd("screendump", filename=f"/dev/fdset/{fdset}", format="png")
        except QmpError as exc:
            if "no console" in exc.message:
                raise no_screen(name) from None
            raise
        finally:
            with contextlib.suppress(QmpError):
                qmp.remove_fd(fdset)


def no_screen(name: str) -> RuntimeFailure:
    return RuntimeFailure(f"VM {name} has no screen to capture (video = \"none\", or a machine without VGA)",
                          f"set video = \"std\" in [vm.{name}] and bring the VM up again")


def _check_png(path: Path, name: str) -> None:
    with open(path, "rb") as png:
        head = png.read(len(PNG_SIGNATURE))
    if head != PNG_SIGNATURE:
        raise RuntimeFailure(f"QEMU's screendump of VM {name} is not a PNG ({len(head)} bytes start it)",
                             "a QEMU of 7.1 or later writes PNG")
