"""Hypothesis, the one optional dependency of funcamp.testing, imported with an error that says
what to install."""

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "funcamp.testing needs Hypothesis, which is not installed; install it with "
        "`pip install funcamp[testing]` (or `pip install hypothesis`)"
    ) from e

__all__ = ["st"]
