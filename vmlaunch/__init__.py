"""vmlaunch: a declarative QEMU/KVM lab launcher.

The package's rooms, lowest first (ARCHITECTURE.md says what each holds; tests/test_layers.py keeps a
room from importing one above it): core/ and errors, layout/, qemu/, spec/, policy/, host/, guests/,
resources/, compile/, lab/, rig/ and manager/, saved/, runtime/, doctor/ and export/, multihost/, api,
cli/ and pytest_plugin, this package.

Kept tiny on purpose: the CLI imports this package first, so nothing heavy may be imported here. The
public API is resolved on first use by `__getattr__` below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers see; at run time `__getattr__` imports these on first use
    from vmlaunch.api import Lab, Vm, run
    from vmlaunch.errors import (
        AgentError,
        CommandTimedOut,
        GuestPanicked,
        GuestPaused,
        HostError,
        RuntimeFailure,
        SpecError,
        UsageError,
        VmlaunchError,
    )
    from vmlaunch.qemu.qmp import QmpError
    from vmlaunch.rig.agent import Result
    from vmlaunch.rig.guest import CommandFailed
    from vmlaunch.runtime.control import VmStatus

from vmlaunch.core.version import __version__

__all__ = [
    "AgentError",
    "CommandFailed",
    "CommandTimedOut",
    "GuestPanicked",
    "GuestPaused",
    "HostError",
    "Lab",
    "QmpError",
    "Result",
    "RuntimeFailure",
    "SpecError",
    "UsageError",
    "Vm",
    "VmStatus",
    "VmlaunchError",
    "__version__",
    "run",
]

# public name -> the module that defines it
_LAZY = {
    "Lab": "vmlaunch.api",
    "Vm": "vmlaunch.api",
    "run": "vmlaunch.api",
    "VmStatus": "vmlaunch.runtime.control",
    "VmlaunchError": "vmlaunch.errors",
    "SpecError": "vmlaunch.errors",
    "HostError": "vmlaunch.errors",
    "RuntimeFailure": "vmlaunch.errors",
    "UsageError": "vmlaunch.errors",
    "AgentError": "vmlaunch.errors",
    "CommandTimedOut": "vmlaunch.errors",
    "GuestPanicked": "vmlaunch.errors",
    "GuestPaused": "vmlaunch.errors",
    "CommandFailed": "vmlaunch.rig.guest",
    "QmpError": "vmlaunch.qemu.qmp",
    "Result": "vmlaunch.rig.agent",
}


def __getattr__(name: str) -> Any:
    """`vmlaunch.Lab` and the rest of `__all__` without importing the runtime at CLI start-up."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vmlaunch' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(module), name)
    globals()[name] = value  # found once; later lookups do not come back here
    return value


def __dir__() -> list[str]:
    """The public API and the module's own dunders, found or not yet."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
