"""Low-precision params: master weights, Kahan summation and stochastic rounding."""

from __future__ import annotations

import math

import optree
import pytest
import torch
from bitwise import same_bits
from exhaustive import exhaustive
from hypothesis import given, settings
from hypothesis import strategies as st

import funcamp
from funcamp._core.rounding import (
    bits_from_key,
    leaf_keys,
    random_bits,
    round_nearest,
    round_stochastic,
)
from funcamp.optim import REGISTRY, MasterWeightsState, SetParam

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

MODES = {
    "plain": {},
    "master_weights": {"master_weights": True},
    "kahan": {"kahan": True},
    "stochastic_rounding": {"stochastic_rounding": True, "seed": 7},
}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(torch.int32)


# ---------------------------------------------------------------------------------------------
# rounding primitives


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_nearest_matches_torch_cast(dtype):
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    x = torch.cat(
        [
            bits.to(torch.int32).view(torch.float32),
            torch.randn(50_000, generator=g) * 1e-5,
            torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65520.0, 2**-25]),
            torch.tensor([3 * 2**-26, 3.39e38, 1e-40, -1e-40]),
        ]
    )
    ref = x.to(dtype)
    got = round_nearest(x, dtype).to(dtype)
    same = (_bits(ref) == _bits(got)) | (ref.isnan() & got.isnan())
    assert bool(same.all()), x[~same][:5]


@settings(max_examples=40, deadline=None)
@given(
    x=st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=True, width=32),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_stochastic_rounding_is_unbiased(x, dtype, seed):
    n = 20_000
    xs = torch.full((n,), x, dtype=torch.float32)
    noise = random_bits(torch.tensor(seed), torch.tensor(3), 1, xs.shape)
    r = round_stochastic(xs, dtype, noise)
    mant_bits = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    emin = math.log2(torch.finfo(dtype).tiny)
    ulp = 2.0 ** (max(math.floor(math.log2(abs(x))) if x else emin, emin) - mant_bits)
    assert bool((r.to(dtype).float() == r).all())  # exactly representable
    assert bool(((r.double() - x).abs() <= ulp).all())  # one of the two neighbours
    mean = r.double().mean().item()
    # binomial standard error of the mean is at most ulp / (2 sqrt(n)); allow 5 sigma
    assert abs(mean - x) <= 5 * ulp / (2 * n**0.5) + 1e-12 * abs(x)


def test_random_bits_are_deterministic_and_keyed():
    a = random_bits(torch.tensor(1), torch.tensor(5), 0, torch.Size([1000]))
    state = torch.get_rng_state()
    b = random_bits(torch.tensor(1), torch.tensor(5), 0, torch.Size([1000]))
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is not touched
    assert torch.equal(a, b)
    for other in (
        random_bits(torch.tensor(2), torch.tensor(5), 0, torch.Size([1000])),
        random_bits(torch.tensor(1), torch.tensor(6), 0, torch.Size([1000])),
        random_bits(torch.tensor(1), torch.tensor(5), 1, torch.Size([1000])),
    ):
        assert (a != other).float().mean() > 0.99
    assert a.min() >= 0 and a.max() < 2**31
    assert abs(a.double().mean().item() / 2**31 - 0.5) < 0.05


@pytest.mark.parametrize("seed, count", [(0, 0), (7, 3), (2**40 + 5, 2**33 - 1), (-3, 9)])
def test_leaf_keys_give_each_leafs_random_bits(seed, count):
    """The stochastic-rounding step hashes every leaf's key at once (leaf_keys) and each leaf's
    elements from its key: the same bits as random_bits for that leaf."""
    seed_t, count_t = (
        torch.tensor(seed),
        torch.tensor(count, dtype=torch.int32 if count < 2**31 else torch.int64),
    )
    keys = leaf_keys(seed_t, count_t, 5)
    assert keys.shape == (5,) and keys.dtype == torch.int64
    for i, shape in enumerate([(3,), (4, 5), (), (2, 3, 4), (1,)]):
        want = random_bits(seed_t, count_t, i, torch.Size(shape))
        got = bits_from_key(keys[i], torch.Size(shape))
        assert got.shape == want.shape and torch.equal(got, want)


