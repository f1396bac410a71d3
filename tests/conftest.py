"""Fixtures shared by several test modules."""

import devices
import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def test_device() -> torch.device:
    """The device of the parity suites (``@pytest.mark.device_parity``): ``FUNCAMP_TEST_DEVICE``
    (unset: the CPU; ``cuda``: the first GPU, and a skip naming the variable when torch sees
    none; any other value: an error naming the variable). See tests/devices.py."""
    device_type = devices.requested()
    reason = devices.unavailable(device_type)
    if reason is not None:
        pytest.skip(reason)
    return torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)


def pytest_report_header(config):
    try:
        return f"funcamp test device ({devices.ENV}): {devices.requested()}"
    except ValueError as e:
        return f"funcamp test device: {e}"


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    for tiny models, two threads on shared cores make every autocast cast an OpenMP region that
    costs milliseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    """Under pytest-xdist (``-n 2``, with ``--dist loadgroup`` from the root conftest.py), the tests
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
    # Slow tests first: xdist hands out the rest in collection order, so a slow test collected
    # late would leave the other worker idle at the end. (Groups go first anyway: xdist orders
    # them by their number of tests.)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
