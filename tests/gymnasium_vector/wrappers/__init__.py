"""Gymnasium's tests/wrappers/vector/, ported (license and source: tests/gymnasium_vector/__init__.py)."""
