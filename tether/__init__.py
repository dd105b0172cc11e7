"""tether: the CLI, its settings and the launcher (`tether serve | daemon | proxy | cluster`)."""

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here
