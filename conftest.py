"""Test-run settings shared by tests/ and the package doctests.

Hypothesis' default 200 ms deadline measures wall time, which on a shared 2-core CI machine says
more about the neighbours than about the code (and the first call of a test may trace or compile):
the suite runs without deadlines. Every other Hypothesis default stays.
"""

from hypothesis import settings

settings.register_profile("funcamp-ci", deadline=None)
settings.load_profile("funcamp-ci")
