"""funcamp's version (read by the façade, checkpoints and the step cache)."""

__version__ = "0.1.0"
