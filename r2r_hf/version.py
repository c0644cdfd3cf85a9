"""The package version, in one place (the package root, the model card and the CLI read it)."""

__version__ = "0.2.0"
