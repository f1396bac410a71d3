"""make_train_step(..., parallel=Sharded(mesh), donate_state=False): sharded params and
optimizer state on gloo processes (CPU).

One spawned run per world size (2, then 4: the 4-rank run loads the 2-rank run's checkpoint);
the workers go through every scenario and save what they saw, and the tests compare it with a
single process on the same global batch.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import optree
import pytest
import ranks
import torch
import torch.distributed as dist
from bitwise import assert_bitwise

import funcamp
import funcamp.distributed as fd
from funcamp.testing import assert_trees_close, assert_trees_equal

pytestmark = pytest.mark.distributed

BATCH = 8  # divisible by 2 and 4: equal shards
STEPS = 20
BAD_STEP = 5  # an inf in the last row of this step's batch: on the last rank only
COMPILED_STEPS = 7  # the compiled run (aot_eager) goes past the overflow
POLICY = "float32"  # exact math: the sharded step must match one process to float32 rounding
# Float32 tolerance against one process: the ranks' gradient sums run in another order (and
# global-norm clipping sums squared norms in another order), and Adam divides by sqrt(nu).
ATOL, RTOL = 2e-6, 2e-5
TIMEOUT_S = 150


# ------------------------------------------------------------------ the problem, on any rank


def _batches(steps: int = STEPS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        x, y = torch.randn(BATCH, 15, generator=gen), torch.randn(BATCH, 4, generator=gen)
        if i == BAD_STEP:
            x[-1, 0] = math.inf
        out.append((x, y))
    return out


def _shard_batch(batch, rank: int, world: int):
    n = BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _loss_fn(params, buffers, batch):
    x, y = batch
    buffers["seen"].add_(x.shape[0])  # rank 0's buffers win (DDP's broadcast_buffers)
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(params["t"] * (h @ params["w2"]) + params["b2"], y)


def _sharded_step(mesh, opt, loss_fn=_loss_fn, policy=POLICY, **kw):
    """``make_train_step(..., parallel=Sharded(mesh))``, pure unless ``donate_state=True``."""
    kw.setdefault("donate_state", False)
    return funcamp.make_train_step(
        loss_fn, opt, policy, parallel=funcamp.distributed.Sharded(mesh), **kw
    )


def _adamw():
    return funcamp.adamw(1e-2, weight_decay=0.01)


def _clipped():
    return funcamp.chain(funcamp.clip_by_global_norm(0.3), funcamp.adamw(1e-2))


def _init(optimizer) -> funcamp.TrainState:
    """w1: 15 rows (uneven on 2 and 4 ranks), b1, w2: even, b2: 4 (one row per rank on 4, so
    sharded), t: 0-d (replicated)."""
    gen = torch.Generator().manual_seed(1)
    params = {
        "w1": torch.randn(15, 32, generator=gen) / 4,
        "b1": torch.zeros(32),
        "w2": torch.randn(32, 4, generator=gen) / 6,
        "b2": torch.zeros(4),
        "t": torch.tensor(1.0),
    }
    buffers = {"seen": torch.zeros((), dtype=torch.int64)}
    scaler = funcamp.ScalerState.dynamic(2.0**8, growth_interval=3)
    return funcamp.TrainState.create(params, optimizer, POLICY, buffers=buffers, scaler=scaler)


def _full(tree):
    """Every DTensor leaf as its full tensor."""
    from torch.distributed.tensor import DTensor

    return optree.tree_map(
        lambda x: x.full_tensor() if isinstance(x, DTensor) else x,
        tree,
        namespace="funcamp",
    )


def _local_bytes(tree) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for x in optree.tree_leaves(tree, namespace="funcamp"):
        if isinstance(x, torch.Tensor):
            t = x.to_local() if isinstance(x, DTensor) else x
            total += t.numel() * t.element_size()
    return total


def _train(step, state, batches, rank=0, world=1):
    metrics = []
    for batch in batches:
        state, m = step(state, _shard_batch(batch, rank, world))
        metrics.append({k: m[k] for k in ("loss", "grad_norm", "found_inf", "scale")})
    return state, metrics


# ---------------------------------------------------------------------------------- workers


def _collectives(gm) -> dict:
    names = ranks.node_targets(gm)
    return {
        kind: sum(kind in n for n in names)
        for kind in ("all_gather", "reduce_scatter", "all_reduce")
    }


def _worker(rank: int, world: int, out_dir: str, ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ranks.init_rank(rank, world, out_dir, TIMEOUT_S)
    mesh = init_device_mesh("cpu", (world,))
    batches = _batches()
    res: dict = {"seconds": {}}
    clock = [time.monotonic()]

    def lap(name):
        now = time.monotonic()
        res["seconds"][name] = now - clock[0]
        clock[0] = now

    def sharded(opt, **kw):
        return _sharded_step(mesh, opt, **kw)

    state = fd.shard(_init(_adamw()), mesh)
    res["placements"] = {k: str(v.placements) for k, v in state.params.items()}
    res["local_bytes"] = _local_bytes((state.params, state.opt_state))
    state, res["eager_metrics"] = _train(
        sharded(_adamw(), compile=False), state, batches, rank, world
    )
    res["eager"] = funcamp.state_dict(_full(state))
    res["eager_type"] = type(state.params["w1"]).__name__
    lap("eager")
    # Global-norm clipping: the norm of the whole gradient, not of this rank's shards.
    cstate = fd.shard(_init(_clipped()), mesh)
    cstate, res["clipped_metrics"] = _train(
        sharded(_clipped(), compile=False), cstate, batches, rank, world
    )
    res["clipped"] = funcamp.state_dict(_full(cstate))
    lap("clipped")
    # Sharded along dim 1 (w1: 32 columns, w2: 4, uneven on neither; b1, b2, t replicated).
    dstate = fd.shard(_init(_adamw()), mesh, dim=1)
    res["dim1_placements"] = {k: str(v.placements) for k, v in dstate.params.items()}
    dstate, res["dim1_metrics"] = _train(
        sharded(_adamw(), compile=False), dstate, batches, rank, world
    )
    res["dim1"] = funcamp.state_dict(_full(dstate))
    lap("dim1")
    if world == 2:  # compiled (aot_eager, counting graphs and collectives); 2 ranks only
        counts: list[dict] = []
        res["graphs"] = counts
        step = sharded(
            _adamw(), compile=funcamp.Compile(backend=ranks.counting_backend(_collectives, counts))
        )
        kstate, res["compiled_metrics"] = _train(
            step, fd.shard(_init(_adamw()), mesh), batches[:COMPILED_STEPS], rank, world
        )
        res["compiled"] = funcamp.state_dict(_full(kstate))
        lap("compiled")
    if world == 2:
        # The same ranks, data parallel (group=): the same reductions, so the same bits.
        dp = funcamp.make_train_step(
            _loss_fn,
            _adamw(),
            POLICY,
            parallel=funcamp.distributed.DataParallel(dist.group.WORLD),
            compile=False,
            donate_state=False,
        )
        dstate, _ = _train(dp, _init(_adamw()), batches, rank, world)
        res["dp"] = funcamp.state_dict(dstate)
        funcamp.save(ckpt, state, policy=POLICY, group=dist.group.WORLD, step=STEPS)
    else:
        # The 2-rank checkpoint, resharded onto 4 ranks.
        template = fd.shard(_init(_adamw()), mesh)
        loaded = funcamp.load(ckpt, template, policy=POLICY, group=dist.group.WORLD)
        res["loaded_type"] = type(loaded.opt_state.exp_avg["w1"]).__name__
        res["loaded_placements"] = str(loaded.opt_state.exp_avg["w1"].placements)
        res["loaded"] = funcamp.state_dict(_full(loaded))
        more, _ = _train(sharded(_adamw(), compile=False), loaded, _batches(2, 9), rank, world)
        res["resumed"] = funcamp.state_dict(_full(more))
    lap("rest")
    ranks.save_results(res, out_dir, rank)
    ranks.leave()


def _run(world: int, out_dir: Path, ckpt: Path) -> list[dict]:
    args = [(r, world, str(out_dir), str(ckpt)) for r in range(world)]
    preload = ["torch", "torch.distributed.checkpoint", "funcamp", __name__]
    return ranks.start(_worker, args, out_dir, preload=preload, timeout_s=TIMEOUT_S).results()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shard")
    ckpt = tmp / "ckpt"
    t0 = time.monotonic()
    two = _run(2, tmp_path_factory.mktemp("shard2"), ckpt)
    t1 = time.monotonic()
    four = _run(4, tmp_path_factory.mktemp("shard4"), ckpt)
    print(
        f"2 ranks {t1 - t0:.1f}s {two[0]['seconds']}; 4 ranks {time.monotonic() - t1:.1f}s {four[0]['seconds']}"
    )
    return {2: two, 4: four, "ckpt": ckpt}


@pytest.fixture(scope="module")
def reference():
    """One process, the global batch, eager."""
    out = {}
    for name, make in (("eager", _adamw), ("clipped", _clipped)):
        step = funcamp.make_train_step(_loss_fn, make(), POLICY, compile=False, donate_state=False)
        state, metrics = _train(step, _init(make()), _batches())
        out[name], out[f"{name}_metrics"] = funcamp.state_dict(state), metrics
    step = funcamp.make_train_step(_loss_fn, _adamw(), POLICY, compile=False, donate_state=False)
    state, metrics = _train(step, _init(_adamw()), _batches()[:COMPILED_STEPS])
    out["compiled"], out["compiled_metrics"] = funcamp.state_dict(state), metrics
    return out


# ------------------------------------------------------------------------------------ tests


def _check(got: dict, got_metrics, want: dict, want_metrics, world: int, steps: int) -> None:
    assert_trees_close(got["params"], want["params"], atol=ATOL, rtol=RTOL)
    assert_trees_close(got["opt_state"], want["opt_state"], atol=ATOL, rtol=RTOL)
    assert_trees_equal(got["scaler"], want["scaler"])  # the same skips, the same scale trace
    assert [bool(m["found_inf"]) for m in got_metrics] == [i == BAD_STEP for i in range(steps)]
    for m, w in zip(got_metrics, want_metrics):
        assert torch.equal(m["scale"], w["scale"])
        if not w["found_inf"]:  # global: the mean loss, the norm of the whole mean gradient
            torch.testing.assert_close(m["loss"], w["loss"], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(m["grad_norm"], w["grad_norm"], atol=0, rtol=1e-5)
    # rank 0's buffers on every rank: rank 0 counted its own shards only
    assert int(got["buffers"]["seen"]) == steps * (BATCH // world)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "key"),
    [
        (2, "eager"),
        (4, "eager"),
        (2, "clipped"),
        (4, "clipped"),
        (2, "dim1"),
        (4, "dim1"),
        (2, "compiled"),
    ],
)
def test_sharded_step_matches_one_process(runs, reference, world, key):
    steps = COMPILED_STEPS if key == "compiled" else STEPS
    if key == "dim1":  # sharded along dim 1: the same numbers as along dim 0
        reference = {"dim1": reference["eager"], "dim1_metrics": reference["eager_metrics"]}
        assert runs[world][0]["dim1_placements"]["w1"] == "(Shard(dim=1),)"
        assert runs[world][0]["dim1_placements"]["b1"] == "(Replicate(),)"
    for res in runs[world]:
        _check(
            res[key],
            res[f"{key}_metrics"],
            reference[key],
            reference[f"{key}_metrics"],
            world,
            steps,
        )
    for res in runs[world][1:]:  # every rank gathers the same full state
        assert_bitwise(res[key], runs[world][0][key])


@pytest.mark.slow
def test_two_sharded_ranks_are_bitwise_data_parallel(runs):
    """Sharded over 2 ranks, the reduce-scatter sums the same two gradients DP's all-reduce
    sums (and halving is exact): params, optimizer state and scaler come out bit for bit."""
    for res in runs[2]:
        got, want = res["eager"], res["dp"]
        for part in ("params", "opt_state", "scaler"):
            assert_bitwise(got[part], want[part])


@pytest.mark.slow
def test_the_state_stays_sharded_and_the_rule_holds(runs):
    for world in (2, 4):
        placements = runs[world][0]["placements"]
        assert placements["w1"] == placements["w2"] == "(Shard(dim=0),)"
        assert placements["t"] == "(Replicate(),)"  # 0-d
        assert runs[world][0]["eager_type"] == "DTensor"
    assert runs[2][0]["placements"]["b2"] == runs[4][0]["placements"]["b2"] == "(Shard(dim=0),)"


@pytest.mark.slow
def test_params_and_optimizer_state_take_about_one_nth_per_rank(runs):
    """Measured: bytes of the local shards of params + AdamW state on each rank."""
    full = _local_bytes((_init(_adamw()).params, _init(_adamw()).opt_state))
    for world in (2, 4):
        per_rank = [res["local_bytes"] for res in runs[world]]
        # the replicated leaves (t and the 0-d count) are tiny: within 2 % of 1/N of the total
        assert max(per_rank) <= full / world * 1.06, (world, per_rank, full)
        assert sum(per_rank) >= full  # nothing is lost; replicated leaves count N times


@pytest.mark.slow
def test_compiled_sharded_step_is_one_graph_with_the_collectives_inside(runs):
    """On 2 ranks, one graph per rank (fullgraph, never recompiled over 7 steps): one
    all-gather of the packed float32 params, its reduce-scatter in the backward, the packed
    all-reduce of the replicated leaves' gradients, the loss and the buffers, the small one of
    unscale_and_step's global flag and norm, and none else (AdamW, no clipping)."""
    for res in runs[2]:
        assert res["graphs"] == [{"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}]


@pytest.mark.slow
def test_checkpoint_saved_on_two_ranks_loads_on_four_and_on_one(runs):
    saved = runs[2][0]["eager"]
    for res in runs[4]:
        assert res["loaded_type"] == "DTensor"
        assert res["loaded_placements"] == "(Shard(dim=0),)"
        assert_bitwise(res["loaded"], saved)
    # resumed on 4 ranks: the same as one process resuming from the same state
    state = funcamp.load_state_dict(_init(_adamw()), saved)
    step = funcamp.make_train_step(_loss_fn, _adamw(), POLICY, compile=False, donate_state=False)
    state, _ = _train(step, state, _batches(2, 9))
    want = funcamp.state_dict(state)
    assert_trees_close(runs[4][0]["resumed"]["params"], want["params"], atol=ATOL, rtol=RTOL)
    # on one process, without a group: the full tensors
    one = funcamp.load(runs["ckpt"], _init(_adamw()), policy=POLICY)
    assert_bitwise(funcamp.state_dict(one), saved)
    assert funcamp.checkpoint_info(runs["ckpt"]).world_size == 2


# -------------------------------------------------------------------- in-process, one rank


@pytest.fixture
def mesh(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def _accumulated():
    return funcamp.accumulate(_adamw(), every=2)


def _master():
    return funcamp.adam(1e-2, master_weights=True)


@pytest.mark.parametrize(
    ("make", "policy"),
    [(_adamw, POLICY), (_clipped, POLICY), (_accumulated, POLICY), (_master, "bf16-true")],
)
def test_one_rank_mesh_is_bit_identical_to_no_mesh(mesh, make, policy):
    """Bit for bit (AdamW, accumulation, bfloat16 params with float32 master weights); with
    global-norm clipping the norm is summed in another order (squared norms of the shards,
    all-reduced), so the clipped run is within float32 rounding."""

    def init():
        state = _init(make()) if policy == POLICY else None
        if state is None:
            params = optree.tree_map(lambda x: x.clone(), _init(_adamw()).params)
            state = funcamp.TrainState.create(
                params, make(), policy, buffers={"seen": torch.zeros((), dtype=torch.int64)}
            )
        return state

    plain = funcamp.make_train_step(_loss_fn, make(), policy, compile=False, donate_state=False)
    sharded = _sharded_step(mesh, make(), policy=policy, compile=False)
    a, _ = _train(plain, init(), _batches(8))
    b, mb = _train(sharded, fd.shard(init(), mesh), _batches(8))
    a, b = funcamp.state_dict(a), funcamp.state_dict(_full(b))
    if make is _clipped:
        assert_trees_close(b, a, atol=ATOL, rtol=RTOL)
    else:
        assert_bitwise(a, b)
    if policy == POLICY:
        assert [bool(m["found_inf"]) for m in mb] == [i == BAD_STEP for i in range(8)]
    quiet = _sharded_step(mesh, make(), policy=policy, compile=False, grad_norm=False)
    _, mq = quiet(fd.shard(init(), mesh), _batches(1)[0])
    assert "grad_norm" not in mq and torch.equal(mq["loss"], mb[0]["loss"])


def test_shard_checks_its_arguments(mesh):
    from torch.distributed.device_mesh import init_device_mesh

    state = _init(_adamw())
    with pytest.raises(TypeError, match=r"funcamp.distributed.shard: `mesh` must be a 1-D"):
        fd.shard(state, dist.group.WORLD)
    two_d = init_device_mesh("cpu", (1, 1))
    with pytest.raises(ValueError, match=r"`mesh` must be a 1-D DeviceMesh .* 2-D mesh"):
        fd.shard(state, two_d)
    with pytest.raises(TypeError, match=r"`dim` must be an int >= 0"):
        fd.shard(state, mesh, dim=-1)
    sharded = fd.shard(state, mesh, dim=1)
    assert str(sharded.params["w1"].placements) == "(Shard(dim=1),)"
    assert str(sharded.params["b1"].placements) == "(Replicate(),)"  # 1-D: no dim 1
    assert not isinstance(sharded.scaler.scale, type(sharded.params["w1"]))  # left as it is
    assert fd.shard(sharded, mesh).params["w1"] is sharded.params["w1"]


def test_sharded_step_checks_its_arguments(mesh):
    from torch.distributed.device_mesh import init_device_mesh

    # the removed spelling is not translated: make_train_step takes no `mesh=` (parallel= does)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'mesh'"):
        funcamp.make_train_step(_loss_fn, _adamw(), POLICY, mesh=mesh, donate_state=False)
    with pytest.raises(ValueError, match=r"make_train_step: `mesh` must be a 1-D DeviceMesh"):
        funcamp.make_train_step(
            _loss_fn,
            _adamw(),
            POLICY,
            parallel=funcamp.distributed.Sharded(init_device_mesh("cpu", (1, 1))),
            donate_state=False,
        )
    # what does not compose is refused in one place, with the reason
    with pytest.raises(
        ValueError, match=r"headroom does not compose with parallel=Sharded\(mesh\) .*its shards"
    ):
        _sharded_step(mesh, _adamw(), headroom=True)
    with pytest.raises(
        ValueError, match=r"cache_dir does not compose with parallel=Sharded\(mesh\) .*collectives"
    ):
        _sharded_step(mesh, _adamw(), compile=funcamp.Compile(cache_dir="c"))
    step = _sharded_step(mesh, _adamw(), compile=False)
    with pytest.raises(TypeError, match=r"`state.params` leaf \['b1'\] must be a DTensor"):
        step(_init(_adamw()), _batches(1)[0])
    state = fd.shard(_init(_adamw()), mesh)
    bad = state._replace(opt_state=_init(_adamw()).opt_state)  # params sharded, opt_state not
    with pytest.raises(TypeError, match=r"`state.opt_state` leaf .* must be a DTensor"):
        step(bad, _batches(1)[0])
    state, _ = step(state, _batches(1)[0])
    dim1 = fd.shard(_init(_adamw()), mesh, dim=1)
    with pytest.raises(ValueError, match=r"`state.params` must keep the sharding"):
        step(state._replace(params=dim1.params), _batches(1)[0])


# ------------------------------------------------------- what composes with `mesh` now


@pytest.mark.slow
@pytest.mark.parametrize("backend", [None, "aot_eager"], ids=["eager", "aot_eager"])
def test_donated_sharded_step_writes_the_shards_in_place(mesh, backend):
    """donate_state with `mesh`: the same bits as the pure sharded step, the new params and
    optimizer state in the input state's own local shards (as the plain donated step). The
    pure step is the eager one for both (aot_eager runs eager's ops: the same bits, one compile
    less)."""
    kw = {"compile": False} if backend is None else {"compile": funcamp.Compile(backend=backend)}
    pure = _sharded_step(mesh, _adamw(), compile=False)
    donated = _sharded_step(mesh, _adamw(), donate_state=True, **kw)
    a, b = fd.shard(_init(_adamw()), mesh), fd.shard(_init(_adamw()), mesh)
    for batch in _batches(6):
        locals_before = [x.to_local() for x in optree.tree_leaves(b.params, namespace="funcamp")]
        a, ma = pure(a, batch)
        b, mb = donated(b, batch)
        assert torch.equal(ma["loss"], mb["loss"]) and torch.equal(ma["found_inf"], mb["found_inf"])
        after = [x.to_local() for x in optree.tree_leaves(b.params, namespace="funcamp")]
        assert all(x.data_ptr() == y.data_ptr() for x, y in zip(after, locals_before))
    assert_bitwise(funcamp.state_dict(_full(a)), funcamp.state_dict(_full(b)))


def _fp8_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_delayed_fp8_sharded_step_is_the_plain_step_on_one_rank(mesh):
    """A delayed FP8 recipe with `mesh`: the amax histories are max-reduced over the mesh's
    ranks as in data parallel; on one rank the sharded step is the plain step bit for bit."""
    model = _fp8_model()
    policy = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.delayed(4))

    def loss(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(model, (params, buffers), (x,))
        return torch.nn.functional.mse_loss(out, y)

    def init():
        params, buffers = funcamp.params_and_buffers(model)
        params = {k: v.clone() for k, v in params.items()}
        return funcamp.TrainState.create(params, _adamw(), policy, buffers=buffers, model=model)

    gen = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(4)
    ]
    plain = funcamp.make_train_step(loss, _adamw(), policy, compile=False, donate_state=False)
    sharded = _sharded_step(mesh, _adamw(), loss, policy, compile=False)
    a, b = init(), fd.shard(init(), mesh)
    for batch in batches:
        a, _ = plain(a, batch)
        b, _ = sharded(b, batch)
    assert_bitwise(funcamp.state_dict(a), funcamp.state_dict(_full(b)))
    assert float(a.fp8.amax_history["0"].abs().sum()) > 0  # the histories moved