def _xor_nodes_of_compiled_sr_update(n_leaves):
    """The number of xor nodes in the graph dynamo captures for a stochastic-rounding update
    over ``n_leaves`` bfloat16 leaves, and the shapes of the int64 tensors it puts in a buffer
    of their own (``as_strided``: the leaves' keys)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    opt = funcamp.adam(1e-2, stochastic_rounding=True, seed=3)
    params = {f"w{i}": torch.ones(4, 3, dtype=torch.bfloat16) for i in range(n_leaves)}
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    state = opt.init(params)
    torch._dynamo.reset()
    torch.compile(opt.update, backend=backend, fullgraph=True)(grads, state, params)
    (gm,) = graphs
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    xors = sum("xor" in str(n.target) for n in calls)
    key_buffers = [
        n.args[0].meta["example_value"].shape
        for n in calls
        if "as_strided" in str(n.target) and n.args[0].meta["example_value"].dtype == torch.int64
    ]
    return xors, key_buffers


def test_stochastic_rounding_hashes_the_key_chain_once_per_step_not_per_leaf():
    """Compile time: each hash step reads its input twice, and inductor inlines a pointwise
    chain into every element that reads it, so a key chain hashed per leaf (3 hashes) grew the
    kernels' bodies as a power of two: 8 bf16 leaves took minutes to compile. The keys of all
    leaves are hashed together, into a buffer of their own (computed_once); each extra
    leaf adds only its elements' hash (1 + 3 xors)."""
    xors_2, keys_2 = _xor_nodes_of_compiled_sr_update(2)
    xors_6, keys_6 = _xor_nodes_of_compiled_sr_update(6)
    assert (xors_6 - xors_2) / 4 == 4  # per leaf: key ^ index, then the hash's three
    assert keys_2 == [(2,)] and keys_6 == [(6,)]  # the keys' own buffer, once per step


# ---------------------------------------------------------------------------------------------
# the stall problem


def _stall_run(mode: str, steps: int = 200):
    g = torch.Generator().manual_seed(0)
    target = 1.0 + 0.02 + 0.04 * torch.rand(512, generator=g)
    params = {"w": torch.ones(512, dtype=torch.bfloat16)}
    opt = funcamp.sgd(0.05, **MODES[mode])
    state = opt.init(params)
    for _ in range(steps):
        grads = {"w": params["w"].float() - target}  # d/dw of 0.5 * (w - target)**2
        updates, state = opt.update(grads, state, params)
        params = funcamp.apply_updates(params, updates)
    return (params["w"].float() - target).abs().mean().item()


def test_plain_bf16_sgd_stalls_while_modes_keep_improving():
    # lr * |grad| <= 0.05 * 0.06 = 0.003 < half a bfloat16 ulp at 1.0 (2**-8 = 0.0039)
    errors = {mode: _stall_run(mode) for mode in MODES}
    start = 1.0 + 0.02 + 0.04 * torch.rand(512, generator=torch.Generator().manual_seed(0))
    assert errors["plain"] == pytest.approx((start - 1.0).abs().mean().item())  # no progress
    half_ulp = 2.0**-8  # the modes end within half an ulp of the target on average
    assert errors["master_weights"] < half_ulp
    assert errors["kahan"] < half_ulp
    assert errors["stochastic_rounding"] < half_ulp
    assert max(errors[m] for m in MODES if m != "plain") < errors["plain"] / 8


