"""make_train_step(..., parallel=DataParallel(pg), donate_state=False): data-parallel training
on gloo processes (CPU).

Process start-up (importing torch) costs seconds, so each world size is *one* spawned run whose
workers go through every scenario and save what they saw; the tests below read those results
and compare them with single-process references computed here. The 3-rank run is eager only
(its compiled run, three more compiles, with ``FUNCAMP_TEST_EXHAUSTIVE=1``).
"""

from __future__ import annotations

import math
import os
import re
import time
from datetime import timedelta
from pathlib import Path

import exhaustive
import pytest
import ranks
import torch
import torch.distributed as dist
from bitwise import assert_bitwise
from torch.distributed.device_mesh import init_device_mesh

import funcamp
from funcamp.distributed.agree import fingerprint, refuse_differences
from funcamp.testing import assert_trees_close, assert_trees_equal

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

BATCH = 12  # divisible by 2 and 3: equal shards
STEPS = 5
BAD_STEP = 2  # an inf in the last row of this step's batch: on the last rank only
CONT = 2  # steps after the checkpoint
ATOL = 1e-5
RUN_TIMEOUT_S = 150
HANG_TIMEOUT_S = 3  # the gloo timeout of the group a failing rank leaves waiting
POLICY = "float32"  # exact math: DP must match one process to float32 rounding


# ------------------------------------------------------------------ the problem, on any rank


