"""A systematic bad-input pass over the public API (issue 18).

Every case calls a public function with a wrong type, value, shape or structure and asserts that
it raises an error whose message starts with ``funcamp.`` (the API's name), or returns a result
checked to be right; and that no failing call changed any of its inputs -- donated or not --
bit for bit (inputs are snapshotted with clones before the call and compared after it).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcamp
from funcamp.scaling.skip import device_path
from funcamp.testing import assert_trees_equal

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"

NAN, INF = float("nan"), float("inf")


# --------------------------------------------------------------------------------------------
# snapshots: structure and every tensor's bytes


def _leaves(tree: Any) -> tuple[list[Any], Any]:
    return optree.tree_flatten(tree, namespace=NAMESPACE, none_is_leaf=True)


class Snapshot:
    """The structure of ``trees`` and a clone of each tensor leaf (with its identity)."""

    def __init__(self, *trees: Any) -> None:
        self.trees = trees
        self.items = []
        for tree in trees:
            leaves, spec = _leaves(tree)
            saved = [
                (x, x.detach().clone()) if isinstance(x, torch.Tensor) else (x, None)
                for x in leaves
            ]
            self.items.append((spec, saved))

    def assert_unchanged(self) -> None:
        for tree, (spec, saved) in zip(self.trees, self.items):
            leaves, now = _leaves(tree)
            assert now == spec, f"the structure of an input changed: {spec} -> {now}"
            for x, (orig, copy) in zip(leaves, saved):
                assert x is orig, "a leaf of an input was replaced"
                if copy is None:
                    continue
                assert x.dtype == copy.dtype and x.shape == copy.shape
                a = x.detach().reshape(-1).contiguous().view(torch.uint8)
                b = copy.reshape(-1).contiguous().view(torch.uint8)
                assert torch.equal(a, b), "a tensor of an input was modified"


def expect_error(fn: Callable[..., Any], *args: Any, match: str | None = None, **kwargs: Any):
    """``fn(*args, **kwargs)`` raises a ``funcamp.``-prefixed error and changes no input."""
    snap = Snapshot(args, kwargs)
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert msg.startswith("funcamp."), f"not a funcamp error: {type(info.value).__name__}: {msg}"
    if match is not None:
        assert match in msg, msg
    snap.assert_unchanged()
    return info.value


# --------------------------------------------------------------------------------------------
# fixtures of the table below


def _params() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[0.5], [-1.0]]), "b": torch.tensor([0.25])}


def _grads() -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[1.0], [2.0]]), "b": torch.tensor([-0.5])}


GS_DICT = {
    "scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 10,
    "_growth_tracker": 0,
}


def _gs(**changes: Any) -> dict[str, Any]:
    return {**GS_DICT, **changes}


def _scaler_with(**leaves: Any) -> funcamp.ScalerState:
    s = funcamp.ScalerState.dynamic(1024.0)
    kw = {n: getattr(s, n) for n in ("scale", "growth_tracker", "hysteresis_tracker", "skipped")}
    kw.update(leaves)
    return funcamp.ScalerState(**kw)


def _scaler_sd(**changes: Any) -> dict[str, Any]:
    sd = funcamp.state_dict(funcamp.ScalerState.dynamic(1024.0, growth_interval=10))
    sd.update(changes)
    return sd


BAD_LRS = {
    "nan": NAN,
    "inf": INF,
    "negative": -0.1,
    "str": "fast",
    "none": None,
    "bool": True,
    "tensor_1elem": torch.tensor([0.1]),
    "tensor_2elem": torch.tensor([0.1, 0.2]),
    "tensor_int": torch.tensor(1),
    "tensor_nan": torch.tensor(NAN),
    "tensor_negative": torch.tensor(-0.1),
    "tensor_inf": torch.tensor(INF),
    "tensor_complex": torch.tensor(1j),
    "sched_no_args": lambda: torch.tensor(0.1),
    "sched_python_float": lambda c: 0.1,
    "sched_none": lambda c: None,
    "sched_str": lambda c: "0.1",
    "sched_1elem": lambda c: torch.tensor([0.1]),
    "sched_2elem": lambda c: torch.tensor([0.1, 0.2]),
    "sched_int": lambda c: torch.tensor(1),
    "sched_nan": lambda c: torch.tensor(NAN),
    "sched_negative": funcamp.constant_schedule(-0.1),
    "sched_raises": lambda c: 1 / 0,
}

OPTIMIZER_FACTORIES = {
    "sgd": funcamp.sgd,
    "adam": funcamp.adam,
    "adamw": funcamp.adamw,
}


def _cases() -> list[Any]:
    """``(id, thunk)``: the thunk returns ``(fn, args, kwargs)``, built fresh for each run."""
    cases: list[Any] = []

    def add(case_id: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        cases.append(pytest.param(lambda: (fn, args, kwargs), id=case_id))

    def add_lazy(case_id: str, thunk: Callable[[], tuple[Any, tuple, dict]]) -> None:
        cases.append(pytest.param(thunk, id=case_id))

    # learning rates of every optimizer
    for opt_name, factory in OPTIMIZER_FACTORIES.items():
        for lr_name, lr in BAD_LRS.items():
            add(f"{opt_name}-lr-{lr_name}", factory, lr)
    # other hyperparameters
    for name, kwargs in {
        "momentum-neg": {"momentum": -0.9},
        "momentum-nan": {"momentum": NAN},
        "momentum-str": {"momentum": "0.9"},
        "dampening>1": {"dampening": 1.5},
        "wd-neg": {"weight_decay": -1.0},
        "nesterov-no-momentum": {"nesterov": True},
        "two-modes": {"kahan": True, "master_weights": True},
        "seed-float": {"seed": 1.5},
    }.items():
        add(f"sgd-{name}", funcamp.sgd, 0.1, **kwargs)
    for name, kwargs in {
        "b1=1": {"b1": 1.0},
        "b1-neg": {"b1": -0.1},
        "b2-nan": {"b2": NAN},
        "b2-str": {"b2": "x"},
        "eps-neg": {"eps": -1e-8},
        "wd-inf": {"weight_decay": INF},
        "three-modes": {"kahan": True, "master_weights": True, "stochastic_rounding": True},
        "seed-bool": {"seed": True},
    }.items():
        add(f"adam-{name}", funcamp.adam, 0.1, **kwargs)
        add(f"adamw-{name}", funcamp.adamw, 0.1, **kwargs)
    for v in (0.0, -1.0, NAN, "1"):
        add(f"clip-{v}", funcamp.clip_by_global_norm, v)
    for v in (0, -2, 1.5, True, "2"):
        add(f"accumulate-every-{v}", funcamp.accumulate, funcamp.sgd(0.1), v)
    add("accumulate-not-optimizer", funcamp.accumulate, "sgd", 2)
    add("chain-not-optimizer", funcamp.chain, funcamp.sgd(0.1), lambda g: g)

    # schedules
    for args in [(NAN,), (INF,), ("x",), (None,)]:
        add(f"constant_schedule-{args[0]}", funcamp.constant_schedule, *args)
    for args in [(0.1, 0.0, 0), (0.1, 0.0, 10, -1), (0.1, NAN, 10), (0.1, 0.0, 2.5)]:
        add(f"linear_schedule-{args}", funcamp.linear_schedule, *args)
    for args in [(0.1, 0), (0.1, 10, -0.5), (0.1, 10, 0.0, 0.0), (INF, 10)]:
        add(f"cosine_decay_schedule-{args}", funcamp.cosine_decay_schedule, *args)
    for args in [(0.1, 10, 0), (0.1, -1, 5), (NAN, 1, 5), (0.1, 1, 5, 0.0, 0.0, -1.0)]:
        add(f"warmup_cosine-{args}", funcamp.linear_warmup_cosine_decay, *args)

    # optimizer update with states that do not match the params
    def state_case(opt: funcamp.Optimizer, corrupt: Callable[[Any], Any], donate: bool | None):
        def thunk():
            params, grads = _params(), _grads()
            state = corrupt(opt.init(params))
            if donate is None:
                return opt.update, (grads, state, params), {}
            scaler = funcamp.ScalerState.dynamic(4.0)
            kw = {"donate_grads": donate, "donate_state": donate}
            return funcamp.unscale_and_step, (scaler, opt, grads, state, params), kw

        return thunk

    sgdm = funcamp.sgd(0.1, momentum=0.9)
    adam = funcamp.adam(0.1)
    acc = funcamp.accumulate(funcamp.adam(0.1), 2)
    chained = funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.sgd(0.1, momentum=0.5))
    corruptions = {
        "sgd-momentum-(3,)": (sgdm, lambda s: s._replace(momentum={**s.momentum, "b": torch.zeros(3)})),
        "sgd-momentum-(2,)": (sgdm, lambda s: s._replace(momentum={**s.momentum, "w": torch.zeros(2)})),
        "sgd-momentum-f64": (sgdm, lambda s: s._replace(momentum={**s.momentum, "b": torch.zeros(1, dtype=torch.float64)})),
        "sgd-momentum-missing": (sgdm, lambda s: s._replace(momentum={"w": s.momentum["w"]})),
        "sgd-count-float": (sgdm, lambda s: s._replace(count=torch.tensor(0.0))),
        "sgd-count-python": (sgdm, lambda s: s._replace(count=0)),
        "adam-exp_avg-(1,)": (adam, lambda s: s._replace(exp_avg={**s.exp_avg, "w": torch.zeros(1)})),
        "adam-exp_avg-(2,)": (adam, lambda s: s._replace(exp_avg={**s.exp_avg, "w": torch.zeros(2)})),
        "adam-exp_avg_sq-(1,1)": (adam, lambda s: s._replace(exp_avg_sq={**s.exp_avg_sq, "b": torch.zeros(1, 1)})),
        "adam-exp_avg-f16": (adam, lambda s: s._replace(exp_avg={**s.exp_avg, "b": torch.zeros(1, dtype=torch.float16)})),
        "adam-exp_avg-extra-key": (adam, lambda s: s._replace(exp_avg={**s.exp_avg, "c": torch.zeros(1)})),
        "adam-count-(1,)": (adam, lambda s: s._replace(count=torch.zeros(1, dtype=torch.int32))),
        "adam-count-int64": (adam, lambda s: s._replace(count=torch.zeros((), dtype=torch.int64))),
        "adam-state-is-sgd": (adam, lambda s: funcamp.sgd(0.1).init(_params())),
        "adam-state-tuple": (adam, lambda s: tuple(s)),
        "accumulate-grad_sum-(1,)": (acc, lambda s: s._replace(grad_sum={**s.grad_sum, "w": torch.zeros(1)})),
        "accumulate-applies-int": (acc, lambda s: s._replace(applies=torch.tensor(1))),
        "accumulate-inner-exp_avg": (acc, lambda s: s._replace(inner=s.inner._replace(exp_avg={**s.inner.exp_avg, "w": torch.zeros(2)}))),
        "chain-state-short": (chained, lambda s: s[:1]),
        "chain-inner-momentum": (chained, lambda s: (s[0], s[1]._replace(momentum={**s[1].momentum, "w": torch.zeros(3)}))),
    }  # fmt: skip
    for name, (opt, corrupt) in corruptions.items():
        add_lazy(f"update-{name}", state_case(opt, corrupt, None))
        add_lazy(f"unscale_and_step-{name}", state_case(opt, corrupt, False))
        add_lazy(f"unscale_and_step-donated-{name}", state_case(opt, corrupt, True))

    # low-precision modes: their state must match the half params
    def lowp_case(opt: funcamp.Optimizer, corrupt: Callable[[Any], Any]):
        def thunk():
            params = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2)}
            grads = {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2)}
            return opt.update, (grads, corrupt(opt.init(params)), params), {}

        return thunk

    mw = funcamp.adam(0.1, master_weights=True)
    kh = funcamp.sgd(0.1, kahan=True)
    sr = funcamp.adamw(0.1, stochastic_rounding=True)
    lowp = {
        "master-bf16": (mw, lambda s: s._replace(low=type(s.low)({**s.low.master, "w": s.low.master["w"].bfloat16()}))),
        "master-shape": (mw, lambda s: s._replace(low=type(s.low)({**s.low.master, "w": torch.zeros(2)}))),
        "master-nonempty-f32": (mw, lambda s: s._replace(low=type(s.low)({**s.low.master, "b": torch.zeros(2)}))),
        "master-missing": (mw, lambda s: s._replace(low=())),
        "kahan-f32": (kh, lambda s: s._replace(low=type(s.low)({**s.low.compensation, "w": torch.zeros(3)}))),
        "kahan-shape": (kh, lambda s: s._replace(low=type(s.low)({**s.low.compensation, "w": torch.zeros(4, dtype=torch.bfloat16)}))),
        "sr-seed-int32": (sr, lambda s: s._replace(low=type(s.low)(torch.tensor(0, dtype=torch.int32)))),
        "sr-seed-python": (sr, lambda s: s._replace(low=type(s.low)(0))),
    }  # fmt: skip
    for name, (opt, corrupt) in lowp.items():
        add_lazy(f"update-{name}", lowp_case(opt, corrupt))

    # grads that do not match the params
    def grads_case(grads: Any, via_step: bool):
        def thunk():
            params = _params()
            state = adam.init(params)
            if via_step:
                scaler = funcamp.ScalerState.noop()
                return funcamp.unscale_and_step, (scaler, adam, grads, state, params), {}
            return adam.update, (grads, state, params), {}

        return thunk

    for name, grads in {
        "missing-key": {"w": torch.ones(2, 1)},
        "extra-key": {**_grads(), "c": torch.ones(1)},
        "shape": {"w": torch.ones(2), "b": torch.ones(1)},
        "int": {"w": torch.ones(2, 1, dtype=torch.int64), "b": torch.ones(1)},
        "python": {"w": 1.0, "b": torch.ones(1)},
        "list": [torch.ones(2, 1), torch.ones(1)],
    }.items():
        add_lazy(f"adam.update-grads-{name}", grads_case(grads, False))
        add_lazy(f"unscale_and_step-grads-{name}", grads_case(grads, True))

    # apply_updates
    for name, (params, updates) in {
        "int-param": ({"w": torch.tensor([1, 2])}, {"w": torch.tensor([0.7, 0.7])}),
        "bool-update": ({"w": torch.ones(2)}, {"w": torch.tensor([True, False])}),
        "complex-update": ({"w": torch.ones(2)}, {"w": torch.ones(2, dtype=torch.complex64)}),
        "shape": ({"w": torch.ones(2)}, {"w": torch.ones(3)}),
        "structure": ({"w": torch.ones(2)}, {"v": torch.ones(2)}),
        "python-update": ({"w": torch.ones(2)}, {"w": 0.5}),
    }.items():
        add(f"apply_updates-{name}", funcamp.apply_updates, params, updates)

    # scaler: values coming in from a GradScaler
    for name, changes in {
        "scale-neg": {"scale": -5.0},
        "scale-neg4": {"scale": -4.0},
        "scale-nan": {"scale": NAN},
        "scale-zero": {"scale": 0.0},
        "scale-inf": {"scale": INF},
        "scale-huge": {"scale": 1e39},
        "scale-str": {"scale": "1024"},
        "scale-tensor-2": {"scale": torch.tensor([1.0, 2.0])},
        "tracker-neg": {"_growth_tracker": -1},
        "tracker-float": {"_growth_tracker": 1.5},
        "tracker-float-tensor": {"_growth_tracker": torch.tensor(1.0)},
        "tracker-at-interval": {"_growth_tracker": 10},
        "growth-factor-0.5": {"growth_factor": 0.5},
        "backoff-2": {"backoff_factor": 2.0},
        "interval-0": {"growth_interval": 0},
    }.items():
        add(f"from_grad_scaler-{name}", funcamp.ScalerState.from_grad_scaler, _gs(**changes))
    add("from_grad_scaler-missing-key", funcamp.ScalerState.from_grad_scaler, {"scale": 1.0})
    add("from_grad_scaler-not-a-dict", funcamp.ScalerState.from_grad_scaler, [("scale", 1.0)])

    # scaler: values coming in from a checkpoint
    template = funcamp.ScalerState.dynamic()
    i32 = torch.int32
    for name, changes in {
        "scale-zero": {"scale": torch.tensor(0.0)},
        "scale-neg": {"scale": torch.tensor(-4.0)},
        "scale-nan": {"scale": torch.tensor(NAN)},
        "scale-inf": {"scale": torch.tensor(INF)},
        "scale-int64": {"scale": torch.tensor(4)},
        "scale-(1,)": {"scale": torch.tensor([4.0])},
        "tracker-neg": {"growth_tracker": torch.tensor(-1, dtype=i32)},
        "tracker-too-big": {"growth_tracker": torch.tensor(10, dtype=i32)},
        "hysteresis-neg": {"hysteresis_tracker": torch.tensor(-1, dtype=i32)},
        "hysteresis-too-big": {"hysteresis_tracker": torch.tensor(2, dtype=i32)},
        "skipped-neg": {"skipped": torch.tensor(-3, dtype=i32)},
        "growth-factor-neg": {"growth_factor": -2.0},
        "kind-bogus": {"kind": "bogus"},
        "below-min": {"min_scale": 2048.0},
        "above-max": {"max_scale": 16.0},
    }.items():
        add(
            f"load_state_dict-scaler-{name}",
            funcamp.load_state_dict,
            template,
            _scaler_sd(**changes),
        )
    noop_sd = funcamp.state_dict(funcamp.ScalerState.noop())
    noop_sd["scale"] = torch.tensor(2.0)
    add(
        "load_state_dict-noop-scale-2", funcamp.load_state_dict, funcamp.ScalerState.noop(), noop_sd
    )
    add("load_state_dict-not-dict", funcamp.load_state_dict, template, [1, 2])

    # scaler states built positionally with wrong leaves, at every door that takes one
    bad_scalers = {
        "float-scale": {"scale": 2.0},
        "int64-scale": {"scale": torch.tensor(4)},
        "f64-scale": {"scale": torch.tensor(4.0, dtype=torch.float64)},
        "(1,)-scale": {"scale": torch.tensor([4.0])},
        "float-tracker": {"growth_tracker": torch.tensor(0.0)},
        "int64-skipped": {"skipped": torch.tensor(0)},
        "python-hysteresis": {"hysteresis_tracker": 1},
    }
    for name, leaves in bad_scalers.items():
        add_lazy(
            f"scale-{name}",
            lambda leaves=leaves: (funcamp.scale, (_scaler_with(**leaves), torch.tensor(1.0)), {}),
        )
        add_lazy(
            f"unscale-{name}",
            lambda leaves=leaves: (funcamp.unscale, (_scaler_with(**leaves), _grads()), {}),
        )
        add_lazy(
            f"update-{name}",
            lambda leaves=leaves: (
                funcamp.update,
                (_scaler_with(**leaves), torch.tensor(False)),
                {},
            ),
        )
        add_lazy(
            f"unscale_and_step-{name}",
            lambda leaves=leaves: (
                funcamp.unscale_and_step,
                (_scaler_with(**leaves), funcamp.sgd(0.1), _grads(), funcamp.sgd(0.1).init(_params()), _params()),
                {"donate_grads": True, "donate_state": True},
            ),
        )  # fmt: skip
    for name, flag in {
        "float": torch.tensor(0.0),
        "python": False,
        "(1,)": torch.tensor([False]),
    }.items():
        add(f"update-found_inf-{name}", funcamp.update, funcamp.ScalerState.dynamic(), flag)
    for name, kwargs in {
        "init-neg": {"init_scale": -1.0},
        "init-nan": {"init_scale": NAN},
        "init-zero": {"init_scale": 0.0},
        "hysteresis-0": {"hysteresis": 0},
        "min>max": {"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0},
    }.items():
        add(f"ScalerState.dynamic-{name}", funcamp.ScalerState.dynamic, **kwargs)
    add("ScalerState.static-neg", funcamp.ScalerState.static, -2.0)

    # trees, rules and policies
    add("tree_select-pred-float", funcamp.tree_select, torch.tensor(1.0), _params(), _params())
    add(
        "tree_select-structure",
        funcamp.tree_select,
        torch.tensor(True),
        _params(),
        {"w": torch.ones(2, 1)},
    )
    add(
        "tree_select-shape",
        funcamp.tree_select,
        torch.tensor(True),
        {"w": torch.ones(2)},
        {"w": torch.ones(3)},
    )
    add("OpRule-bogus", funcamp.OpRule, "bogus")
    add("OpRule-int", funcamp.OpRule, 3)
    for spec in ("params=float8", "compute=bogus", "x=float32", "", 3):
        add(f"get_policy-{spec!r}", funcamp.get_policy, spec)
    policy = funcamp.get_policy("mixed_bfloat16")
    one = {"w": torch.ones(1)}
    add("amp-bad-policy", funcamp.amp, lambda x: x, "bogus")
    add("amp-policy-int", funcamp.amp, lambda x: x, 3)
    add("amp-not-callable", funcamp.amp, 3, policy)
    add("full_precision-not-callable", funcamp.full_precision, 3)
    add("trace-policy-int", funcamp.trace, lambda x: x, 3)
    add("tree_cast-dtype-str", funcamp.tree_cast, one, "float16")
    add("params_and_buffers-dict", funcamp.params_and_buffers, {"w": torch.ones(1)})
    add("with_op_rules-bogus", policy.with_op_rules, {"linear": "bogus"})
    add("with_op_rules-int-rule", policy.with_op_rules, {"linear": 3})
    add("with_op_rules-int-key", policy.with_op_rules, {3: funcamp.OpRule.COMPUTE})
    add("with_module_policies-int-key", policy.with_module_policies, {3: "float32"})
    add("with_module_policies-bad-spec", policy.with_module_policies, {torch.nn.Linear: "x"})
    add("OpPolicy.autocast-tpu", funcamp.OpPolicy.autocast, "tpu")
    sgd = funcamp.sgd(0.1)
    add(
        "make_train_step-has_aux-str",
        funcamp.make_train_step,
        lambda *a: 0,
        sgd,
        "float32",
        has_aux="yes",
    )
    add("make_train_step-loss-int", funcamp.make_train_step, 3, sgd, "float32")
    add("make_train_step-opt-str", funcamp.make_train_step, lambda *a: 0, "sgd", "float32")
    add(
        "make_train_step-compile-str",
        funcamp.make_train_step,
        lambda *a: 0,
        sgd,
        "float32",
        compile="eager",
    )
    add(
        "make_train_step-donate-str",
        funcamp.make_train_step,
        lambda *a: 0,
        sgd,
        "float32",
        donate_state="yes",
    )
    add("TrainState.create-opt-str", funcamp.TrainState.create, one, "sgd", "float32")
    add(
        "TrainState.create-int-param",
        funcamp.TrainState.create,
        {"w": torch.ones(1, dtype=torch.int64)},
        sgd,
        "float32",
    )
    add(
        "TrainState.create-scaler-float", funcamp.TrainState.create, one, sgd, "float32", scaler=2.0
    )
    add("TrainState.create-policy-bogus", funcamp.TrainState.create, one, sgd, "bogus")
    add("state_dict-object-leaf", funcamp.state_dict, {"w": object()})
    add(
        "load_state_dict-shape", funcamp.load_state_dict, {"w": torch.ones(2)}, {"w": torch.ones(3)}
    )
    add(
        "load_state_dict-dtype",
        funcamp.load_state_dict,
        {"w": torch.ones(2)},
        {"w": torch.ones(2, dtype=torch.float64)},
    )
    add("load_state_dict-key", funcamp.load_state_dict, {"w": torch.ones(2)}, {"v": torch.ones(2)})
    add("unscale-donate-int", funcamp.unscale, funcamp.ScalerState.noop(), one, donate_grads=1)
    add(
        "unscale_and_step-opt-str",
        funcamp.unscale_and_step,
        funcamp.ScalerState.noop(),
        "sgd",
        {},
        (),
        {},
    )
    add(
        "unscale_and_step-donate-str",
        funcamp.unscale_and_step,
        funcamp.ScalerState.noop(),
        sgd,
        one,
        sgd.init(one),
        one,
        donate_state="yes",
    )
    add("ScalerState.for_policy-int", funcamp.ScalerState.for_policy, 3)
    add("ScalerState.static-str", funcamp.ScalerState.static, "8")
    add("ScalerState.dynamic-growth-1", funcamp.ScalerState.dynamic, growth_factor=1.0)
    add(
        "to_grad_scaler_state_dict-static",
        funcamp.ScalerState.static(8.0).to_grad_scaler_state_dict,
    )
    add("scale-state-int", funcamp.scale, 3, torch.ones(1))
    add("sgd.update-state-none", sgd.update, one, None, one)
    add("sgd.init-int-param", sgd.init, {"w": torch.ones(1, dtype=torch.int32)})
    add("adam.init-python-param", funcamp.adam(0.1).init, {"w": 1.0})
    add("chain.update-state-list", funcamp.chain(sgd).update, one, [()], None)
    add(
        "clip.update-int-grad",
        funcamp.clip_by_global_norm(1.0).update,
        {"w": torch.ones(1, dtype=torch.int32)},
        (),
        None,
    )
    adamw = funcamp.adamw(0.1)
    add("adamw.update-no-params", adamw.update, one, adamw.init(one), None)
    for name, sched in {
        "constant": funcamp.constant_schedule(0.1),
        "linear": funcamp.linear_schedule(0.1, 0.0, 10),
        "cosine": funcamp.cosine_decay_schedule(0.1, 10),
        "warmup": funcamp.linear_warmup_cosine_decay(0.1, 2, 10),
    }.items():
        add(f"{name}_schedule-count-str", sched, "3")
        add(f"{name}_schedule-count-bool", sched, torch.tensor(True))
    add("assert_trees_equal-structure", assert_trees_equal, {"w": torch.ones(1)}, [torch.ones(1)])
    return cases


CASES = _cases()


def test_enough_cases():
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize("thunk", CASES)
def test_bad_input_is_refused_and_inputs_unchanged(thunk):
    fn, args, kwargs = thunk()
    expect_error(fn, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# train step and TrainState


def _linear_loss(params, buffers, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(x @ params["w"] + params["b"], y)


BATCH = (torch.ones(4, 2), torch.ones(4, 1))


def _train_state(opt: funcamp.Optimizer | None = None, buffers: Any = None) -> funcamp.TrainState:
    opt = opt or funcamp.adam(0.1)
    scaler = funcamp.ScalerState.dynamic(2.0**10)
    return funcamp.TrainState.create(
        _params(), opt, "mixed_bfloat16", buffers=buffers, scaler=scaler
    )


@pytest.mark.parametrize("policy", ["mixed_float16", "bf16-mixed", "float32", "bf16-true"])
def test_float64_params_refused_at_create(policy):
    params = {"w": torch.ones(2, 1, dtype=torch.float64), "b": torch.ones(1)}
    err = expect_error(funcamp.TrainState.create, params, funcamp.sgd(0.1), policy)
    assert "['w']" in str(err) and "float64" in str(err) and "tree_cast" in str(err)


def test_float64_params_accepted_under_a_float64_policy():
    params = {"w": torch.ones(2, 1, dtype=torch.float64)}
    state = funcamp.TrainState.create(params, funcamp.sgd(0.1), "float64")
    assert state.params["w"].dtype == torch.float64


@pytest.mark.parametrize("donate", [False, True])
def test_tuple_loss_without_has_aux_names_has_aux(donate):
    def loss_fn(params, buffers, batch):
        return _linear_loss(params, buffers, batch), {"extra": torch.ones(1)}

    step = funcamp.make_train_step(
        loss_fn, funcamp.adam(0.1), "float32", compile=False, donate_state=donate
    )
    err = expect_error(step, _train_state(), BATCH)
    assert "has_aux=True" in str(err) and "GradTracking" not in str(err)


def _buffer_loss(change: str) -> Callable[..., Any]:
    def loss_fn(params, buffers, batch):
        if change == "add-key":
            buffers["new"] = torch.zeros(1)
        elif change == "rebind-shape":
            buffers["count"] = torch.zeros(3)
        elif change == "delete-key":
            del buffers["count"]
        elif change == "rebind-list":
            buffers["count"] = [buffers["count"]]
        return _linear_loss(params, buffers, batch)

    return loss_fn


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("change", ["add-key", "rebind-shape", "delete-key", "rebind-list"])
def test_buffer_structure_changes_are_refused(change, donate):
    step = funcamp.make_train_step(
        _buffer_loss(change), funcamp.adam(0.1), "float32", compile=False, donate_state=donate
    )
    state = _train_state(buffers={"count": torch.zeros(2)})
    err = expect_error(step, state, BATCH)
    assert "in place only" in str(err)


def test_buffer_in_place_updates_still_work():
    def loss_fn(params, buffers, batch):
        buffers["count"].add_(1.0)
        buffers["count"] = buffers["count"]  # rebinding to the same tensor is fine
        return _linear_loss(params, buffers, batch)

    step = funcamp.make_train_step(
        loss_fn, funcamp.adam(0.1), "float32", compile=False, donate_state=False
    )
    state = _train_state(buffers={"count": torch.zeros(2)})
    new, _ = step(state, BATCH)
    assert torch.equal(new.buffers["count"], torch.ones(2))
    assert torch.equal(state.buffers["count"], torch.zeros(2))


@pytest.mark.parametrize("donate", [False, True])
def test_step_with_mismatched_opt_state_is_refused(donate):
    state = _train_state()
    state = state._replace(
        opt_state=state.opt_state._replace(exp_avg={**state.opt_state.exp_avg, "w": torch.zeros(2)})
    )
    step = funcamp.make_train_step(
        _linear_loss, funcamp.adam(0.1), "float32", compile=False, donate_state=donate
    )
    err = expect_error(step, state, BATCH)
    assert "['w']" in str(err)


@pytest.mark.parametrize("donate", [False, True])
def test_step_with_positional_float_scaler_is_refused(donate):
    state = _train_state()
    s = state.scaler
    bad = funcamp.ScalerState(2.0, s.growth_tracker, s.hysteresis_tracker, s.skipped)
    step = funcamp.make_train_step(
        _linear_loss, funcamp.adam(0.1), "float32", compile=False, donate_state=donate
    )
    expect_error(step, state._replace(scaler=bad), BATCH)


# --------------------------------------------------------------------------------------------
# a learning rate that goes bad at run time: the step is skipped (documented behaviour)


@pytest.mark.parametrize("value", [NAN, INF, -0.5])
@pytest.mark.parametrize("kind", ["sgd", "sgd-momentum", "adam", "adamw", "accumulate"])
def test_runtime_bad_tensor_lr_skips_the_step(kind, value):
    lr = torch.tensor(0.1)
    opt = {
        "sgd": lambda: funcamp.sgd(lr),
        "sgd-momentum": lambda: funcamp.sgd(lr, momentum=0.9),
        "adam": lambda: funcamp.adam(lr),
        "adamw": lambda: funcamp.adamw(lr),
        "accumulate": lambda: funcamp.accumulate(funcamp.adam(lr), 1),
    }[kind]()
    params, grads = _params(), _grads()
    state = opt.init(params)
    lr.fill_(value)  # changed after the optimizer was built, as a tensor lr may be
    scaler = funcamp.ScalerState.dynamic(4.0)
    snap = Snapshot(params, state)
    new_params, new_state, info = funcamp.unscale_and_step(scaler, opt, grads, state, params)
    assert bool(info.found_inf)
    assert_trees_equal(new_params, params)
    assert_trees_equal(new_state, state)
    snap.assert_unchanged()
    # a direct update call does not move the params with such a rate
    updates, _ = opt.update(grads, state, params)
    moved = funcamp.apply_updates(params, updates)
    if kind in ("sgd", "sgd-momentum", "adamw"):
        assert_trees_equal(moved, params)


def test_runtime_bad_schedule_value_skips_in_the_train_step():
    # finite and >= 0 at count 0 (the build-time probe), negative from count 2 on
    schedule = funcamp.linear_schedule(0.1, -0.1, transition_steps=2)
    opt = funcamp.sgd(schedule)
    step = funcamp.make_train_step(_linear_loss, opt, "float32", compile=False, donate_state=False)
    state = funcamp.TrainState.create(_params(), opt, "float32")
    state, m0 = step(state, BATCH)  # lr 0.1
    state, m1 = step(state, BATCH)  # lr 0.0
    before = state
    state, m2 = step(state, BATCH)  # lr -0.1: skipped
    assert not bool(m0["found_inf"]) and not bool(m1["found_inf"]) and bool(m2["found_inf"])
    assert int(m2["skipped"]) == 1
    assert_trees_equal(state.params, before.params)
    assert_trees_equal(state.opt_state, before.opt_state)


def test_schedule_returning_a_different_type_later_is_refused_on_the_step():
    def schedule(count):
        return torch.tensor(0.1) if count.item() == 0 else 0.1

    opt = funcamp.sgd(schedule)
    params = _params()
    state = opt.init(params)._replace(count=torch.tensor(3, dtype=torch.int32))
    err = expect_error(opt.update, _grads(), state, params)
    assert "at run time" in str(err)


def test_schedule_float64_output_is_accepted():
    opt = funcamp.sgd(lambda c: torch.tensor(0.5, dtype=torch.float64))
    params = {"w": torch.ones(2)}
    updates, _ = opt.update({"w": torch.ones(2)}, opt.init(params), params)
    assert torch.equal(funcamp.apply_updates(params, updates)["w"], torch.full((2,), 0.5))


# --------------------------------------------------------------------------------------------
# donation: all or nothing (fault injection)


class Boom(Exception):
    pass


def _bn_state(opt: funcamp.Optimizer) -> funcamp.TrainState:
    return funcamp.TrainState.create(
        _params(),
        opt,
        "float32",
        buffers={"count": torch.zeros(2)},
        scaler=funcamp.ScalerState.dynamic(2.0**10),
    )


def _counting_loss(params, buffers, batch):
    buffers["count"].add_(1.0)
    return _linear_loss(params, buffers, batch)


def _assert_step_fault_leaves_state(step, state, monkeypatch=None):
    snap = Snapshot(state)
    with pytest.raises(Boom):
        step(state, BATCH)
    snap.assert_unchanged()


@pytest.mark.parametrize("opt_name", ["sgd", "sgd-momentum", "adam"])
def test_fault_in_loss_fn_leaves_donated_state(opt_name):
    opt = {
        "sgd": funcamp.sgd(0.1),
        "sgd-momentum": funcamp.sgd(0.1, 0.9),
        "adam": funcamp.adam(0.1),
    }[opt_name]
    calls = []

    def loss_fn(params, buffers, batch):
        buffers["count"].add_(1.0)  # an in-place write to the (copied) buffers first
        calls.append(1)
        raise Boom

    step = funcamp.make_train_step(loss_fn, opt, "float32", compile=False, donate_state=True)
    _assert_step_fault_leaves_state(step, _bn_state(opt))
    assert calls


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_fault_in_optimizer_leaves_donated_state(opt_name):
    inner = funcamp.sgd(0.1) if opt_name == "sgd" else funcamp.adam(0.1)

    def update(grads, state, params=None):
        inner.update(grads, state, params)  # the real work, then a failure
        raise Boom

    opt = funcamp.Optimizer(inner.init, update)
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    _assert_step_fault_leaves_state(step, _bn_state(opt))


def test_fault_in_schedule_at_run_time_leaves_donated_state_and_grads():
    def schedule(count):
        if int(count) >= 1:
            raise Boom
        return torch.tensor(0.1)

    opt = funcamp.sgd(schedule)  # torch's fused in-place SGD path when donated
    params, grads = _params(), _grads()
    state = opt.init(params)._replace(count=torch.tensor(1, dtype=torch.int32))
    scaler = funcamp.ScalerState.dynamic(4.0)
    snap = Snapshot(params, state, grads)
    with pytest.raises(Boom):
        funcamp.unscale_and_step(
            scaler, opt, grads, state, params, donate_grads=True, donate_state=True
        )
    snap.assert_unchanged()  # grads too: the schedule ran before they were unscaled in place


def test_fault_in_buffer_write_back_leaves_donated_state(monkeypatch):
    import funcamp.train.step as train_mod

    real = train_mod.plan_write

    def plan(new, old):
        if isinstance(old, dict) and "count" in old:
            raise Boom
        return real(new, old)

    monkeypatch.setattr(train_mod, "plan_write", plan)
    opt = funcamp.adam(0.1)
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    _assert_step_fault_leaves_state(step, _bn_state(opt))


def test_fault_in_buffer_check_leaves_donated_state(monkeypatch):
    import funcamp.train.step as train_mod

    def restore(api, new, old, returned=True):
        raise Boom

    monkeypatch.setattr(train_mod, "restore_buffers", restore)
    opt = funcamp.sgd(0.1)
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    _assert_step_fault_leaves_state(step, _bn_state(opt))


def test_fault_in_params_write_plan_leaves_donated_state(monkeypatch):
    import funcamp.scaling.step as scaler_mod

    real = scaler_mod.plan_write
    seen = []

    def plan(new, old):
        seen.append(old)
        if len(seen) == 2:  # the optimizer state's plan, after the params' one
            raise Boom
        return real(new, old)

    monkeypatch.setattr(scaler_mod, "plan_write", plan)
    # An optimizer that does not write its own donated state: these plans come before every
    # write. (funcamp.adam writes its buffers through `Writes.skip` during the update, when only
    # arithmetic on checked tensors is left, and its state's structure is its own: see
    # test_fault_before_the_first_in_place_write_leaves_donated_state.)
    inner = funcamp.adam(0.1)

    def prepare(grads, state, params=None):
        prepared = inner.prepare(grads, state, params)
        return prepared._replace(run=lambda g, w: prepared.run(g, w._replace(skip=None)))

    opt = funcamp.Optimizer(inner.init, inner.update, prepare)
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    _assert_step_fault_leaves_state(step, _bn_state(opt))


_DONATING = {
    "adam": lambda: funcamp.adam(0.1),
    "adamw-mask": lambda: funcamp.adamw(0.1, mask={"w": True, "b": False}),
    "sgd-momentum": lambda: funcamp.sgd(0.1, 0.9),
    "lion": lambda: funcamp.lion(0.1),
    "chain": lambda: funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.adamw(0.1)),
}


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("opt_name", sorted(_DONATING))
def test_fault_before_the_first_in_place_write_leaves_donated_state(monkeypatch, opt_name, path):
    """A built-in optimizer given a donated state writes each new buffer into the old one as the
    algorithm keeps it: everything before that first write -- the step, the unscale, the update
    up to it -- leaves the donated state as it was when the first write fails.

    The CPU's eager step knows whether it applies (it reads its skip flag, as GradScaler does)
    and then writes in place directly (``writing()`` marks the first write); the device path
    (as on CUDA) selects each write on the flag (``where_into``)."""
    import funcamp.optim._paths as paths_mod
    import funcamp.scaling.skip as skip_mod

    opt = _DONATING[opt_name]()
    calls = []

    def boom(*args):
        calls.append(1)
        raise Boom

    if path == "device":
        monkeypatch.setattr(skip_mod, "where_into", boom)
    else:
        monkeypatch.setattr(paths_mod, "writing", boom)
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    with device_path() if path == "device" else contextlib.nullcontext():
        _assert_step_fault_leaves_state(step, _bn_state(opt))
    assert calls  # the in-place write was reached


def test_fault_in_weight_decay_mask_leaves_donated_state():
    """A callable mask runs inside the update, before its first in-place write."""

    def mask(params):
        raise Boom

    opt = funcamp.adamw(0.1, mask=lambda p: {k: True for k in p})
    state = _bn_state(opt)
    opt = funcamp.adamw(0.1, mask=mask)  # the same state; this one's mask fails at run time
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    snap = Snapshot(state)
    with pytest.raises(TypeError, match=r"funcamp.adamw: `mask` .* raised Boom") as caught:
        step(state, BATCH)  # neither a path nor a params callable: a funcamp error, from Boom
    assert isinstance(caught.value.__cause__, Boom)
    snap.assert_unchanged()


def test_optimizer_changing_its_state_structure_leaves_donated_state():
    inner = funcamp.adam(0.1)

    def update(grads, state, params=None):
        updates, new = inner.update(grads, state, params)
        return updates, new._replace(exp_avg={**new.exp_avg, "extra": torch.zeros(1)})

    opt = funcamp.Optimizer(inner.init, update)
    params, grads = _params(), _grads()
    state = opt.init(params)
    snap = Snapshot(params, state)
    with pytest.raises(ValueError, match="funcamp"):
        funcamp.unscale_and_step(
            funcamp.ScalerState.noop(), opt, grads, state, params, donate_state=True
        )
    snap.assert_unchanged()


@pytest.mark.parametrize("change", ["add-key", "rebind-shape"])
def test_donated_compiled_step_with_bad_buffers_leaves_state(change):
    # Compiled (eager backend: tracing only): the error comes from the trace or from the eager
    # re-run that reports it, and neither writes into the donated state.
    step = funcamp.make_train_step(
        _buffer_loss(change),
        funcamp.adam(0.1),
        "float32",
        donate_state=True,
        compile=funcamp.Compile(backend="eager"),
    )
    state = _train_state(buffers={"count": torch.zeros(2)})
    snap = Snapshot(state)
    with pytest.raises(Exception, match="in place only"):
        step(state, BATCH)
    snap.assert_unchanged()


def test_donated_step_still_writes_on_success():
    opt = funcamp.adam(0.1)
    state = _bn_state(opt)
    step = funcamp.make_train_step(_counting_loss, opt, "float32", compile=False, donate_state=True)
    ref_step = funcamp.make_train_step(
        _counting_loss, opt, "float32", compile=False, donate_state=False
    )
    expected, _ = ref_step(state, BATCH)
    w = state.params["w"]
    new, _ = step(state, BATCH)
    assert new.params["w"] is w  # written in place
    assert_trees_equal(new, expected)


# --------------------------------------------------------------------------------------------
# Hypothesis: random wrong leaves, shapes, dtypes and values for every state type


def _opt_zoo() -> dict[str, tuple[funcamp.Optimizer, Callable[[], Any]]]:
    def f32():
        return _params()

    def mixed():
        return {"w": torch.ones(3, dtype=torch.bfloat16), "b": torch.ones(2)}

    return {
        "sgd-momentum": (funcamp.sgd(0.1, momentum=0.9), f32),
        "adam": (funcamp.adam(0.1), f32),
        "adamw-master": (funcamp.adamw(0.1, master_weights=True), mixed),
        "sgd-kahan": (funcamp.sgd(0.1, kahan=True), mixed),
        "adam-sr": (funcamp.adam(0.1, stochastic_rounding=True), mixed),
        "accumulate": (funcamp.accumulate(funcamp.sgd(0.1, momentum=0.5), 2), f32),
        "chain": (funcamp.chain(funcamp.clip_by_global_norm(1.0), funcamp.adam(0.1)), f32),
    }


OPT_ZOO = _opt_zoo()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]


def _corrupt_leaf(data: st.DataObject, x: torch.Tensor) -> Any:
    how = data.draw(st.sampled_from(["shape", "dtype", "python", "none"]))
    if how == "python":
        return 0.5
    if how == "none":
        return None
    if how == "dtype":
        dtype = data.draw(st.sampled_from([d for d in DTYPES if d != x.dtype]))
        return torch.zeros(x.shape, dtype=dtype)
    shape = data.draw(
        st.lists(st.integers(0, 3), max_size=3).map(tuple).filter(lambda s: s != tuple(x.shape))
    )
    return torch.zeros(shape, dtype=x.dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    name=st.sampled_from(sorted(OPT_ZOO)),
    via=st.sampled_from(["update", "step", "donated"]),
)
def test_random_corrupted_optimizer_state_is_refused(data, name, via):
    opt, make_params = OPT_ZOO[name]
    params = make_params()
    grads = {k: torch.full_like(v, 0.5) for k, v in params.items()}
    state = opt.init(params)
    _, leaves, spec = optree.tree_flatten_with_path(state, namespace=NAMESPACE)
    i = data.draw(st.integers(0, len(leaves) - 1))
    leaves = list(leaves)
    leaves[i] = _corrupt_leaf(data, leaves[i])
    bad = optree.tree_unflatten(spec, leaves)
    if via == "update":
        expect_error(opt.update, grads, bad, params)
    else:
        donate = via == "donated"
        expect_error(
            funcamp.unscale_and_step,
            funcamp.ScalerState.dynamic(8.0),
            opt,
            grads,
            bad,
            params,
            donate_grads=donate,
            donate_state=donate,
        )


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), door=st.sampled_from(["scale", "unscale", "update", "step"]))
def test_random_corrupted_scaler_leaf_is_refused(data, door):
    s = funcamp.ScalerState.dynamic(64.0)
    name = data.draw(st.sampled_from(["scale", "growth_tracker", "hysteresis_tracker", "skipped"]))
    bad = _scaler_with(**{name: _corrupt_leaf(data, getattr(s, name))})
    grads, params = _grads(), _params()
    opt = funcamp.sgd(0.1)
    call = {
        "scale": lambda: (funcamp.scale, (bad, torch.tensor(1.0))),
        "unscale": lambda: (funcamp.unscale, (bad, grads)),
        "update": lambda: (funcamp.update, (bad, torch.tensor(False))),
        "step": lambda: (funcamp.unscale_and_step, (bad, opt, grads, opt.init(params), params)),
    }[door]
    fn, args = call()
    expect_error(fn, *args)


finite_or_not = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, -1.0, NAN, INF, -INF]),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    scale=finite_or_not,
    tracker=st.integers(-3, 12),
    hysteresis=st.integers(-2, 3),
    skipped=st.integers(-2, 2),
)
def test_random_checkpoint_scaler_values(scale, tracker, hysteresis, skipped):
    template = funcamp.ScalerState.dynamic(1.0, growth_interval=10, hysteresis=2)
    sd = funcamp.state_dict(template)
    sd.update(
        scale=torch.tensor(scale, dtype=torch.float32),
        growth_tracker=torch.tensor(tracker, dtype=torch.int32),
        hysteresis_tracker=torch.tensor(hysteresis, dtype=torch.int32),
        skipped=torch.tensor(skipped, dtype=torch.int32),
    )
    f32 = float(torch.tensor(scale, dtype=torch.float32))
    valid = (
        math.isfinite(f32)
        and f32 > 0
        and 0 <= tracker < 10
        and 0 <= hysteresis <= 2
        and skipped >= 0
    )
    if valid:
        out = funcamp.load_state_dict(template, sd)
        assert float(out.scale) == f32 and int(out.growth_tracker) == tracker
        assert int(out.hysteresis_tracker) == hysteresis and int(out.skipped) == skipped
    else:
        expect_error(funcamp.load_state_dict, template, sd)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    scale=st.one_of(finite_or_not, st.integers(-5, 5)),
    tracker=st.integers(-3, 12),
    interval=st.integers(1, 10),
)
def test_random_grad_scaler_values(scale, tracker, interval):
    sd = _gs(scale=scale, _growth_tracker=tracker, growth_interval=interval)
    valid = math.isfinite(scale) and 0 < scale <= torch.finfo(torch.float32).max
    valid = valid and 0 <= tracker < interval
    if valid:
        s = funcamp.ScalerState.from_grad_scaler(sd)
        assert float(s.scale) == float(torch.tensor(float(scale)))
        assert int(s.growth_tracker) == tracker
    else:
        expect_error(funcamp.ScalerState.from_grad_scaler, sd)


tree_keys = st.sampled_from(["w", "b", "c"])


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    keys=st.lists(tree_keys, unique=True, max_size=3),
    shape=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    dtype=st.sampled_from(DTYPES),
)
def test_random_grads_against_params(keys, shape, dtype):
    params = _params()
    grads = {k: torch.ones(shape, dtype=dtype) for k in keys}
    matches = sorted(keys) == sorted(params) and all(
        g.shape == params[k].shape and g.dtype.is_floating_point for k, g in grads.items()
    )
    opt = funcamp.adam(0.1)
    state = opt.init(params)
    if matches:  # a right call: checked against the optimizer's own update
        new, _, info = funcamp.unscale_and_step(
            funcamp.ScalerState.noop(), opt, grads, state, params
        )
        updates, _ = opt.update({k: v.float() for k, v in grads.items()}, state, params)
        assert_trees_equal(new, funcamp.apply_updates(params, updates))
        assert not bool(info.found_inf)
    else:
        expect_error(
            funcamp.unscale_and_step, funcamp.ScalerState.noop(), opt, grads, state, params
        )
        expect_error(opt.update, grads, state, params)


# --------------------------------------------------------------------------------------------
# odd but valid input: documented behaviour, checked results


def test_documented_pass_through_behaviours():
    tree = {"w": torch.tensor([1.5, -2.5]), "name": "fc", "n": 3}
    snap = Snapshot(tree)
    # an explicit cast to an integer dtype is what was asked for (truncation toward zero)
    assert torch.equal(
        funcamp.tree_cast(tree, torch.int32)["w"], torch.tensor([1, -2], dtype=torch.int32)
    )
    # non-tensor leaves are ignored by all_finite and passed through by the policy casts
    assert bool(funcamp.all_finite({"a": 1.0, "b": torch.ones(1)}))
    assert not bool(funcamp.all_finite({"a": 1.0, "b": torch.tensor([NAN])}))
    policy = funcamp.get_policy("mixed_bfloat16")
    assert policy.cast_to_compute(3) == 3
    assert policy.cast_to_compute(tree)["w"].dtype == torch.bfloat16
    # without an AccumulateState every update applies
    assert bool(funcamp.accumulate_applies(funcamp.sgd(0.1).init(_params())))
    snap.assert_unchanged()


def test_oprule_by_value_and_error_message():
    assert funcamp.OpRule("float32") is funcamp.OpRule.FLOAT32
    err = expect_error(funcamp.OpRule, "bogus")
    assert "['compute', 'float32', 'promote', 'none']" in str(err)


def test_new_buffers_of_another_shape_or_structure_are_named():
    """restore_buffers: a returned buffer of another shape names its path and the shape it must
    have; another structure prints both structures."""
    params = {"w": torch.ones(3)}
    buffers = {"stats": {"mean": torch.zeros(3), "count": torch.zeros((), dtype=torch.int64)}}
    opt = funcamp.sgd(0.1)
    policy = funcamp.get_policy("float32")
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)

    def step_returning(new_buffers):
        def loss_fn(p, b, batch):
            return (p["w"] * batch).sum(), new_buffers

        return funcamp.make_train_step(
            loss_fn, opt, policy, returns_buffers=True, compile=False, donate_state=False
        )

    wrong_shape = {"stats": {"mean": torch.zeros(4), "count": torch.zeros((), dtype=torch.int64)}}
    with pytest.raises(
        TypeError, match=r"buffer \['stats'\]\['mean'\] should be a tensor of shape \(3,\)"
    ):
        step_returning(wrong_shape)(state, torch.ones(3))
    with pytest.raises(TypeError, match=r"with the structure of the state's buffers PyTreeSpec"):
        step_returning({"stats": {"mean": torch.zeros(3)}})(state, torch.ones(3))
    complex_mean = {
        "stats": {
            "mean": torch.zeros(3, dtype=torch.complex64),
            "count": torch.zeros((), dtype=torch.int64),
        }
    }
    with pytest.raises(TypeError, match=r"buffer \['stats'\]\['mean'\] should be torch.float32"):
        step_returning(complex_mean)(state, torch.ones(3))