def test_master_weights_land_exactly_on_the_rounded_master():
    params = {"w": torch.ones(3, dtype=torch.bfloat16), "f": torch.ones(2)}
    opt = funcamp.sgd(1.0, master_weights=True)
    state = opt.init(params)
    assert isinstance(state.low, MasterWeightsState)
    assert state.low.master["f"].numel() == 0  # nothing kept for float32 params
    # a master far below the param: no float32 delta u makes round(1.0 + u) hit 2**-40
    tiny = torch.tensor([2.0**-40, -3.0 * 2.0**-70, 1e-30])
    state = state._replace(low=MasterWeightsState({"w": tiny, "f": state.low.master["f"]}))
    updates, state = opt.update({"w": torch.zeros(3), "f": torch.zeros(2)}, state, params)
    assert isinstance(updates["w"], SetParam) and isinstance(updates["f"], torch.Tensor)
    new = funcamp.apply_updates(params, updates)
    assert torch.equal(new["w"], tiny.to(torch.bfloat16))
    # many random steps: the param is always the master rounded to nearest
    g = torch.Generator().manual_seed(1)
    opt = funcamp.adamw(0.3, master_weights=True)
    params = {"w": torch.randn(64, generator=g).to(torch.bfloat16)}
    state = opt.init(params)
    for _ in range(20):
        updates, state = opt.update({"w": torch.randn(64, generator=g)}, state, params)
        params = funcamp.apply_updates(params, updates)
        assert torch.equal(params["w"], state.low.master["w"].to(torch.bfloat16))


@pytest.mark.parametrize("mode", ["master_weights", "kahan", "stochastic_rounding"])
def test_modes_do_nothing_for_float32_params(mode):
    params = {"w": torch.randn(5, 4)}
    grads = {"w": torch.randn(5, 4)}
    plain, moded = funcamp.adam(0.01, weight_decay=0.1), funcamp.adam(0.01, **MODES[mode])
    plain = funcamp.adam(0.01)
    u1, _ = plain.update(grads, plain.init(params), params)
    u2, _ = moded.update(grads, moded.init(params), params)
    assert torch.equal(u1["w"], u2["w"])


def test_stochastic_rounding_is_reproducible_and_seeded():
    def run(seed):
        opt = funcamp.adam(1e-3, stochastic_rounding=True, seed=seed)
        params = {"w": torch.ones(256, dtype=torch.bfloat16)}
        state = opt.init(params)
        for i in range(3):
            grads = {"w": torch.linspace(-1, 1, 256) * (i + 1)}
            updates, state = opt.update(grads, state, params)
            params = funcamp.apply_updates(params, updates)
        return params["w"]

    torch.manual_seed(0)
    a = run(0)
    torch.manual_seed(123)  # the global RNG plays no part
    assert torch.equal(a, run(0))
    assert not torch.equal(a, run(1))


# ---------------------------------------------------------------------------------------------
# eager vs inductor, bit for bit


def _mode_optimizers():
    sched = funcamp.linear_warmup_cosine_decay(0.02, 2, 10)
    return {
        "plain": funcamp.sgd(0.05),
        "master_weights": funcamp.sgd(
            0.05, 0.9, nesterov=True, weight_decay=1e-3, master_weights=True
        ),
        "kahan": funcamp.adamw(sched, kahan=True),
        "stochastic_rounding": funcamp.adam(1e-2, weight_decay=1e-3, stochastic_rounding=True),
    }


def _params(seed):
    # one leaf per optimizer keeps inductor's cold compile short; the dtypes alternate
    g = torch.Generator().manual_seed(seed)
    dtype = (torch.float16, torch.bfloat16)[seed % 2]
    params = {"half": torch.randn(33, 7, generator=g).to(dtype)}
    if seed == 1:
        params["f32"] = [torch.randn(5, generator=g)]
    return params


