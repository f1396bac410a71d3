"""Sharded params and optimizer state for torch.optim's other optimizers, on 2 gloo ranks (CPU).

test_shard's problem and spawned-rank harness, one 2-rank run for everything here:

* the elementwise ones (RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop) and
  ``with_ema(adamw)`` under ``parallel=Sharded(mesh)`` -- each rank steps its own shards --
  against one process on the global batch, and against data parallelism on the same ranks;
* Muon and Adafactor, whose step needs whole matrices (Newton-Schulz) or whole statistics (row
  and column means, RMS norms): refused under ``Sharded`` with the alternatives named, and
  right when their ``update`` is called on DTensor params (DTensor's collectives gather).
"""

from __future__ import annotations

import time

import pytest
import ranks
import test_shard as ts
import torch
import torch._dynamo.testing
import torch.distributed as dist
from bitwise import assert_bitwise

import funcamp
import funcamp.distributed as fd

pytestmark = pytest.mark.distributed

STEPS = 8  # past ts.BAD_STEP (5): an overflow on the last rank only, skipped by every rank
WORLD = 2
TIMEOUT_S = 120


def _matrices(path: str) -> str:
    return "muon" if path in ("w1", "w2", "w") else "adamw"


def _muon():  # the usual pairing: Muon for the hidden matrices, AdamW for the rest
    return funcamp.multi_transform(
        {"muon": funcamp.muon(1e-2), "adamw": funcamp.adamw(1e-2)}, _matrices
    )


#: name -> the optimizer (hyper-parameters off their defaults where that exercises more).
ELEMENTWISE = {
    "rmsprop": lambda: funcamp.rmsprop(1e-2, momentum=0.5, centered=True, weight_decay=0.01),
    "adagrad": lambda: funcamp.adagrad(1e-1, lr_decay=0.01, initial_accumulator_value=0.1),
    "adadelta": lambda: funcamp.adadelta(1.0, weight_decay=0.01),
    "adamax": lambda: funcamp.adamax(1e-2, weight_decay=0.01),
    "nadam": lambda: funcamp.nadam(1e-2, weight_decay=0.01, decoupled_weight_decay=True),
    "radam": lambda: funcamp.radam(1e-2, weight_decay=0.01),
    "asgd": lambda: funcamp.asgd(1e-2, lambd=1e-3, t0=3),
    "rprop": lambda: funcamp.rprop(1e-2),
    "ema": lambda: funcamp.optim.with_ema(funcamp.adamw(1e-2, weight_decay=0.01), 0.9),
}
WHOLE = {"muon": _muon, "adafactor": lambda: funcamp.adafactor(1e-2, weight_decay=0.01)}


def _run(make, parallel, state, rank: int, world: int, compile=False) -> dict:
    step = funcamp.make_train_step(
        ts._loss_fn, make(), ts.POLICY, parallel=parallel, compile=compile, donate_state=False
    )
    try:
        state, metrics = ts._train(step, state, ts._batches(STEPS), rank, world)
    except ValueError as e:  # a refusal: what each rank saw
        return {"error": str(e)}
    return {"state": funcamp.state_dict(ts._full(state)), "metrics": metrics}


