"""Test-run settings shared by tests/ and the package doctests.

Hypothesis' default 200 ms deadline measures wall time, which on a shared 2-core CI machine says
more about the neighbours than about the code (and the first call of a test may trace or compile):
the suite runs without deadlines. Every other Hypothesis default stays.
"""

import pytest
from hypothesis import settings

settings.register_profile("funcamp-ci", deadline=None)
settings.load_profile("funcamp-ci")


@pytest.hookimpl(tryfirst=True)  # before xdist's own (tryfirst too: a conftest's runs first)
def pytest_cmdline_main(config):
    """``-n 2`` runs pytest-xdist's workers with ``--dist loadgroup``: the tests of a group (a
    module's shared compiled step, tests/conftest.py) go to one worker. Set here, not in
    pyproject's addopts, so that a plain ``python -m pytest tests/test_x.py`` needs no xdist.
    An explicit ``--dist`` wins; xdist's own hook would turn ``-n`` alone into ``--dist load``."""
    option = config.option
    if getattr(option, "numprocesses", None) and getattr(option, "dist", "no") == "no":
        option.dist = "loadgroup"