@pytest.fixture(scope="module")
def inductor_step():
    opts = _mode_optimizers()

    def step(params, states, grads):
        out_p, out_s = {}, {}
        for name, opt in opts.items():
            updates, out_s[name] = opt.update(grads[name], states[name], params[name])
            out_p[name] = funcamp.apply_updates(params[name], updates)
        return out_p, out_s

    return opts, step, torch.compile(step, fullgraph=True)  # default backend: inductor


@pytest.mark.slow
def test_every_mode_rounds_the_same_bits_eager_and_inductor():
    """The modes round on the float32 bit pattern, so inductor cannot fuse a rounding away:
    given the same float32 results, each mode's new half params and state are eager's bit for
    bit (the mode alone, compiled)."""
    from funcamp.optim._base import NewParams
    from funcamp.optim._modes import init_mode, to_updates

    gen = torch.Generator().manual_seed(5)
    half = [torch.randn(33, 7, generator=gen).to(d) for d in (torch.float16, torch.bfloat16)]
    new = [p.float() + torch.randn(p.shape, generator=gen) / 512 for p in half]
    count = torch.tensor(3, dtype=torch.int32)
    for mode in ("master_weights", "kahan", "stochastic_rounding"):
        low = init_mode(mode, half, optree.tree_structure(half), 11)

        def apply(low, new, mode=mode):
            spec = optree.tree_structure(half)
            return to_updates("t", mode, low, count, NewParams(new), half, spec, True)

        want = apply(low, new)
        got = torch.compile(apply, fullgraph=True)(low, new)
        for a, b in zip(
            optree.tree_leaves(want, namespace=NAMESPACE),
            optree.tree_leaves(got, namespace=NAMESPACE),
        ):
            assert same_bits(a, b), mode


@pytest.mark.slow
@exhaustive
def test_whole_optimizers_in_every_mode_stay_within_rounding_under_inductor(inductor_step):
    """Whole optimizers compiled stay within the compiled step's bound: inductor computes their
    float32 math as it computes torch's. In the exhaustive sweep only: the README's suite holds
    the same four modes, compiled by inductor through make_train_step, to the same bound
    (rtol 2**-7, atol 1e-5) in tests/test_low_precision_train.py
    (test_every_mode_eager_and_inductor_agree_through_make_train_step); this one adds float16
    params and plain SGD."""
    opts, step, compiled = inductor_step
    params = {name: _params(i) for i, name in enumerate(opts)}
    states = {name: opt.init(params[name]) for name, opt in opts.items()}
    pe, se, pc, sc = params, states, params, states
    for i in range(4):
        gen = torch.Generator().manual_seed(100 + i)
        grads = {
            name: optree.tree_map(
                lambda p, g=gen: torch.randn(p.shape, generator=g) / 8, params[name]
            )
            for name in opts
        }
        pe, se = step(pe, se, grads)
        pc, sc = compiled(pc, sc, grads)
    eager = optree.tree_flatten_with_path((pe, se), namespace=NAMESPACE)
    comp = optree.tree_leaves((pc, sc), namespace=NAMESPACE)
    for path, a, b in zip(eager[0], eager[1], comp):
        assert a.dtype == b.dtype, path
        if a.is_floating_point():  # one half ulp at most, where a float32 result differs
            torch.testing.assert_close(b.float(), a.float(), rtol=2**-7, atol=1e-5, msg=str(path))
        else:
            assert torch.equal(a, b), path
    # and the modes did move the half params away from plain rounding
    assert not torch.equal(pe["kahan"]["half"], params["kahan"]["half"])


def test_accumulate_passes_set_param_through_only_on_applying_steps():
    opt = funcamp.accumulate(funcamp.sgd(0.001, kahan=True), every=2)
    params = {"w": torch.ones(4, dtype=torch.bfloat16)}
    state = opt.init(params)
    u1, state = opt.update({"w": torch.ones(4)}, state, params)
    assert isinstance(u1["w"], SetParam) and torch.equal(u1["w"].value, params["w"])
    u2, state = opt.update({"w": torch.ones(4)}, state, params)
    # 1 - 0.001 rounds back to 1.0 in bfloat16; the compensation keeps the -0.001
    assert torch.equal(funcamp.apply_updates(params, u2)["w"], params["w"])
    assert torch.equal(state.inner.low.compensation["w"], torch.full((4,), -0.001).bfloat16())


