"""Compiled steps over many leaves: what funcamp does to keep their compile time down changes no
result.

Under torch.compile funcamp flattens a plain dict of tensors without optree (dynamo would trace
optree's flattening in Python, ~350 bytecode instructions a leaf), selects with a mapped
``torch.where`` instead of flattening both trees, and spreads each 0-d step scalar (the unscale
factor, the skip flag, the learning rate) over the leaves as a few ``funcamp::copies`` so that
inductor's fusion search does not pair every leaf's kernels through one shared buffer. These
tests hold the compiled results to eager's on trees that exercise each of those (bit for bit
under aot_eager, which runs eager's ops; within float rounding under inductor, which generates
its own code for the update as for torch.compile of torch.optim's step, while the skip flags,
the scales and every tree's order stay exact):
dicts whose key order is not sorted (optree flattens in sorted order and rebuilds in the dict's
own), grads whose dict order differs from the params', more leaves than one copy serves, a
skipped step, and vmap.
"""

from __future__ import annotations

import optree
import pytest
import torch
from bitwise import assert_bitwise
from exhaustive import exhaustive

import funcamp

#: 13 leaves of assorted shapes, keys deliberately out of sorted order.
SHAPES = {
    "z.w": (7, 5),
    "b": (5,),
    "m.0": (3, 4, 2),
    "a.bias": (1,),
    "k": (9,),
    "c": (2, 2),
    "y": (6,),
    "d": (4, 3),
    "x.w": (5, 5),
    "e": (),
    "q": (8,),
    "f": (3,),
    "g": (2, 3),
}


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _grads(params: dict[str, torch.Tensor], step: int, scale: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = {k: (0.5 * p + torch.randn(p.shape, generator=g)) * scale for k, p in params.items()}
    if step == 2:  # a skipped step: one non-finite leaf
        out["k"] = out["k"].clone()
        out["k"][3] = float("inf")
    return dict(reversed(list(out.items())))  # grads in another key order than the params


def _assert_within_rounding(eager, compiled) -> None:
    """The same trees (structure and key order), the same skips and scales, and every float
    leaf within float32 rounding of eager's."""
    (e_leaves, e_spec), (c_leaves, c_spec) = (
        optree.tree_flatten(x, namespace="funcamp") for x in (eager, compiled)
    )
    assert e_spec == c_spec
    for a, b in zip(e_leaves, c_leaves):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _step(opt):
    def step(scaler, grads, opt_state, params):
        new_params, new_state, info = funcamp.unscale_and_step(
            scaler, opt, grads, opt_state, params
        )
        return new_params, new_state, funcamp.update(scaler, info.found_inf), info.found_inf

    return step


def _run(step, opt, steps: int = 4):
    params = _params(0)
    state = opt.init(params)
    scaler = funcamp.ScalerState.dynamic(init_scale=2.0**10, growth_interval=2)
    out = []
    for i in range(steps):
        grads = _grads(params, i, float(scaler.scale))
        params, state, scaler, found = step(scaler, grads, state, params)
        out.append((params, state, scaler.scale, found))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda: funcamp.adamw(funcamp.linear_schedule(0.1, 0.01, 3), weight_decay=0.1),
        # Nesterov SGD under inductor: in the suite through test_optim's inductor test
        pytest.param(lambda: funcamp.sgd(0.05, momentum=0.9, nesterov=True), marks=exhaustive),
    ],
    ids=["adamw_schedule", "sgd_nesterov"],
)
def test_inductor_step_over_many_leaves_follows_eager(make) -> None:
    opt = make()
    step = _step(opt)
    eager = _run(step, opt)
    torch._dynamo.reset()
    compiled = _run(torch.compile(step, fullgraph=True), opt)
    assert [bool(e[3]) for e in eager] == [False, False, True, False]
    for e, c in zip(eager, compiled):
        assert torch.equal(e[2], c[2]) and torch.equal(e[3], c[3])  # scale, found_inf
        _assert_within_rounding(e, c)
        assert list(c[0]) == list(SHAPES)  # params keep their own key order


