"""vmlaunch: a declarative QEMU/KVM lab launcher.

Kept tiny on purpose: the CLI imports this package first, so nothing heavy may be imported here.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Lab", "__version__"]


def __getattr__(name: str) -> Any:
    """`vmlaunch.Lab` without importing the runtime at CLI start-up."""
    if name == "Lab":
        from vmlaunch.api import Lab

        return Lab
    raise AttributeError(f"module 'vmlaunch' has no attribute {name!r}")
