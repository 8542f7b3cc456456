"""vmlaunch: a declarative QEMU/KVM lab launcher.

Kept tiny on purpose: the CLI imports this package first, so nothing heavy may be imported here.
"""

__version__ = "0.1.0"