def test_compiled_step_spreads_its_scalars_over_the_leaves() -> None:
    """The traced graph holds funcamp::copies calls (the skip flag, the unscale factor and the
    learning rate spread over the 13 leaves), and the aot_eager results equal eager's."""
    opt = funcamp.adam(1e-2)
    step = _step(opt)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager = _run(step, opt, steps=3)
    torch._dynamo.reset()
    compiled = _run(torch.compile(step, backend=backend, fullgraph=True), opt, steps=3)
    for e, c in zip(eager, compiled):
        assert_bitwise(e, c)
    copies = [
        n
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and "funcamp.copies" in str(n.target).replace("::", ".")
    ]
    # one copy per 4 leaves: ceil(13 / 4) for a per-leaf scalar, ceil(27 / 4) for the skip flag
    # over the optimizer state (count, mu, nu)
    assert sorted({n.args[1] for n in copies}) == [4, 7], [n.args for n in copies]


@pytest.mark.slow
def test_compiled_vmapped_update_over_many_leaves_matches_eager() -> None:
    """funcamp::copies batches under vmap (an ensemble of optimizer states, compiled)."""
    opt = funcamp.adam(0.1, 0.8, 0.99)
    gen = torch.Generator().manual_seed(3)
    params = {k: torch.randn(3, *s, generator=gen) for k, s in SHAPES.items()}
    states = torch.func.vmap(opt.init)(params)
    grads = {k: torch.randn(p.shape, generator=gen) for k, p in params.items()}

    def update(g, s, p):
        return torch.func.vmap(opt.update)(g, s, p)

    compiled = torch.compile(update, fullgraph=True)
    e_state = c_state = states
    for i in range(2):
        g = {k: v * (i + 1) - params[k] for k, v in grads.items()}
        eager, e_state = update(g, e_state, params)
        out, c_state = compiled(g, c_state, params)
        _assert_within_rounding((eager, e_state), (out, c_state))


def test_compiled_tree_select_keeps_each_dicts_order() -> None:
    """tree_select under compile (a mapped torch.where): the result has on_true's structure and
    key order, for a dict given in another key order and for nested containers."""
    new = {"b": torch.ones(2), "a": [torch.zeros(1), (torch.full((3,), 2.0), None)], "c": 4}
    old = {"a": [torch.ones(1), (torch.ones(3), None)], "c": 4, "b": torch.zeros(2)}
    select = torch.compile(funcamp.tree_select, backend="eager", fullgraph=True)
    for pred in (True, False):
        got = select(torch.tensor(pred), new, old)
        want = funcamp.tree_select(torch.tensor(pred), new, old)
        assert list(got) == list(want) == ["b", "a", "c"]
        assert_bitwise(got, want)


def test_compiled_structure_errors_say_what_eager_says() -> None:
    """A tree that does not match, under compile, gives eager's message (dynamo wraps it): the
    dict treespec made without optree raises before any lookup and prints as optree's."""
    opt = funcamp.adam(0.1)
    params = {"b": torch.ones(3), "a": torch.ones(2)}

    def update(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return funcamp.apply_updates(params, updates), state

    def apply(params, updates):
        return funcamp.apply_updates(params, updates)

    cases = [
        (update, ({"b": torch.ones(3)}, opt.init(params), params)),  # a grad missing
        (update, ({**params, "c": torch.ones(1)}, opt.init(params), params)),  # one too many
        (update, (dict(params), opt.init({"b": torch.ones(3)}), params)),  # another state
        (apply, (params, {"b": torch.ones(3)})),  # updates missing a leaf
    ]
    for fn, args in cases:
        with pytest.raises(ValueError) as eager:
            fn(*args)
        torch._dynamo.reset()
        with pytest.raises(Exception) as compiled:
            torch.compile(fn, backend="eager", fullgraph=True)(*args)
        assert str(eager.value) in str(compiled.value).replace("\\'", "'")