def _batches(steps: int = STEPS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        x, y = torch.randn(BATCH, 4, generator=gen), torch.randn(BATCH, 1, generator=gen)
        if i == BAD_STEP:
            x[-1, 0] = math.inf
        out.append((x, y))
    return out


def _shard(batch, rank: int, world: int):
    n = BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _loss_fn(params, buffers, batch):
    x, y = batch
    # Buffers of three dtypes, updated in place (BatchNorm-style); they do not touch the loss.
    buffers["mean"].mul_(0.9).add_(0.1 * x.mean(0))
    buffers["seen"].add_(x.shape[0])
    buffers["half"].add_(1.0)
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return torch.nn.functional.mse_loss(h @ params["w2"], y)


def _init(optimizer, policy=POLICY, seed=1) -> funcamp.TrainState:
    gen = torch.Generator().manual_seed(seed)
    params = {
        "w1": torch.randn(4, 16, generator=gen) / 2,
        "b1": torch.zeros(16),
        "w2": torch.randn(16, 1, generator=gen) / 4,
    }
    buffers = {
        "mean": torch.full((4,), seed - 1.0),
        "seen": torch.zeros((), dtype=torch.int64),
        "half": torch.zeros(2, dtype=torch.bfloat16),
    }
    # A dynamic scaler even in float32: skips and the scale trace must agree across ranks.
    scaler = funcamp.ScalerState.dynamic(2.0**8, growth_interval=2)
    if funcamp.get_policy(policy).param_dtype != torch.float32:
        scaler = None
    state = funcamp.TrainState.create(params, optimizer, policy, buffers=buffers, scaler=scaler)
    return state._replace(buffers={**state.buffers, "half": buffers["half"]})


def _train(step, state, batches, rank=0, world=1):
    metrics = []
    for batch in batches:
        state, m = step(state, _shard(batch, rank, world))
        metrics.append({k: m[k] for k in ("loss", "grad_norm", "found_inf", "scale")})
    return state, metrics


def _dp_step(group, opt, loss_fn=_loss_fn, policy=POLICY, **kw):
    """``make_train_step(..., parallel=DataParallel(group))``, pure unless ``donate_state=True``."""
    kw.setdefault("donate_state", False)
    return funcamp.make_train_step(
        loss_fn, opt, policy, parallel=funcamp.distributed.DataParallel(group), **kw
    )


def _adam():
    return funcamp.adam(1e-2)


def _accumulated():
    return funcamp.accumulate(funcamp.adam(1e-2), every=2)


def _sr():
    return funcamp.adamw(3e-3, stochastic_rounding=True, seed=7)


# ---------------------------------------------------------------------------------- workers


def _worker(rank: int, world: int, out_dir: str, full: bool) -> None:
    ranks.init_rank(rank, world, out_dir, RUN_TIMEOUT_S)
    pg = dist.group.WORLD
    res: dict = {}
    batches = _batches()

    res["all_reduces"] = {}

    def make(opt, policy=POLICY, name=None, **kw):
        if name is not None:  # compiled: aot_eager, counting the graphs and their all-reduces
            kw["compile"] = funcamp.Compile(
                backend=ranks.counting_backend(
                    _all_reduces, res["all_reduces"].setdefault(name, [])
                )
            )
        return _dp_step(pg, opt, policy=policy, **kw)

    # Eager and compiled (aot_eager) runs with an overflow on the last rank.
    state, res["eager_metrics"] = _train(
        make(_adam(), compile=False), _init(_adam()), batches, rank, world
    )
    res["eager"] = funcamp.state_dict(state)
    if full or exhaustive.ON:
        compiled = make(_adam(), name="compiled")
        cstate, res["compiled_metrics"] = _train(compiled, _init(_adam()), batches, rank, world)
        res["compiled"] = funcamp.state_dict(cstate)
    if full:
        # Resume: the checkpoint of rank 0 at STEPS, then CONT more data-parallel steps.
        more = _batches(CONT, seed=5)
        state, _ = _train(compiled, state, more, rank, world)
        res["continued"] = funcamp.state_dict(state)
        # Accumulation: averaged on every micro-step, the overflowing window skipped everywhere.
        acc = make(_accumulated(), name="acc")
        astate, res["acc_metrics"] = _train(acc, _init(_accumulated()), batches, rank, world)
        res["acc"] = funcamp.state_dict(astate)
        # Stochastic rounding of bf16 params: the same bits on every rank.
        sr = make(_sr(), "bf16-true", name="sr")
        sstate, _ = _train(sr, _init(_sr(), "bf16-true"), batches[:BAD_STEP], rank, world)
        res["sr"] = funcamp.state_dict(sstate)
        # Delayed FP8: amax histories max-reduced across ranks, the same Fp8State everywhere.
        res.update(_fp8_runs(pg, batches, rank, world))
        # Ranks that start apart: rank 0's state everywhere; settings that differ: refused.
        res.update(_agree_runs(pg, batches, rank, world))
        # A rank that raises: the others must fail within the group's timeout, not hang.
        short = dist.new_group(timeout=timedelta(seconds=HANG_TIMEOUT_S))
        res["hang"] = _hang(rank, short, out_dir)
    ranks.save_results(res, out_dir, rank)
    if full and rank != 0:
        # Stay alive (a stuck peer, the worst case) until rank 0 has reported.
        deadline = time.monotonic() + 4 * HANG_TIMEOUT_S + 30
        while not os.path.exists(os.path.join(out_dir, "rank0.pt")):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
    # After a collective timed out the group cannot be torn down cleanly: leave at once.
    ranks.leave(barrier=False)


def _fp8_problem():
    torch.manual_seed(3)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    policy = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.delayed(4))

    def loss_fn(params, buffers, batch):
        x, y = batch
        out = torch.func.functional_call(net, (params, buffers), (x,))
        return torch.nn.functional.mse_loss(out, y)

    params, _ = funcamp.params_and_buffers(net)
    state = funcamp.TrainState.create(
        params, _adam(), policy, model=net, scaler=funcamp.ScalerState.dynamic(2.0**8)
    )
    return policy, loss_fn, state


def _fp8_runs(pg, batches, rank: int, world: int) -> dict:
    policy, loss_fn, state = _fp8_problem()
    dp = _dp_step(pg, _adam(), loss_fn, policy, compile=False)
    alone = funcamp.make_train_step(loss_fn, _adam(), policy, compile=False, donate_state=False)
    first = _shard(batches[0], rank, world)
    out = {
        "fp8_first_dp": funcamp.state_dict(dp(state, first)[0].fp8),
        "fp8_first_alone": funcamp.state_dict(alone(state, first)[0].fp8),
    }
    final, out["fp8_metrics"] = _train(dp, state, batches, rank, world)
    out["fp8"] = funcamp.state_dict(final)
    return out


