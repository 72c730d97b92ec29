"""The opencann version: one place, read by the package and written into model files."""
__version__ = "0.1.0"
