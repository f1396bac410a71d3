"""Sharded params and optimizer state for torch.optim's other optimizers, on 2 gloo ranks (CPU).

test_shard's problem and spawned-rank harness, one 2-rank run for everything here:

* the elementwise ones (RMSprop, Adagrad, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop) and
  ``with_ema(adamw)`` under ``parallel=Sharded(mesh)`` -- each rank steps its own shards --
  against one process on the global batch, and against data parallelism on the same ranks;
* Muon and Adafactor, whose step needs whole matrices (Newton-Schulz) or whole statistics (row
  and column means, RMS norms): under ``Sharded`` Muon all-gathers each matrix and Adafactor
  all-reduces its partial sums, so both match one process, sharded along dim 0 or dim 1, eager
  and compiled (one graph); their ``update`` called on DTensor params is right too (DTensor's
  collectives gather).
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
from exhaustive import exhaustive

import funcamp
import funcamp.distributed as fd

pytestmark = pytest.mark.distributed

STEPS = 8  # past ts.BAD_STEP (5): an overflow on the last rank only, skipped by every rank
COMPILED_STEPS = 7  # the compiled runs go past the overflow too
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


def _run(make, parallel, state, rank: int, world: int, compile=False, steps=STEPS) -> dict:
    step = funcamp.make_train_step(
        ts._loss_fn, make(), ts.POLICY, parallel=parallel, compile=compile, donate_state=False
    )
    try:
        state, metrics = ts._train(step, state, ts._batches(steps), rank, world)
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


def _worker(rank: int, world: int, out_dir: str, compiled: bool) -> None:
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
            state = fd.shard(ts._init(make()), mesh, dim=1)  # the other cut
            res[f"{name}_dim1"] = _run(make, fd.Sharded(mesh), state, rank, world)
            try:
                res[f"{name}_dtensor"] = _on_dtensors(make, mesh)
            except RuntimeError as e:  # DTensor's refusal of a plain operand, say
                res[f"{name}_dtensor"] = {"error": str(e)}
        res["seconds"][name] = time.monotonic() - t0
    if compiled:  # the compiled runs in the same processes: one start-up, not two
        res["compiled"] = _compiled(mesh, rank, world)
        res["seconds"]["compiled"] = res["compiled"].pop("seconds")
    ranks.save_results(res, out_dir, rank)
    ranks.leave()


def _collectives(gm) -> dict:
    targets = ranks.node_targets(gm)
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    return {k: sum(k in t for t in targets) for k in kinds}


def _compiled(mesh, rank: int, world: int) -> dict:
    """Muon and Adafactor compiled (aot_eager) under Sharded, counting graphs and collectives."""
    res: dict = {"seconds": {}}
    for name, make in WHOLE.items():
        t0 = time.monotonic()
        graphs: list[dict] = []
        backend = funcamp.Compile(backend=ranks.counting_backend(_collectives, graphs))
        state = fd.shard(ts._init(make()), mesh)
        res[name] = _run(make, fd.Sharded(mesh), state, rank, world, backend, COMPILED_STEPS)
        res[f"{name}_graphs"] = graphs
        res["seconds"][name] = time.monotonic() - t0
    return res


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The 2-rank run; with the compiled runs too where a selected test reads them (not in the
    quick subset, ``-m "not slow"``)."""
    compiled = any("compiled_runs" in item.fixturenames for item in request.session.items)
    out_dir = tmp_path_factory.mktemp("shard_optimizers")
    args = [(r, WORLD, str(out_dir), compiled) for r in range(WORLD)]
    preload = ["torch", "funcamp", __name__]
    t0 = time.monotonic()
    got = ranks.start(_worker, args, out_dir, preload=preload, timeout_s=TIMEOUT_S).results()
    print(f"{WORLD} ranks {time.monotonic() - t0:.1f}s {got[0]['seconds']}")
    return got


def _one_process(name: str, steps: int = STEPS) -> tuple[dict, list]:
    make = WHOLE[name]
    step = funcamp.make_train_step(
        ts._loss_fn, make(), ts.POLICY, compile=False, donate_state=False
    )
    state, metrics = ts._train(step, ts._init(make()), ts._batches(steps))
    return funcamp.state_dict(state), metrics


#: Muon's largest difference from one process (params and momentum): the gradients differ in
#: their last float32 bits (summed in another order); Newton-Schulz rounds its input to
#: bfloat16, so such a difference can flip a bfloat16 rounding, which moves a param by up to
#: lr * sqrt(32 / 4) * 2**-8 = 1.1e-4 (w2). Measured: 1.3e-8 eager, 7.5e-9 compiled (no flip).
MUON_ATOL = 2e-4


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