def _agree_runs(pg, batches, rank: int, world: int) -> dict:
    """Eager steps from a rank-dependent init (the broadcast and fingerprint collectives of
    each call counted), data parallel and sharded; and the refusals of a rank-dependent
    learning rate or policy."""
    out: dict = {}
    counted = {"n": 0}
    real = {name: getattr(dist, name) for name in ("broadcast", "all_gather")}

    def counting(fn):
        def call(*args, **kwargs):
            counted["n"] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in real.items():
        setattr(dist, name, counting(fn))
    try:
        for donate in (False, True):
            step = _dp_step(pg, _adam(), compile=False, donate_state=donate)
            state, calls, metrics = _init(_adam(), seed=1 + rank), [], []
            for batch in batches:
                state, m = step(state, _shard(batch, rank, world))
                metrics.append({k: m[k] for k in ("loss", "grad_norm", "found_inf", "scale")})
                calls.append(counted["n"])
                counted["n"] = 0
            out[f"seeded_{donate}"] = funcamp.state_dict(state)
            out[f"seeded_{donate}_metrics"] = metrics
            out[f"seeded_{donate}_calls"] = calls
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    mesh = init_device_mesh("cpu", (world,))
    sharded = funcamp.make_train_step(
        _loss_fn, _adam(), POLICY, parallel=funcamp.distributed.Sharded(mesh), compile=False
    )
    state = funcamp.distributed.shard(_init(_adam(), seed=1 + rank), mesh)
    for batch in batches:
        state, _ = sharded(state, _shard(batch, rank, world))
    out["seeded_sharded"] = {k: v.full_tensor() for k, v in state.params.items()}

    def refusal(make, opt, policy=POLICY, state=None):
        try:
            make(opt, policy)(
                _init(opt, policy) if state is None else state, _shard(batches[0], rank, world)
            )
        except ValueError as e:
            return str(e)
        return None

    dp = lambda opt, policy: _dp_step(pg, opt, policy=policy, compile=False)  # noqa: E731
    out["refused_lr"] = refusal(dp, funcamp.adamw(1e-3 * (rank + 1)))
    out["refused_policy"] = refusal(dp, _adam(), ("mixed_float16", "mixed_bfloat16")[rank % 2])
    opt = funcamp.adamw(1e-3 * (rank + 1))
    on_mesh = lambda opt, policy: funcamp.make_train_step(  # noqa: E731
        _loss_fn, opt, policy, parallel=funcamp.distributed.Sharded(mesh), compile=False
    )
    out["refused_sharded_lr"] = refusal(
        on_mesh, opt, state=funcamp.distributed.shard(_init(opt), mesh)
    )
    return out


def _all_reduces(gm) -> int:
    return sum("all_reduce" in str(node.target) for node in gm.graph.nodes)


