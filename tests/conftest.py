"""Fixtures shared by several test modules."""

import pytest
import torch.distributed as dist


@pytest.fixture
def single_rank_group():
    """A 1-rank gloo process group in this process (functional collectives run for real)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


_SHARED_SCOPES = ("class", "module", "package")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2``, with ``--dist loadgroup`` from pyproject's addopts), the tests
    that request a module-scoped fixture of their module -- a compiled step, a spawned distributed
    run -- go to one worker together, so that the fixture is built once; every other test goes
    wherever a worker is free. Autouse fixtures (a thread-count setting) do not group."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:  # doctests
            continue
        autouse = set(info.initialnames) - set(info.argnames)
        for name in info.names_closure:
            defs = info.name2fixturedefs.get(name)
            if name in autouse or not defs or defs[-1].scope not in _SHARED_SCOPES:
                continue
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
            break
