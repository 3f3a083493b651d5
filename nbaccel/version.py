"""nbaccel's version, importable without loading the package's lazy exports."""

__all__ = ["__version__"]

__version__ = "0.1.0"
