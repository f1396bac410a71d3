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
