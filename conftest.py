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


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Tell each xdist worker that the run groups: a worker parses the command line again
    (``-n 2``, no ``--dist``) and sets its ``loadgroup`` option before this file's
    ``pytest_cmdline_main`` could run there, so without this it never tags its tests with their
    group, and every test of a group is scheduled alone (a module's fixture built once per
    worker, and again after each test of another module in between)."""
    node.workerinput["funcamp_loadgroup"] = node.config.option.dist == "loadgroup"


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and workerinput.get("funcamp_loadgroup"):
        config.option.loadgroup = True  # read by xdist's worker when it collects