# ---------------------------------------------------------------------------------------------
# memory


def _bytes_per_param(state, params):
    n = sum(p.numel() for p in optree.tree_leaves(params, namespace=NAMESPACE))
    total = sum(
        t.numel() * t.element_size()
        for t in optree.tree_leaves(state, namespace=NAMESPACE)
        if t.dim() > 0
    )
    return total / n


# The table in funcamp.optim's docstring: (optimizer, mode) -> bytes per element for a half param
TABLE = {
    ("sgd", "plain"): 0, ("sgd", "master_weights"): 4, ("sgd", "kahan"): 2,
    ("sgd", "stochastic_rounding"): 0,
    ("sgd_momentum", "plain"): 4, ("sgd_momentum", "master_weights"): 8,
    ("sgd_momentum", "kahan"): 6, ("sgd_momentum", "stochastic_rounding"): 4,
    ("adam", "plain"): 8, ("adam", "master_weights"): 12, ("adam", "kahan"): 10,
    ("adam", "stochastic_rounding"): 8,
    ("lion", "plain"): 4, ("lion", "master_weights"): 8, ("lion", "kahan"): 6,
    ("lion", "stochastic_rounding"): 4,
}  # fmt: skip
FACTORIES = {
    "sgd": lambda **kw: funcamp.sgd(0.1, **kw),
    "sgd_momentum": lambda **kw: funcamp.sgd(0.1, momentum=0.9, **kw),
    "adam": lambda **kw: funcamp.adam(0.1, **kw),
    "lion": lambda **kw: funcamp.lion(0.1, **kw),
}


@pytest.mark.parametrize(("name", "mode"), list(TABLE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_state_bytes_per_param_match_the_documented_table(name, mode, dtype):
    params = {"a": torch.zeros(64, 8, dtype=dtype), "b": torch.zeros(100, dtype=dtype)}
    opt = FACTORIES[name](**MODES[mode])
    expected = TABLE[(name, mode)] if dtype != torch.float32 else TABLE[(name, "plain")]
    assert _bytes_per_param(opt.init(params), params) == expected
    acc = funcamp.accumulate(opt, 4)
    assert _bytes_per_param(acc.init(params), params) == expected + 4
    assert (
        funcamp.optim.__doc__ is not None and "master 12, kahan 10, SR 8" in funcamp.optim.__doc__
    )


#: what a mode adds per element of a half param, for every registered optimizer with the modes
MODE_BYTES = {"master_weights": 4, "kahan": 2, "stochastic_rounding": 0}


@pytest.mark.parametrize("mode", sorted(MODE_BYTES))
@pytest.mark.parametrize("name", [n for n, e in REGISTRY.items() if e.modes])
def test_a_mode_adds_the_documented_bytes_to_every_optimizer(name, mode):
    """The docstring's rule, for every registered optimizer (one torch lacks too): a mode adds
    4 B (master), 2 B (Kahan) or nothing (SR) per element of a half param, and nothing for a
    float32 param; ``accumulate`` adds its 4 B on top."""
    entry = REGISTRY[name]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        params = {"a": torch.zeros(8, 6, dtype=dtype), "b": torch.zeros(4, 8, dtype=dtype)}
        plain = _bytes_per_param(entry.make().init(params), params)
        moded = entry.make(**MODES[mode])
        added = MODE_BYTES[mode] if dtype != torch.float32 else 0
        assert _bytes_per_param(moded.init(params), params) == plain + added, dtype
        acc = funcamp.accumulate(moded, 2)
        assert _bytes_per_param(acc.init(params), params) == plain + added + 4, dtype
