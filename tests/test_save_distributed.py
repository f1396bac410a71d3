"""funcamp.save/load with a process group: through torch.distributed.checkpoint, on 2 gloo ranks.

One spawned run trains, saves (twice: the second replaces the first) and trains on; a second
spawned run -- fresh processes -- loads the checkpoint and trains the same steps: both end with the
same bits on every rank.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import ranks
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # preloaded by the fork server
from bitwise import assert_bitwise

import funcamp
import funcamp.testing

pytestmark = pytest.mark.distributed

WORLD = 2
BATCH = 8
POLICY = "bf16-mixed"
SAVED_AT = 3  # steps before the checkpoint
MORE = 2  # steps after it
TIMEOUT_S = 150


def _loss_fn(params, buffers, batch):
    x, y = batch
    buffers["seen"].add_(x.shape[0])
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(h @ params["w2"], y)


def _batch(i: int, rank: int):
    gen = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(BATCH, 4, generator=gen), torch.randn(BATCH, 1, generator=gen)
    if i == 1:
        x[-1, 0] = math.inf  # on the last rank's shard: every rank skips the step
    n = BATCH // WORLD
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _opt():
    return funcamp.adamw(1e-2)


def _init() -> funcamp.TrainState:
    gen = torch.Generator().manual_seed(1)
    params = {
        "w1": torch.randn(4, 8, generator=gen),
        "b1": torch.zeros(8),
        "w2": torch.randn(8, 1, generator=gen),
    }
    scaler = funcamp.ScalerState.dynamic(2.0**8, growth_interval=2)
    buffers = {"seen": torch.zeros((), dtype=torch.int64)}
    return funcamp.TrainState.create(params, _opt(), POLICY, buffers=buffers, scaler=scaler)


def _worker(rank: int, ckpt: str, out_dir: str, phase: str) -> None:
    ranks.init_rank(rank, WORLD, out_dir, TIMEOUT_S, tag=phase)
    pg = dist.group.WORLD
    step = funcamp.make_train_step(
        _loss_fn,
        _opt(),
        POLICY,
        parallel=funcamp.distributed.DataParallel(pg),
        compile=False,
        donate_state=False,
    )
    res: dict = {}
    if phase == "train":
        state = _init()
        for i in range(SAVED_AT):
            state, _ = step(state, _batch(i, rank))
            if i == SAVED_AT - 2:  # an earlier checkpoint, replaced by the next one
                funcamp.save(ckpt, state, policy=POLICY, group=pg, step=i + 1)
        funcamp.save(ckpt, state, policy=POLICY, group=pg, step=SAVED_AT)
        res["saved"] = funcamp.state_dict(state)
        try:
            funcamp.load(ckpt, _init(), policy="mixed_float16", group=pg)
            res["policy_error"] = None
        except ValueError as e:
            res["policy_error"] = str(e)
        start = SAVED_AT
    else:
        state = funcamp.load(ckpt, _init(), policy=POLICY, group=pg)
        res["loaded"] = funcamp.state_dict(state)
        start = funcamp.checkpoint_info(ckpt).metadata["step"]
    for i in range(start, SAVED_AT + MORE):
        state, _ = step(state, _batch(i, rank))
    res["final"] = funcamp.state_dict(state)
    ranks.save_results(res, out_dir, rank, tag=phase)
    ranks.leave()


def _spawn(ckpt: Path, out_dir: Path, phase: str) -> list[dict]:
    args = [(r, str(ckpt), str(out_dir), phase) for r in range(WORLD)]
    preload = ["torch", "torch.distributed.checkpoint", "funcamp", __name__]
    run = ranks.start(_worker, args, out_dir, preload=preload, timeout_s=TIMEOUT_S, tag=phase)
    return run.results()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dcp")
    ckpt = tmp / "ckpt"
    t0 = time.monotonic()
    trained = _spawn(ckpt, tmp, "train")
    t1 = time.monotonic()
    resumed = _spawn(ckpt, tmp, "resume")
    print(f"train {t1 - t0:.1f}s resume {time.monotonic() - t1:.1f}s")
    return {"ckpt": ckpt, "trained": trained, "resumed": resumed}


def test_resumed_on_two_ranks_bit_for_bit(runs):
    trained, resumed = runs["trained"], runs["resumed"]
    for rank in range(WORLD):
        assert_bitwise(resumed[rank]["loaded"], trained[rank]["saved"])
        assert_bitwise(resumed[rank]["final"], trained[rank]["final"])
    assert_bitwise(trained[0]["final"], trained[1]["final"])  # data parallel: one state
    assert int(trained[0]["final"]["scaler"]["skipped"]) == 1  # the overflow at step 1
    assert int(trained[0]["final"]["buffers"]["seen"]) == (SAVED_AT + MORE) * BATCH // WORLD


def test_layout_and_records(runs):
    ckpt = runs["ckpt"]
    names = sorted(p.name for p in ckpt.iterdir())
    assert len(names) == 2 and names[0].startswith("data-") and names[1] == "funcamp.pt"
    info = funcamp.checkpoint_info(ckpt)
    assert info.world_size == WORLD and info.metadata == {"step": SAVED_AT}
    assert info.policy == str(funcamp.get_policy(POLICY)) and info.scaler_kind == "dynamic"


def test_a_different_policy_is_refused_on_every_rank(runs):
    for res in runs["trained"]:
        assert res["policy_error"].startswith("funcamp.load: ")
        assert (
            "saved under policy 'params=float32,compute=bfloat16,output=float32'"
            in res["policy_error"]
        )


def test_loads_into_one_process_without_a_group(runs):
    state = funcamp.load(runs["ckpt"], _init(), policy=POLICY)
    assert_bitwise(funcamp.state_dict(state), runs["trained"][0]["saved"])


def test_group_is_checked(single_rank_group, tmp_path):
    with pytest.raises(
        TypeError, match=r"funcamp.save: `group` must be a torch.distributed.ProcessGroup"
    ):
        funcamp.save(tmp_path / "c", _init(), policy=POLICY, group="world")
    funcamp.save(tmp_path / "file.pt", _init(), policy=POLICY)
    with pytest.raises(
        NotADirectoryError, match=r"funcamp.save: with `group`, `path` is a directory"
    ):
        funcamp.save(tmp_path / "file.pt", _init(), policy=POLICY, group=single_rank_group)
    with pytest.raises(NotADirectoryError, match=r"funcamp.load: with `group`, .* is a file"):
        funcamp.load(tmp_path / "file.pt", _init(), group=single_rank_group)


def test_a_sharded_state_without_a_group_says_what_to_do(single_rank_group, tmp_path):
    """Without `group`, a state of DTensors is a funcamp.save error naming the fix (it was
    torch's ".numpy() is not supported for tensor subclasses" from inside the checksum)."""
    from torch.distributed.device_mesh import init_device_mesh

    state = funcamp.distributed.shard(_init(), init_device_mesh("cpu", (1,)))
    with pytest.raises(
        ValueError,
        match=r"funcamp\.save: `state` leaf state\.params\['b1'\] is a DTensor .* needs "
        r"`group`: call funcamp\.save\(directory, state, policy=\.\.\., group=mesh\.get_group\(\)\)",
    ):
        funcamp.save(tmp_path / "c.pt", state, policy=POLICY)
    assert list(tmp_path.iterdir()) == []  # nothing written
    funcamp.save(tmp_path / "c", state, policy=POLICY, group=single_rank_group)  # the fix


def test_a_full_disk_at_the_commit_is_an_oserror_and_with_info_reads_the_header(
    single_rank_group, tmp_path, monkeypatch
):
    import errno
    import os

    import funcamp._core.atomic as atomic

    funcamp.save(tmp_path / "c", _init(), policy=POLICY, group=single_rank_group, step=1)
    state, info = funcamp.load(tmp_path / "c", _init(), policy=POLICY, with_info=True)
    assert_bitwise(funcamp.state_dict(state), funcamp.state_dict(_init()))
    assert info == funcamp.checkpoint_info(tmp_path / "c") and info.metadata == {"step": 1}

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    real_fdopen = os.fdopen  # only atomic_write uses it: the header's commit fails
    monkeypatch.setattr(atomic.os, "fdopen", lambda *a, **k: Full(real_fdopen(*a, **k)))
    with pytest.raises(OSError) as caught:
        funcamp.save(tmp_path / "c", _init(), policy=POLICY, group=single_rank_group, step=2)
    monkeypatch.undo()
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / "c")
    assert funcamp.checkpoint_info(tmp_path / "c").metadata == {"step": 1}  # the previous one
    assert os.path.isdir(tmp_path / "c")
