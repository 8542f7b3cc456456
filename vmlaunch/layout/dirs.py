"""Where vmlaunch keeps things (the cache, run dirs), and the rule every directory it uses must meet.

The rule (the manual: Safety, "On a shared host"): a directory vmlaunch creates or writes in is owned by the
invoking user (or root) and writable by nobody else; every directory above it is owned by the user or
root and, if others may write in it, sticky (like /tmp); no symlink on the way belongs to anyone else.
Without it another user could create the run root first (the fallback under /tmp is predictable) and
swap a console socket, or plant a link for root to write through.
"""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from pathlib import Path

from vmlaunch.errors import HostError

MAX_LINKS = 40  # as the kernel's path walk


class UnsafeDirectory(HostError):
    """A directory another user could change under vmlaunch."""


def cache_dir() -> Path:
    """VMLAUNCH_CACHE_DIR, else $XDG_CACHE_HOME/vmlaunch, else ~/.cache/vmlaunch."""
    if os.environ.get("VMLAUNCH_CACHE_DIR"):
        return Path(os.environ["VMLAUNCH_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vmlaunch"


def usable_cache_dir(sub: str = "") -> Path | None:
    """The cache dir (or its folder `sub`) when it passes the ownership rule (made if missing), else
    None: another user's cache could name the QEMU binary vmlaunch runs, or mark a spec as checked,
    so it is neither read nor written."""
    return _usable(cache_dir(), sub)


@functools.lru_cache(maxsize=8)
def _usable(top: Path, sub: str) -> Path | None:  # once per path and process: one warning, not many
    path = top / sub if sub else top
    try:
        secure_dir(path, top=top, create=True, setting="VMLAUNCH_CACHE_DIR")
        return path
    except (UnsafeDirectory, OSError) as exc:
        import logging

        logging.getLogger(__name__).warning("not using the cache: %s", exc)
        return None


def log_root() -> Path:
    """Where `down` keeps each VM's logs of its last run: VMLAUNCH_LOG_DIR, /var/log/vmlaunch as
    root, else $XDG_STATE_HOME/vmlaunch/logs (~/.local/state/vmlaunch/logs)."""
    if os.environ.get("VMLAUNCH_LOG_DIR"):
        return Path(os.environ["VMLAUNCH_LOG_DIR"])
    if os.geteuid() == 0:
        return Path("/var/log/vmlaunch")
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "vmlaunch" / "logs"


def run_root() -> Path:
    """Where labs keep their run dirs: VMLAUNCH_RUN_DIR, /run/vmlaunch as root, else XDG_RUNTIME_DIR
    (without one, as under sudo, su or cron: /tmp/vmlaunch-UID, which `secure_dir` checks is ours)."""
    if os.environ.get("VMLAUNCH_RUN_DIR"):
        return Path(os.environ["VMLAUNCH_RUN_DIR"])
    if os.geteuid() == 0:
        return Path("/run/vmlaunch")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/vmlaunch-{os.geteuid()}"
    return Path(runtime) / "vmlaunch"


def _owner(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _refuse(path: str, problem: str, setting: str) -> UnsafeDirectory:
    return UnsafeDirectory(
        f"refusing to use {path}: {problem}; another user could change what vmlaunch reads and writes "
        "there", f"if it is not yours, have its owner or root remove it; or set {setting} to a "
        "directory only you can write (e.g. under $XDG_RUNTIME_DIR or your home)")


def _check_one(path: str, st: os.stat_result, own: bool, setting: str) -> None:
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "it"
        raise _refuse(path, f"{kind} is owned by {_owner(st.st_uid)}, not by you or root", setting)
    if stat.S_ISLNK(st.st_mode):
        return
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "it is not a directory", setting)
    writable_by_others = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if own and (writable_by_others or st.st_uid != me):
        why = "others may write in it" if writable_by_others else f"it is owned by {_owner(st.st_uid)}"
        raise _refuse(path, f"{why} (mode {stat.S_IMODE(st.st_mode):04o})", setting)
    if writable_by_others and not st.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"others may write in it and it is not sticky "
                      f"(mode {stat.S_IMODE(st.st_mode):04o})", setting)


def secure_dir(path: Path, *, top: Path, create: bool, setting: str = "VMLAUNCH_RUN_DIR",
               _depth: int = 0) -> bool:
    """Check `path` and every directory above it against the rule; with `create`, make what is
    missing (mode 0700). `top` is where vmlaunch's own directories begin: it and everything under it
    must be the user's own and writable by them alone. Returns whether `path` exists."""
    path = Path(os.path.abspath(path))
    top = Path(os.path.abspath(top))
    parts = path.parts
    current = Path(parts[0])
    for part in parts[1:]:
        current = current / part
        own = current == top or top in current.parents
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            if not create:
                return False
            with contextlib.suppress(FileExistsError):  # made by another vmlaunch just now: checked
                os.mkdir(current, 0o700)
            st = os.lstat(current)
        _check_one(str(current), st, own, setting)
        if stat.S_ISLNK(st.st_mode):
            if own:
                raise _refuse(str(current), "it is a symlink; vmlaunch's own directories must not be",
                              setting)
            # A link the user or root made above vmlaunch's own: what it names must pass the rule,
            # one link at a time (a link it names is checked like this one).
            if _depth >= MAX_LINKS:
                raise _refuse(str(path), "too many levels of symbolic links", setting)
            target = Path(os.path.normpath(current.parent / os.readlink(current)))
            return secure_dir(target / path.relative_to(current), top=target / top.relative_to(current),
                              create=create, setting=setting, _depth=_depth + 1)
    return True
