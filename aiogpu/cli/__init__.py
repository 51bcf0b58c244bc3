"""Implementations of ``python -m aiogpu demo | bench``."""
