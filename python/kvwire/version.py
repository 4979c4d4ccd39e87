"""The package version (``kvwire.__version__``), read by the build (pyproject) and written
into every header's ``Producer`` by default."""

__version__ = "0.1.0"