def _check_whole(name: str, got: dict, want: dict, want_metrics: list, steps: int) -> None:
    assert "error" not in got, got.get("error")
    if name == "adafactor":  # float32 sums in another order: test_shard's tolerance
        ts._check(got["state"], got["metrics"], want, want_metrics, WORLD, steps)
        return
    from funcamp.testing import assert_trees_close

    assert_trees_close(got["state"]["params"], want["params"], atol=MUON_ATOL, rtol=0)
    assert_trees_close(got["state"]["opt_state"], want["opt_state"], atol=MUON_ATOL, rtol=0)
    found = [bool(m["found_inf"]) for m in got["metrics"]]
    assert found == [bool(m["found_inf"]) for m in want_metrics]


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_whole_leaf_optimizers_under_sharded_match_one_process(runs, name):
    """Under Sharded each rank holds a shard of each matrix: Muon all-gathers the matrices it
    orthogonalises (each rank keeps its rows of the result), Adafactor all-reduces its partial
    column (row) sums and norms. The whole state, gathered, is one process's on the global
    batch -- sharded along dim 0 (w1's 15 rows uneven) and along dim 1 -- through the overflow
    every rank skips; every rank holds the same state."""
    want, want_metrics = _one_process(name)
    for res in runs:
        for key in (name, f"{name}_dim1"):
            _check_whole(name, res[key], want, want_metrics, STEPS)
    assert_bitwise(runs[1][name]["state"], runs[0][name]["state"])


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


@pytest.mark.parametrize("name", sorted(WHOLE))
def test_whole_leaf_optimizers_refuse_shards_they_cannot_place(name):
    """On shards they cannot place -- a leaf whose path is not among the step's params, or an
    Across without a layout -- both refuse, naming the alternatives, before any collective."""
    from funcamp._core.collectives import Across, summing_across

    opt = {"muon": funcamp.muon(1e-2), "adafactor": funcamp.adafactor(1e-2)}[name]
    params = {"v": torch.ones(4, 3)}
    state = opt.init(params)
    known = {"w": (0, (8, 3))}
    for across, why in [
        (Across(None, (True,), known, 0, 2), "the leaf v is not one of the step's params"),
        (Across(None, (True,), None, 0, 2), "the shards' layout is unknown"),
    ]:
        with summing_across(across), pytest.raises(ValueError) as info:
            opt.update({"v": torch.ones(4, 3)}, state, params)
        assert f"funcamp.{name}: " in str(info.value) and why in str(info.value)
        assert "parallel=funcamp.distributed.DataParallel(group)" in str(info.value)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_adafactor_on_shards_of_every_dim_is_the_whole_computation(single_rank_group, dim):
    """Adafactor's sharded path on one rank that the Across declares one of two: each "shard"
    is the whole leaf and each all-reduce sums one rank's partial sums, so the path must give
    the unsharded numbers -- for 3-D leaves cut along a leading dim (norms only), their rows or
    their columns, and for a vector -- within float32 rounding (its sums grouped otherwise)."""
    from funcamp._core.collectives import Across, summing_across

    gen = torch.Generator().manual_seed(dim)
    params = {"a": torch.randn(3, 5, 4, generator=gen), "v": torch.randn(6, generator=gen)}
    layout = {"a": (dim, (3, 5, 4)), "v": (0 if dim == 0 else None, (6,))}
    across = Across(single_rank_group, (True, dim == 0), layout, 0, 2)
    steps = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in "abc"]
    runs = []
    for on_shards in (None, across):
        opt = funcamp.adafactor(1e-2, weight_decay=0.01)
        ps, state = params, opt.init(params)
        for grads in steps:
            with summing_across(on_shards):
                updates, state = opt.update(grads, state, ps)
            ps = funcamp.apply_updates(ps, updates)
        runs.append((ps, state))
    from funcamp.testing import assert_trees_close

    assert_trees_close(runs[1], runs[0], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@exhaustive  # in the suite: test_whole_leaf_optimizers_compile_under_sharded[muon], two ranks
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


@pytest.fixture(scope="module")
def compiled_runs(runs):
    """The compiled runs' results (made by the same spawned run as ``runs``)."""
    return [res["compiled"] for res in runs]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(WHOLE))
def test_whole_leaf_optimizers_compile_under_sharded(compiled_runs, name):
    """Compiled (aot_eager), one graph per rank over 7 steps, with Muon's one all-gather of the
    packed matrices (beside the params' all-gather) or Adafactor's two more all-reduces
    inside; the numbers are one process's, as eager."""
    want, want_metrics = _one_process(name, COMPILED_STEPS)
    extra = {"muon": {"all_gather": 1}, "adafactor": {"all_reduce": 2}}[name]
    base = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}
    for res in compiled_runs:
        _check_whole(name, res[name], want, want_metrics, COMPILED_STEPS)
        assert res[f"{name}_graphs"] == [{k: v + extra.get(k, 0) for k, v in base.items()}]
