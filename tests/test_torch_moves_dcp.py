"""A sharded run moves between FSDP2 and funcamp through ``torch.distributed.checkpoint``, on 2
gloo ranks, and goes on as the run that never moved, bit for bit.

FSDP2 -> funcamp: an FSDP2 run (tests/test_fsdp_equivalence.py's model, ``MixedPrecisionPolicy``
bfloat16, ``AdamW(fused=True)``, a StepLR) saves ``get_model_state_dict`` and
``get_optimizer_state_dict`` with ``dcp.save`` and goes on; a fresh FSDP2 model and optimizer
load the checkpoint the way torch's recipe does (``dcp.load`` + ``set_state_dict``),
``TrainState.from_torch`` takes them, ``funcamp.distributed.shard`` shards the state, and
``parallel=Sharded(mesh)`` steps on: every step's params equal FSDP2's.

funcamp -> FSDP2: a funcamp sharded run saves with ``funcamp.save(..., group=)`` and goes on; a
fresh template loads the checkpoint (``funcamp.load(..., group=)``), ``to_torch`` writes it into
a fresh FSDP2 model, optimizer and scheduler, and FSDP2 steps on: every step's params equal
funcamp's. Then torch's own DCP reads funcamp's checkpoint data by the documented keys.
"""

from __future__ import annotations

import warnings

import pytest
import ranks
import test_fsdp_equivalence as fe
import torch
import torch.distributed as dist
from bitwise import assert_bitwise

import funcamp
import funcamp.distributed as fd

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 4  # on each side of a move
TIMEOUT_S = 300
POLICY = "fsdp_bfloat16"
LR = fe.LR


def _fsdp(mesh):
    """FSDP2's objects, as tests/test_fsdp_equivalence.py builds them, plus a StepLR."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = fe._model()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return model, opt, sched


def _fsdp_steps(objs, batches, rank: int) -> list[dict]:
    model, opt, sched = objs
    out = []
    for batch in batches:
        x, y = fe._shard(batch, rank, WORLD)
        fe._loss(model(x), model.temperature, y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        out.append({n: p.full_tensor().clone() for n, p in model.named_parameters()})
    return out


def _funcamp_steps(state, opt, mesh, batches, rank: int) -> tuple[object, list[dict]]:
    model = fe._model()  # a plain module for functional_call (FSDP2's runs its own hooks)

    def loss_fn(params, buffers, batch):
        x, y = batch
        logits = torch.func.functional_call(model, (params, buffers), (x,))
        return fe._loss(logits, buffers["temperature"], y)

    step = funcamp.make_train_step(loss_fn, opt, POLICY, parallel=fd.Sharded(mesh), compile=False)
    out = []
    for batch in batches:
        state, _ = step(state, fe._shard(batch, rank, WORLD))
        out.append(fe._full(state.params))
    return state, out


def _torch_dcp(objs):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, opt, _ = objs
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _from_fsdp(mesh, rank: int, path: str, batches) -> dict:
    """FSDP2 saves at STEPS and goes on; funcamp resumes from the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    objs = _fsdp(mesh)
    _fsdp_steps(objs, batches[:STEPS], rank)
    dcp.save(_torch_dcp(objs), checkpoint_id=path)
    sched_sd = objs[2].state_dict()  # a scheduler holds no tensors: saved as the user does
    want = _fsdp_steps(objs, batches[STEPS:], rank)
    # a fresh process's view: new FSDP2 objects loaded by torch's recipe
    model, opt, sched = fresh = _fsdp(mesh)
    sd = _torch_dcp(fresh)
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sched.load_state_dict(sched_sd)
    state, fopt = funcamp.TrainState.from_torch(model, opt, POLICY, scheduler=sched)
    state = fd.shard(state, mesh)
    _, got = _funcamp_steps(state, fopt, mesh, batches[STEPS:], rank)
    return {"want": want, "got": got}


def _to_fsdp(mesh, rank: int, path: str, batches) -> dict:
    """funcamp saves at STEPS and goes on; FSDP2 resumes from funcamp's checkpoint."""
    import torch.distributed.checkpoint as dcp

    model, opt, sched = _fsdp(mesh)  # the run's torch objects, translated
    start, fopt = funcamp.TrainState.from_torch(model, opt, POLICY, scheduler=sched)
    state, _ = _funcamp_steps(fd.shard(start, mesh), fopt, mesh, batches[:STEPS], rank)
    funcamp.save(path, state, policy=POLICY, group=dist.group.WORLD)
    saved = fe._full({"params": state.params, "exp_avg": state.opt_state.exp_avg})
    _, want = _funcamp_steps(state, fopt, mesh, batches[STEPS:], rank)
    objs = _fsdp(mesh)  # a fresh process's view: new objects, a template built from them
    template = fd.shard(funcamp.TrainState.from_torch(objs[0], objs[1], POLICY)[0], mesh)
    loaded = funcamp.load(path, template, policy=POLICY, group=dist.group.WORLD)
    loaded.to_torch(*objs[:2], scheduler=objs[2])
    got = _fsdp_steps(objs, batches[STEPS:], rank)
    # torch's DCP reads funcamp's data by the documented keys (the header names the directory)
    header = torch.load(f"{path}/funcamp.pt", weights_only=True)
    read = {
        "params/head.weight": torch.empty(fe.CLASSES, fe.D),
        "opt_state/exp_avg/head.weight": torch.empty(fe.CLASSES, fe.D),
        "opt_state/count": torch.empty((), dtype=torch.int32),
    }
    dcp.load(read, checkpoint_id=f"{path}/{header['data']}")
    return {"want": want, "got": got, "read": read, "saved": saved}


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ranks.init_rank(rank, WORLD, out_dir, TIMEOUT_S)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (WORLD,))
    batches = fe._batches(False)[: 2 * STEPS]
    res = {
        "from": _from_fsdp(mesh, rank, f"{out_dir}/torch_ckpt", batches),
        "to": _to_fsdp(mesh, rank, f"{out_dir}/funcamp_ckpt", batches),
    }
    ranks.save_results(res, out_dir, rank)
    ranks.leave()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("moves_dcp")
    preload = ["torch", "torch.distributed.fsdp", "funcamp", fe.__name__, __name__]
    args = [(r, str(out_dir)) for r in range(WORLD)]
    run = ranks.start(_worker, args, out_dir, preload=preload, timeout_s=TIMEOUT_S)
    return run.results()


def test_fsdp2_checkpoint_resumes_in_funcamp(results) -> None:
    for res in results:
        assert_bitwise(res["from"]["got"], res["from"]["want"])


def test_funcamp_checkpoint_resumes_in_fsdp2(results) -> None:
    for res in results:
        assert_bitwise(res["to"]["got"], res["to"]["want"])


def test_torch_reads_funcamp_checkpoint_by_its_keys(results) -> None:
    saved, read = results[0]["to"]["saved"], results[0]["to"]["read"]
    assert torch.equal(read["params/head.weight"], saved["params"]["head.weight"])
    assert torch.equal(read["opt_state/exp_avg/head.weight"], saved["exp_avg"]["head.weight"])
    assert int(read["opt_state/count"]) == STEPS
