"""The package's version: one place, read by setuptools, `--version` and the caches."""

__version__ = "0.1.0"
