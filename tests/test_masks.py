"""Masks and labels, one convention for every optimizer and combinator: a pytree of values (or a
prefix of one), a callable of the dotted leaf path, or a callable of the params (optax's). A mask
that selects nothing is refused by ``init``, naming the mask and the paths it was given."""

from __future__ import annotations

import sys

import optree
import pytest
import torch
from torch.utils._python_dispatch import _len_torch_dispatch_stack

import funcamp


def _params():
    return {"encoder": {"weight": torch.ones(2, 2), "bias": torch.ones(2)}, "head": torch.ones(2)}


def _grads():
    return {"encoder": {"weight": torch.ones(2, 2), "bias": torch.ones(2)}, "head": torch.ones(2)}


def _typo(path):
    return path.endswith("weigth")


@pytest.mark.parametrize(
    "make",
    [
        lambda: funcamp.masked(funcamp.adamw(0.1), _typo),
        lambda: funcamp.adamw(0.1, weight_decay=0.1, mask=_typo),
        lambda: funcamp.lion(0.1, mask=_typo),
        lambda: funcamp.masked(funcamp.sgd(0.1), {"encoder": False, "head": False}),
    ],
    ids=["masked", "adamw", "lion", "masked-pytree"],
)
def test_a_mask_that_selects_nothing_is_refused_at_init(make):
    opt = make()
    with pytest.raises(ValueError) as caught:
        opt.init(_params())
    message = str(caught.value)
    assert "selects none of the 3 param leaves it was given" in message
    assert "'encoder.bias', 'encoder.weight', 'head'" in message
    if "pytree" not in message and "False" not in message:
        assert "_typo (" in message and "test_masks.py" in message  # names the mask


def test_a_multi_transform_label_no_leaf_gets_is_refused():
    opt = funcamp.multi_transform(
        {"decay": funcamp.sgd(0.1), "no_decay": funcamp.sgd(0.1)},
        lambda path: "no_decay" if path.endswith("bais") else "decay",
    )
    with pytest.raises(ValueError, match=r"`labels` .* selects none of the 3 param leaves"):
        opt.init(_params())


def _run(opt):
    params = _params()
    updates, _ = opt.update(_grads(), opt.init(params), params)
    return funcamp.apply_updates(params, updates)


@pytest.mark.parametrize(
    "mask",
    [
        lambda path: path.endswith("weight"),  # the path, as masked takes it
        lambda ps: {"encoder": {"weight": True, "bias": False}, "head": False},  # the params
        lambda ps: optree.tree_map(
            lambda p: p.ndim > 1, ps, namespace="funcamp"
        ),  # optax's usual example
        {"encoder": {"weight": True, "bias": False}, "head": False},
    ],
    ids=["path", "params", "params-tree-map", "pytree"],
)
def test_every_mask_convention_gives_the_same_adamw_and_masked(mask):
    plain = _run(funcamp.adam(0.1))
    decayed = _run(funcamp.adamw(0.1, weight_decay=0.5))
    got = _run(funcamp.adamw(0.1, weight_decay=0.5, mask=mask))
    assert torch.equal(got["encoder"]["weight"], decayed["encoder"]["weight"])
    assert torch.equal(got["encoder"]["bias"], plain["encoder"]["bias"])
    assert torch.equal(got["head"], plain["head"])
    only = _run(funcamp.masked(funcamp.sgd(1.0), mask))
    assert torch.equal(only["encoder"]["weight"], torch.zeros(2, 2))
    assert torch.equal(only["head"], torch.ones(2))


def test_a_mask_of_neither_convention_is_a_funcamp_error():
    with pytest.raises(TypeError) as caught:
        funcamp.adamw(0.1, mask=lambda x: x.no_such_thing).init(_params())
    message = str(caught.value)
    assert message.startswith("funcamp.adamw: `mask` ")
    assert "callable of the dotted leaf path" in message and "called with the params" in message


@pytest.mark.slow
def test_a_path_mask_traces_in_one_graph():
    """Under dynamo the detection (a path callable tried first) folds away: fullgraph=True."""
    opt = funcamp.adamw(0.1, weight_decay=0.5, mask=lambda path: path.endswith("weight"))
    params = _params()
    state = opt.init(params)
    eager, _ = opt.update(_grads(), state, params)
    # A full run once hit a RecursionError inside dynamo here (never reproduced: not alone, not
    # after every test before it in one process). Nothing the worker ran before may reach into
    # this trace: a fresh dynamo, no torch function or dispatch mode left on a stack, and the
    # interpreter's usual recursion limit (the trace needs under 200 frames), each checked so a
    # failure names its cause.
    torch._dynamo.reset()
    assert torch._C._len_torch_function_stack() == 0, "a torch function mode was left on"
    assert _len_torch_dispatch_stack() == 0, "a dispatch mode was left on"
    assert sys.getrecursionlimit() >= 1000, sys.getrecursionlimit()
    compiled, _ = torch.compile(opt.update, backend="eager", fullgraph=True)(
        _grads(), state, params
    )
    for a, b in zip(optree.tree_leaves(eager), optree.tree_leaves(compiled)):
        assert torch.equal(a, b)