def _on_dtensors(make, mesh) -> dict:
    """``update`` called on DTensor params, grads and state (sharded along dim 0, as
    ``fd.shard`` does) against the same on plain tensors: the largest difference per leaf."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) for k, s in (("w", (5, 3)), ("b", (6,)))}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(3)]
    runs = []
    for shard in (lambda x: x, lambda x: distribute_tensor(x, mesh, [Shard(0)])):
        opt, ps = make(), {k: shard(v) for k, v in params.items()}
        state = opt.init(ps)
        for g in grads:
            updates, state = opt.update({k: shard(v) for k, v in g.items()}, state, ps)
            ps = funcamp.apply_updates(ps, updates)
        runs.append({k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ps.items()})
    plain, sharded = runs
    return {k: float((sharded[k] - plain[k]).abs().max()) for k in params}


def _worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ranks.init_rank(rank, world, out_dir, TIMEOUT_S)
    mesh = init_device_mesh("cpu", (world,))
    res: dict = {"seconds": {}}
    for name, make in {**ELEMENTWISE, **WHOLE}.items():
        t0 = time.monotonic()
        res[name] = _run(make, fd.Sharded(mesh), fd.shard(ts._init(make()), mesh), rank, world)
        if name in ELEMENTWISE:  # the same ranks, data parallel: the same reductions
            dp = fd.DataParallel(dist.group.WORLD)
            res[f"{name}_dp"] = _run(make, dp, ts._init(make()), rank, world)
        else:
            try:
                res[f"{name}_dtensor"] = _on_dtensors(make, mesh)
            except RuntimeError as e:  # DTensor's refusal of a plain operand, say
                res[f"{name}_dtensor"] = {"error": str(e)}
        res["seconds"][name] = time.monotonic() - t0
    compiled = funcamp.Compile(backend="aot_eager")  # the refusal from inside the graph
    res["muon_compiled"] = _run(
        _muon, fd.Sharded(mesh), fd.shard(ts._init(_muon()), mesh), rank, world, compiled
    )
    ranks.save_results(res, out_dir, rank)
    ranks.leave()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("shard_optimizers")
    args = [(r, WORLD, str(out_dir)) for r in range(WORLD)]
    preload = ["torch", "funcamp", __name__]
    t0 = time.monotonic()
    got = ranks.start(_worker, args, out_dir, preload=preload, timeout_s=TIMEOUT_S).results()
    print(f"{WORLD} ranks {time.monotonic() - t0:.1f}s {got[0]['seconds']}")
    return got


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_sharded_elementwise_optimizer_matches_one_process(runs, name):
    """Each rank steps its shards of the params and of the state; the whole state, gathered,
    is one process's on the global batch within test_shard's float32 tolerance (the ranks'
    gradients are summed in another order), through the overflow every rank skips; and it is
    data parallelism's on the same ranks bit for bit (the same reductions)."""
    step = funcamp.make_train_step(
        ts._loss_fn, ELEMENTWISE[name](), ts.POLICY, compile=False, donate_state=False
    )
    want, want_metrics = ts._train(step, ts._init(ELEMENTWISE[name]()), ts._batches(STEPS))
    want = funcamp.state_dict(want)
    for res in runs:
        got, dp = res[name], res[f"{name}_dp"]
        assert "error" not in got, got.get("error")
        ts._check(got["state"], got["metrics"], want, want_metrics, WORLD, STEPS)
        for part in ("params", "opt_state", "scaler"):
            assert_bitwise(got["state"][part], dp["state"][part])
    assert_bitwise(runs[1][name]["state"], runs[0][name]["state"])


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_whole_leaf_optimizers_refuse_shards_naming_the_alternatives(runs, name):
    """Under Sharded each rank would orthogonalise its own rows (Muon) or average over its own
    rows (Adafactor): wrong numbers, so every rank refuses, naming data parallelism and the
    update on DTensors (Muon's compiled step too, from inside the graph)."""
    what = {"muon": "Newton-Schulz orthogonalises whole matrices", "adafactor": "row and column"}
    for res, key in [(r, k) for r in runs for k in (name, f"{name}_compiled") if k in r]:
        error = res[key].get("error", "")
        assert f"funcamp.{name}: " in error and what[name] in error, res[key]
        assert "parallel=funcamp.distributed.DataParallel(group)" in error
        assert "update on DTensor params" in error


def test_whole_leaf_optimizers_on_dtensor_params(runs):
    """Their ``update`` on DTensor params (rows sharded, uneven): DTensor's collectives reduce
    Adafactor's column means and norms over the ranks -- one process's numbers within float32
    rounding -- and gather Newton-Schulz's matrix products -- within its bfloat16 rounding
    (the products are summed in blocks; a rank orthogonalising its own rows would be off by
    the step itself, about lr = 1e-2)."""
    for res in runs:
        assert "error" not in res["adafactor_dtensor"], res["adafactor_dtensor"]
        assert max(res["adafactor_dtensor"].values()) <= 1e-6, res["adafactor_dtensor"]
        assert res["muon_dtensor"]["b"] <= 1e-6  # AdamW's leaf
        assert res["muon_dtensor"]["w"] <= 2e-3, res["muon_dtensor"]


def test_whole_leaf_optimizers_run_on_a_one_rank_mesh(single_rank_group):
    """On one rank a shard is the whole leaf: Muon and Adafactor run under Sharded as without
    a mesh, bit for bit."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    for make in WHOLE.values():
        plain = _run(make, None, ts._init(make()), 0, 1)
        sharded = _run(make, fd.Sharded(mesh), fd.shard(ts._init(make()), mesh), 0, 1)
        assert "error" not in sharded, sharded
        assert_bitwise(sharded["state"], plain["state"])


@pytest.mark.slow
def test_muon_compiles_under_sharded_on_one_rank(single_rank_group):
    """Compiled (aot_eager), the check for shards is in the one graph: no break, no refusal."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1,))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    step = funcamp.make_train_step(
        ts._loss_fn, _muon(), ts.POLICY, parallel=fd.Sharded(mesh), donate_state=False,
        compile=funcamp.Compile(backend=counter),
    )  # fmt: skip
    state = fd.shard(ts._init(_muon()), mesh)
    for batch in ts._batches(2):
        state, _ = step(state, batch)
    assert counter.frame_count == 1