def _hang(rank: int, group, out_dir: str) -> dict:
    def loss_fn(params, buffers, batch):
        if rank != 0:
            raise ValueError("rank failed")
        return _loss_fn(params, buffers, batch)

    step = _dp_step(group, _adam(), loss_fn, compile=False)
    start = time.monotonic()
    try:
        step(_init(_adam()), _shard(_batches(1)[0], rank, dist.get_world_size()))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:300], "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def _start(world: int, out_dir: Path, full: bool) -> ranks.Run:
    args = [(r, world, str(out_dir), full) for r in range(world)]
    return ranks.start(_worker, args, out_dir, preload=[__name__], timeout_s=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs start at once (5 processes share the cores while each imports and compiles)."""
    started = {
        2: _start(2, tmp_path_factory.mktemp("dp2"), full=True),
        3: _start(3, tmp_path_factory.mktemp("dp3"), full=False),
    }
    return {world: _Lazy(run) for world, run in started.items()}


class _Lazy:
    def __init__(self, run) -> None:
        self.run, self.results = run, None

    def get(self) -> list[dict]:
        if self.results is None:
            self.results = self.run.results()
        return self.results


@pytest.fixture(scope="module")
def two_ranks(runs):
    return runs[2].get()


@pytest.fixture(scope="module")
def three_ranks(runs):
    return runs[3].get()


@pytest.fixture(scope="module")
def reference():
    """One process, the full batch, eager."""
    step = funcamp.make_train_step(_loss_fn, _adam(), POLICY, compile=False, donate_state=False)
    state, metrics = _train(step, _init(_adam()), _batches())
    acc = funcamp.make_train_step(
        _loss_fn, _accumulated(), POLICY, compile=False, donate_state=False
    )
    astate, ametrics = _train(acc, _init(_accumulated()), _batches())
    return {"state": state, "metrics": metrics, "acc": astate, "acc_metrics": ametrics}


# ------------------------------------------------------------------------------------ tests


def _same_on_every_rank(results: list[dict], key: str) -> None:
    """params, opt_state, scaler and buffers: bit-identical on every rank."""
    for res in results[1:]:
        assert_bitwise(results[0][key], res[key])


def _check_against_reference(results, ref_state, ref_metrics, key, world):
    ref = funcamp.state_dict(ref_state)
    for res in results:
        got = res[key]
        assert_trees_close(got["params"], ref["params"], atol=ATOL, rtol=0)
        assert_trees_close(got["opt_state"], ref["opt_state"], atol=ATOL, rtol=0)
        assert_trees_equal(got["scaler"], ref["scaler"])  # same skips, same scale trace
        for m, want in zip(res[f"{key}_metrics"], ref_metrics):
            assert bool(m["found_inf"]) == bool(want["found_inf"])
            assert torch.equal(m["scale"], want["scale"])
            if not want["found_inf"]:  # global metrics: mean loss, norm of the mean grads
                torch.testing.assert_close(m["loss"], want["loss"], atol=1e-6, rtol=1e-5)
                torch.testing.assert_close(m["grad_norm"], want["grad_norm"], rtol=1e-5, atol=0)
    # buffers: rank 0's everywhere (rank 0 saw `seen` grow by its shard only)
    assert int(results[0][key]["buffers"]["seen"]) == STEPS * (BATCH // world)
    assert torch.isfinite(results[0][key]["buffers"]["mean"]).all()  # the inf was elsewhere


@pytest.mark.parametrize("key", ["eager", "compiled"])
def test_two_ranks_match_one_process(two_ranks, reference, key):
    assert [bool(m["found_inf"]) for m in two_ranks[0][f"{key}_metrics"]] == [
        i == BAD_STEP for i in range(STEPS)
    ]
    _check_against_reference(two_ranks, reference["state"], reference["metrics"], key, 2)
    _same_on_every_rank(two_ranks, key)


_THREE_COMPILED = pytest.param(
    "compiled",
    marks=pytest.mark.skipif(
        not exhaustive.ON,
        reason="FUNCAMP_TEST_EXHAUSTIVE=1 runs it; test_two_ranks_match_one_process[compiled] "
        "checks the compiled data-parallel step against one process",
    ),
)


@pytest.mark.parametrize("key", ["eager", _THREE_COMPILED])
def test_three_ranks_match_one_process(three_ranks, reference, key):
    _check_against_reference(three_ranks, reference["state"], reference["metrics"], key, 3)
    _same_on_every_rank(three_ranks, key)


def test_accumulate_averages_every_micro_step_and_skips_together(two_ranks, reference):
    res = [{"acc": r["acc"], "acc_metrics": r["acc_metrics"]} for r in two_ranks]
    _check_against_reference(res, reference["acc"], reference["acc_metrics"], "acc", 2)
    _same_on_every_rank(res, "acc")
    # GradScaler's window: micro-steps 0-1 applied, the window of 2 (the overflow) and 3 was
    # skipped whole on every rank, and 4 opened the next one
    assert [bool(m["found_inf"]) for m in two_ranks[0]["acc_metrics"]] == [
        False, False, True, True, False
    ]  # fmt: skip
    assert int(two_ranks[0]["acc"]["opt_state"]["inner"]["count"]) == 1


def test_stochastic_rounding_identical_on_every_rank(two_ranks):
    sr = two_ranks[0]["sr"]
    assert sr["params"]["w1"].dtype == torch.bfloat16
    assert not torch.equal(sr["params"]["w1"], _init(_sr(), "bf16-true").params["w1"])
    _same_on_every_rank(two_ranks, "sr")


def test_checkpoint_of_rank_0_resumes_in_one_process(two_ranks):
    """Rank 0's checkpoint is every rank's state bit for bit, loads in a single process, and
    training on there with the full batch follows the data-parallel run (to rounding: the
    gradient sums run in another order); the step counts and scaler state match exactly."""
    _same_on_every_rank(two_ranks, "continued")
    template = _init(_adam())
    state = funcamp.load_state_dict(template, two_ranks[0]["compiled"])
    assert_bitwise(funcamp.state_dict(state), two_ranks[1]["compiled"])
    step = funcamp.make_train_step(_loss_fn, _adam(), POLICY, compile=False, donate_state=False)
    state, _ = _train(step, state, _batches(CONT, seed=5))
    got, want = funcamp.state_dict(state), two_ranks[0]["continued"]
    assert_trees_close(got["params"], want["params"], atol=ATOL, rtol=0)
    assert_trees_close(got["opt_state"], want["opt_state"], atol=ATOL, rtol=0)
    assert_trees_equal(got["scaler"], want["scaler"])
    assert torch.equal(got["opt_state"]["count"], want["opt_state"]["count"])


def test_delayed_fp8_amaxes_are_max_reduced_across_ranks(two_ranks):
    # After one step each rank's newest amaxes are the max over the ranks' own (local) amaxes,
    # and the scales follow from them; the whole state stays bit-identical across ranks over
    # STEPS steps.
    for res in two_ranks[1:]:
        assert_bitwise(two_ranks[0]["fp8_first_dp"], res["fp8_first_dp"])
    _same_on_every_rank(two_ranks, "fp8")
    dp = two_ranks[0]["fp8_first_dp"]
    assert sorted(dp["scale"]) == ["0", "2"]
    for site in dp["scale"]:
        local = torch.stack([r["fp8_first_alone"]["amax_history"][site] for r in two_ranks])
        assert torch.equal(dp["amax_history"][site], local.amax(0))
        assert (dp["amax_history"][site][:, -1] > 0).all()
        differs = [r["fp8_first_alone"]["scale"][site] for r in two_ranks]
        assert any(not torch.equal(dp["scale"][site], d) for d in differs)  # really reduced
    # The last rank's inf input is saturated by the FP8 cast (torchao's clamp), so no step
    # overflows; its inf amax reaches every rank's history (and holds the old input scale).
    for res in two_ranks:
        assert [bool(m["found_inf"]) for m in res["fp8_metrics"]] == [False] * STEPS
        assert torch.isinf(res["fp8"]["fp8"]["amax_history"]["0"][0]).any()


@pytest.mark.parametrize("donate", [False, True])
def test_ranks_that_start_apart_train_from_rank_0s_state(two_ranks, reference, donate):
    """Params and buffers drawn with a rank-dependent seed: the first call broadcasts rank 0's
    state (DDP's broadcast at construction), so the ranks end equal, and equal to the run from
    rank 0's init (the reference's); the first call's collectives run once, never again."""
    key = f"seeded_{donate}"
    assert not torch.equal(_init(_adam(), seed=1).params["w1"], _init(_adam(), seed=2).params["w1"])
    _check_against_reference(two_ranks, reference["state"], reference["metrics"], key, 2)
    _same_on_every_rank(two_ranks, key)
    for r in two_ranks:
        first, *later = r[f"{key}_calls"]
        assert first > 0 and later == [0] * (STEPS - 1), r[f"{key}_calls"]


def test_sharded_ranks_that_start_apart_train_from_rank_0s_state(two_ranks, reference):
    """funcamp.distributed.shard scatters rank 0's values (distribute_tensor's rule)."""
    ref = funcamp.state_dict(reference["state"])["params"]
    for r in two_ranks:
        assert_trees_close(r["seeded_sharded"], ref, atol=ATOL, rtol=0)
    _same_on_every_rank(two_ranks, "seeded_sharded")


@pytest.mark.parametrize(
    ("key", "piece", "field", "values"),
    [
        ("refused_lr", "DataParallel", r"the optimizer's `lr` \(optimizer\.", ("0.001", "0.002")),
        ("refused_sharded_lr", "Sharded", r"the optimizer's `lr` \(optimizer\.", ("0.001", "0.002")),
        ("refused_policy", "DataParallel", r"the policy's `compute_dtype` \(policy\.compute_dtype\)", ("torch.float16", "torch.bfloat16")),
    ],
)  # fmt: skip
def test_settings_that_differ_by_rank_are_refused_by_name(two_ranks, key, piece, field, values):
    """On the first call, before anything ran, every rank raises the same error, naming the
    field and what each rank has (a float16 rank's gradient scaled by 65536 is never averaged
    with a bfloat16 rank's unscaled one)."""
    want = (
        rf"^funcamp\.make_train_step: every rank of parallel={piece}\(.*\) \(2 ranks\) must "
        rf"build the step alike .*\n  - {field}.*: rank 0 has {values[0]}, rank 1 has "
        rf"{values[1]}\n"
    )
    assert two_ranks[0][key] == two_ranks[1][key]
    assert re.search(want, two_ranks[0][key]), two_ranks[0][key]


def test_a_failing_rank_does_not_hang_the_others(two_ranks):
    assert two_ranks[1]["hang"]["error"] == "ValueError: rank failed"
    survivor = two_ranks[0]["hang"]
    assert survivor["error"] is not None, "rank 0 finished a step its peer never joined"
    assert survivor["seconds"] < HANG_TIMEOUT_S + 10, survivor


# -------------------------------------------------------------------- in-process, one rank


def test_one_graph_one_all_reduce(two_ranks, three_ranks):
    """Compiled (fullgraph, so no breaks): one graph, never recompiled, with one all-reduce for
    float32 grads -- grads, loss, flag and buffers packed -- also with accumulation; bf16 grads
    add a small float32 one for the loss, flag and buffers."""
    for res in two_ranks:
        assert res["all_reduces"] == {"compiled": [1], "acc": [1], "sr": [2]}
    for res in three_ranks:  # compiled on 3 ranks with FUNCAMP_TEST_EXHAUSTIVE=1 only
        assert res["all_reduces"] == ({"compiled": [1]} if exhaustive.ON else {})


def test_one_rank_group_is_bit_identical_to_no_group(single_rank_group):
    batches = _batches()
    plain = funcamp.make_train_step(_loss_fn, _adam(), POLICY, compile=False, donate_state=False)
    dp = _dp_step(single_rank_group, _adam(), compile=False)
    a, ma = _train(plain, _init(_adam()), batches)
    b, mb = _train(dp, _init(_adam()), batches)
    assert_trees_equal(a, b)
    assert_trees_equal(ma, mb)


@pytest.mark.parametrize("make_opt", [_adam, lambda: funcamp.sgd(0.05)])
def test_donated_data_parallel_step(single_rank_group, make_opt):
    """donate_state with a group (grads are views of the all-reduced buffer): the same bits as
    the donated step without a group (plain SGD takes torch's fused kernel on both), and the
    state's own tensors come back."""
    batches = _batches()
    alone = funcamp.make_train_step(_loss_fn, make_opt(), POLICY, compile=False, donate_state=True)
    dp = _dp_step(single_rank_group, make_opt(), compile=False, donate_state=True)
    start = _init(make_opt())
    w1 = start.params["w1"]
    a, ma = _train(alone, _init(make_opt()), batches)
    b, mb = _train(dp, start, batches)
    assert b.params["w1"] is w1
    assert_trees_equal(a, b)
    assert_trees_equal(ma, mb)


def test_group_is_checked_when_the_step_is_built(single_rank_group):
    with pytest.raises(TypeError, match=r"`group` must be a torch\.distributed\.ProcessGroup"):
        _dp_step("world", _adam())


def test_group_needs_an_initialized_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed initialized"):
        _dp_step(object(), _adam())


def test_train_ddp_example_runs_in_one_process(tmp_path):
    """examples/train_ddp.py (also checked by hand with torchrun --nproc-per-node 2)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
    spec = importlib.util.spec_from_file_location("_example_train_ddp", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = ["--steps", "30", "--no-compile", "--out", str(tmp_path)]
    assert example.main(args) < 0.2
    assert example.main([*args[:1], "35", *args[2:], "--resume"]) < 0.2
    assert funcamp.checkpoint_info(tmp_path / "mixed_float16").metadata["step"] == 35
    assert not dist.is_initialized()


def _fields(settings, state=None):
    return {p: k for p, k, _ in fingerprint(settings, {} if state is None else state)}


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(p for p in a.keys() | b.keys() if a.get(p) != b.get(p))


@pytest.mark.parametrize(
    ("make", "leaf"),
    [
        (lambda: funcamp.adamw(2e-3), "lr"),
        (lambda: funcamp.adamw(1e-3, b1=0.8), "b1"),
        (lambda: funcamp.adamw(1e-3, weight_decay=0.1), "weight_decay"),
        (lambda: funcamp.adamw(1e-3, eps=1e-6), "eps"),
        (lambda: funcamp.adamw(funcamp.cosine_decay_schedule(1e-3, 99)), "decay_steps"),
        (lambda: funcamp.chain(funcamp.clip_by_global_norm(2.0), funcamp.adamw(1e-3)), "max_norm"),
    ],
)  # fmt: skip
def test_the_optimizer_fingerprint_names_the_hyperparameter_that_differs(make, leaf):
    """Built twice alike, two optimizers describe alike (another process builds its own); a
    hyperparameter that differs shows up under its own name (floats by their bits)."""
    base = {
        "lr": lambda: funcamp.adamw(1e-3),
        "b1": lambda: funcamp.adamw(1e-3),
        "weight_decay": lambda: funcamp.adamw(1e-3),
        "eps": lambda: funcamp.adamw(1e-3),
        "decay_steps": lambda: funcamp.adamw(funcamp.cosine_decay_schedule(1e-3, 100)),
        "max_norm": lambda: funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.adamw(1e-3)),
    }[leaf]
    assert _fields({"optimizer": base()}) == _fields({"optimizer": base()})
    differ = _differ(_fields({"optimizer": base()}), _fields({"optimizer": make()}))
    assert differ and all(p.rsplit(".", 1)[-1] == leaf for p in differ), differ


def test_the_fingerprint_of_a_policy_a_scaler_and_options():
    mixed = funcamp.get_policy("mixed_bfloat16")
    softmax = mixed.with_op_rules({"softmax": funcamp.OpRule.COMPUTE})
    assert _differ(_fields({"policy": mixed}), _fields({"policy": softmax})) == [
        "policy.ops['softmax']"
    ]
    state = _init(_adam())
    slow = state._replace(scaler=funcamp.ScalerState.dynamic(2.0**8, growth_interval=3))
    other_seed = _init(_adam(), seed=2)  # values are not compared: the first call broadcasts
    assert _differ(_fields({}, state), _fields({}, slow)) == ["state.scaler.growth_interval"]
    assert _differ(_fields({}, state), _fields({}, other_seed)) == []
    opts = {"grad_norm": True, "compile": funcamp.Compile(backend="aot_eager")}
    assert _differ(
        _fields({"options": opts}), _fields({"options": {**opts, "grad_norm": False}})
    ) == ["options['grad_norm']"]


def test_a_difference_is_named_with_each_ranks_value():
    same = [("optimizer.cfg.lr", "a", "0.001")]
    refuse_differences("make_train_step", "parallel=X", [same, same, same])  # no error
    odd = [("optimizer.cfg.lr", "b", "0.002"), ("policy.compute_dtype", "c", "torch.float16")]
    with pytest.raises(ValueError) as e:
        refuse_differences("make_train_step", "parallel=X (3 ranks)", [same, odd, same])
    assert str(e.value).splitlines()[1:3] == [
        "  - the optimizer's `lr` (optimizer.cfg.lr): ranks 0, 2 have 0.001, rank 1 has 0.002",
        "  - the policy's `compute_dtype` (policy.compute_dtype): ranks 0, 2 have nothing "
        "there, rank 1 has torch.float16",
    ]
