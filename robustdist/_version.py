"""The package version, single-sourced for pyproject.toml and the CLI."""

__version__ = "0.1.0"
