"""Tests for funcamp.state_dict / funcamp.load_state_dict."""

from __future__ import annotations

import collections
import io
from typing import NamedTuple

import optree
import pytest
import torch

import funcamp

#: The optree namespace funcamp documents for its state types (docs/concepts.md).
NAMESPACE = "funcamp"


class Moments(NamedTuple):
    mu: dict
    nu: dict
    count: torch.Tensor


def _scaler() -> funcamp.ScalerState:
    s = funcamp.ScalerState.dynamic(
        300.0,
        growth_factor=1.25,
        backoff_factor=0.75,
        growth_interval=9,
        min_scale=0.5,
        max_scale=2.0**30,
        hysteresis=2,
    )
    for flag in (True, False, True, True, False):
        s = funcamp.update(s, torch.tensor(flag))
    return s


def _tree():
    return {
        "params": {"layer": {"w": torch.randn(3, 2), "b": torch.zeros(2, dtype=torch.bfloat16)}},
        "opt": Moments({"w": torch.ones(3, 2)}, {"w": torch.full((3, 2), 2.0)}, torch.tensor(7)),
        "scaler": _scaler(),
        "history": [torch.tensor(1.5), (torch.tensor([1, 2]), "tag")],
        "meta": {"step": 12, "lr": 0.001, "name": "run", "none": None, "flag": True},
        3: torch.tensor([0.25], dtype=torch.float64),
    }


def _zeros_like_tree(tree):
    return optree.tree_map(
        lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x,
        tree,
        namespace=NAMESPACE,
        none_is_leaf=True,
    )


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_same(a, b, path="<root>"):
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, funcamp.ScalerState):
        for f in ("scale", "growth_tracker", "hysteresis_tracker", "skipped"):
            _assert_same(getattr(a, f), getattr(b, f), f"{path}.{f}")
        for f in (
            "kind",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "min_scale",
            "max_scale",
            "hysteresis",
        ):
            assert getattr(a, f) == getattr(b, f), f"{path}.{f}"
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def _is_plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, (str, int)) and _is_plain(v) for k, v in x.items())
    return isinstance(x, (torch.Tensor, bool, int, float, str, type(None)))


def test_round_trip_through_weights_only_load():
    tree = _tree()
    sd = funcamp.state_dict(tree)
    assert _is_plain(sd)
    assert sd["scaler"]["kind"] == "dynamic" and sd["scaler"]["hysteresis"] == 2
    assert sd["history"]["1"]["1"] == "tag"
    loaded = _roundtrip(sd)
    out = funcamp.load_state_dict(_zeros_like_tree(_tree()), loaded)
    _assert_same(out, tree)


def test_scaler_config_comes_from_the_checkpoint():
    s = _scaler()
    out = funcamp.load_state_dict(funcamp.ScalerState.dynamic(), _roundtrip(funcamp.state_dict(s)))
    _assert_same(out, s)
    # and the loaded state keeps working
    _assert_same(funcamp.update(out, torch.tensor(True)), funcamp.update(s, torch.tensor(True)))


@pytest.mark.parametrize(
    "state",
    [funcamp.ScalerState.static(4.0), funcamp.ScalerState.noop()],
)
def test_static_and_noop_round_trip(state):
    out = funcamp.load_state_dict(
        funcamp.ScalerState.dynamic(), _roundtrip(funcamp.state_dict(state))
    )
    _assert_same(out, state)


def test_vmapped_stack_of_scalers_round_trips():
    members = [funcamp.ScalerState.dynamic(2.0**k, growth_interval=3) for k in (1, 2, 3)]
    stacked = optree.tree_map(lambda *xs: torch.stack(xs), *members, namespace=NAMESPACE)
    sd = funcamp.state_dict(stacked)
    out = funcamp.load_state_dict(stacked, _roundtrip(sd))
    _assert_same(out, stacked)


def test_views_are_saved_without_their_base():
    base = torch.arange(1000.0)
    sd = funcamp.state_dict({"v": base[:2]})
    assert sd["v"].untyped_storage().nbytes() == 2 * 4


def test_bare_leaf_and_containers():
    t = torch.tensor([1.0, 2.0])
    sd = funcamp.state_dict(t)
    assert list(sd) == ["value"]
    _assert_same(funcamp.load_state_dict(torch.zeros(2), _roundtrip(sd)), t)
    od = collections.OrderedDict(b=torch.ones(1), a=torch.zeros(1))
    _assert_same(funcamp.load_state_dict(od, _roundtrip(funcamp.state_dict(od))), od)
    seq = [torch.ones(1), (torch.zeros(2),)]
    _assert_same(funcamp.load_state_dict(seq, _roundtrip(funcamp.state_dict(seq))), seq)


def test_loads_onto_the_template_device():
    sd = funcamp.state_dict({"w": torch.ones(2)})
    out = funcamp.load_state_dict({"w": torch.zeros(2, device="meta")}, sd)
    assert out["w"].device.type == "meta"


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda sd: sd["params"]["layer"].pop("w"), "missing key at ['params']['layer']['w']"),
        (
            lambda sd: sd["params"].update(extra=torch.ones(1)),
            "unexpected key at ['params']['extra']",
        ),
        (
            lambda sd: sd["params"]["layer"].update(w=torch.ones(2, 3)),
            "at ['params']['layer']['w'] must be a tensor of shape (3, 2) and dtype torch.float32",
        ),
        (
            lambda sd: sd["params"]["layer"].update(b=torch.ones(2)),
            "at ['params']['layer']['b'] must be a tensor of shape (2,) and dtype torch.bfloat16",
        ),
        (lambda sd: sd["opt"].update(count=3), "at ['opt']['count'] must be a tensor"),
        (lambda sd: sd["meta"].update(step="12"), "at ['meta']['step'] must be a int"),
        (lambda sd: sd.update(history=[1, 2]), "at ['history'] must be a dict with keys"),
        (lambda sd: sd["scaler"].pop("hysteresis"), "missing key at ['scaler']['hysteresis']"),
        (
            lambda sd: sd["scaler"].update(growth_factor=0.5),
            "invalid ScalerState configuration at ['scaler']",
        ),
        (
            lambda sd: sd["scaler"].update(scale=torch.ones(2)),
            "at ['scaler']['scale'] must be a tensor of shape ()",
        ),
    ],
)
def test_load_errors_name_the_path(mutate, needle):
    sd = funcamp.state_dict(_tree())
    mutate(sd)
    with pytest.raises(ValueError) as err:
        funcamp.load_state_dict(_tree(), sd)
    msg = str(err.value)
    assert msg.startswith("funcamp.load_state_dict: ")
    assert needle in msg


def test_unsupported_leaves_and_inputs():
    with pytest.raises(TypeError, match=r"funcamp.state_dict: leaf \['f'\] must be a tensor"):
        funcamp.state_dict({"f": object()})
    with pytest.raises(TypeError, match=r"funcamp.state_dict: dict keys must be str or int"):
        funcamp.state_dict({(1, 2): torch.ones(1)})
    with pytest.raises(TypeError, match=r"funcamp.load_state_dict: `sd` must be a dict"):
        funcamp.load_state_dict({}, [1])
