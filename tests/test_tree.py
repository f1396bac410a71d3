"""tree_cast, all_finite, tree_select."""

from __future__ import annotations

from typing import Any, NamedTuple
from unittest import mock

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcamp
import funcamp._core.specs as T

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64


class Pair(NamedTuple):
    a: Any
    b: Any


def test_tree_cast() -> None:
    tree = {"w": torch.ones(2), "d": torch.ones(1, dtype=F64), "i": torch.arange(2), "s": "x"}
    out = funcamp.tree_cast(tree, BF16)
    assert out["w"].dtype == BF16 and out["d"].dtype == BF16
    assert out["i"] is tree["i"] and out["s"] == "x"
    assert funcamp.tree_cast(tree, F32)["w"] is tree["w"]  # no copy when already there
    every = funcamp.tree_cast(tree, F32, only_floating=False)
    assert every["i"].dtype == F32 and every["s"] == "x"
    with pytest.raises(TypeError, match=r"funcamp.tree_cast: `dtype` must be a torch.dtype"):
        funcamp.tree_cast(tree, "bf16")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        ({}, True),
        ([], True),
        ({"a": torch.ones(3), "b": torch.empty(0)}, True),
        ({"a": torch.ones(3), "n": torch.tensor([float("nan")])}, False),
        (Pair(torch.tensor([1.0, float("-inf")], dtype=BF16), 1), False),
        ({"i": torch.arange(3), "s": "x", "none": None}, True),
    ],
)
def test_all_finite(tree: Any, expected: bool) -> None:
    out = funcamp.all_finite(tree)
    assert out.dtype == torch.bool and out.shape == () and bool(out) is expected


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(
        st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=6
    ),
    pred=st.booleans(),
)
def test_tree_select_is_leafwise_where(values: list[float], pred: bool) -> None:
    new = {"w": torch.tensor(values), "meta": "m", "p": Pair(torch.ones(1, dtype=BF16), 3)}
    old = {"w": torch.tensor(values[::-1]), "meta": "m", "p": Pair(torch.zeros(1, dtype=BF16), 3)}
    out = funcamp.tree_select(torch.tensor(pred), new, old)
    chosen = new if pred else old
    assert optree.tree_structure(out) == optree.tree_structure(chosen)
    assert torch.equal(out["w"].view(torch.int32), chosen["w"].view(torch.int32))  # bits, nan too
    assert torch.equal(out["p"].a, chosen["p"].a) and out["p"].a.dtype == BF16
    assert out["meta"] == "m" and out["p"].b == 3
    assert bool(funcamp.all_finite(out)) is all(abs(v) < float("inf") for v in chosen["w"].tolist())


def test_tree_select_errors() -> None:
    a = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"`pred` must be a 0-d bool tensor, got bool True"):
        funcamp.tree_select(True, a, a)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"must have the same structure"):
        funcamp.tree_select(torch.tensor(True), a, {"v": torch.ones(2)})
    with pytest.raises(ValueError, match=r"leaf \['w'\] differs in shape or dtype"):
        funcamp.tree_select(torch.tensor(True), a, {"w": torch.ones(2, dtype=BF16)})
    with pytest.raises(ValueError, match=r"non-tensor leaf \['n'\] differs: 1 vs 2"):
        funcamp.tree_select(torch.tensor(True), {"n": 1}, {"n": 2})


def test_tree_select_compiled_equals_eager_and_checks_the_same() -> None:
    """Under torch.compile tree_select flattens the second tree by the first's treespec (fewer
    traced instructions); results and messages match the eager path, and eager still refuses a
    dict/OrderedDict pair that optree's flatten_up_to would take."""
    import collections

    new = {"b": torch.tensor([1.0, float("nan")]), "a": Pair(torch.ones(2, dtype=BF16), 3)}
    old = {"b": torch.tensor([2.0, 3.0]), "a": Pair(torch.zeros(2, dtype=BF16), 3)}
    select = torch.compile(funcamp.tree_select, backend="eager", fullgraph=True)
    for pred in (True, False):
        want = funcamp.tree_select(torch.tensor(pred), new, old)
        got = select(torch.tensor(pred), new, old)
        assert optree.tree_structure(got) == optree.tree_structure(want)
        for x, y in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
            assert (
                x == y
                if not isinstance(x, torch.Tensor)
                else torch.equal(
                    x.view(torch.int16 if x.dtype == BF16 else torch.int32),
                    y.view(torch.int16 if y.dtype == BF16 else torch.int32),
                )
            )
    # a mismatch under compile takes the full check (dynamo reports the same message)
    with pytest.raises(Exception, match=r"leaf \['b'\] differs in shape or dtype"):
        select(torch.tensor(True), new, {**old, "b": torch.ones(3)})
    with pytest.raises(ValueError, match=r"must have the same structure"):
        funcamp.tree_select(
            torch.tensor(True), {"w": torch.ones(2)}, collections.OrderedDict(w=torch.ones(2))
        )


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("pred", [False, True])
def test_plan_select_write_is_tree_select_written_into_the_old_tensors(
    compiled: bool, pred: bool
) -> None:
    """The traced donated step's select-and-write: the old tensors come back holding
    ``tree_select(pred, old, new)`` bit for bit (NaNs, bfloat16 and a NamedTuple node
    included), a leaf that is the same tensor in both trees is left alone, and non-tensor
    leaves pass through."""
    from funcamp._core.tree import plan_select_write

    def trees():
        old = {"b": torch.tensor([2.0, -0.0, 3.0]), "a": Pair(torch.zeros(2, dtype=BF16), 3)}
        new = {"b": torch.tensor([1.0, float("nan"), 0.0]), "a": Pair(old["a"].a, 3)}
        return old, new

    def run(pred_t, new, old):
        return plan_select_write(pred_t, new, old)()

    fn = torch.compile(run, backend="aot_eager", fullgraph=True) if compiled else run
    old, new = trees()
    want = funcamp.tree_select(torch.tensor(pred), *trees())  # pred: keep the old
    b, a = old["b"], old["a"].a
    got = fn(torch.tensor(pred), new, old)
    assert got["b"] is b and got["a"].a is a and got["a"].b == 3  # the old tensors, written
    assert torch.equal(b.view(torch.int32), want["b"].view(torch.int32))
    assert torch.equal(a.view(torch.int16), want["a"].a.view(torch.int16))


def test_plan_select_write_checks_everything_before_writing() -> None:
    """A mismatch anywhere is refused with tree_select's message when the write is planned:
    nothing is written (the donated step is all or nothing)."""
    from funcamp._core.tree import plan_select_write

    old = {"a": torch.zeros(2), "b": torch.zeros(2), "n": 1}
    for new, err, match in [
        ({"a": torch.ones(2), "b": torch.ones(3), "n": 1}, ValueError, r"\['b'\] differs in shape"),
        ({"a": torch.ones(2), "b": torch.ones(2, dtype=BF16), "n": 1}, ValueError, "or dtype"),
        ({"a": torch.ones(2), "b": 2.0, "n": 1}, TypeError, r"\['b'\] is a tensor in only one"),
        ({"a": torch.ones(2), "b": torch.ones(2), "n": 2}, ValueError, r"\['n'\] differs: 1 vs 2"),
        ({"a": torch.ones(2)}, ValueError, "must have the same structure"),
    ]:
        with pytest.raises(err, match=match):
            plan_select_write(torch.tensor(False), new, old)
        assert torch.equal(old["a"], torch.zeros(2)) and torch.equal(old["b"], torch.zeros(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pred", [False, True])
def test_select_into_an_owned_leaf_is_where_bit_for_bit(dtype: torch.dtype, pred: bool) -> None:
    """The eager step's select into a leaf it owns (bit operations on large CPU leaves, where
    torch.where with a 0-d condition runs a scalar loop) gives torch.where's bits: signed zeros,
    infinities and NaN payloads included, on both sides of the size threshold."""
    from funcamp._core.tree import _BIT_SELECT_MIN, BITS, select_into

    g = torch.Generator().manual_seed(7)
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1.0, -1.5]
    leaves = {}
    for name, n in (("small", _BIT_SELECT_MIN - 1), ("large", _BIT_SELECT_MIN + 5)):
        bits = BITS[dtype]
        info = torch.iinfo(bits)
        # random bit patterns: every class of value, NaNs with payloads and signs
        a = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64)
        b = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64)
        a, b = a.to(bits).view(dtype), b.to(bits).view(dtype)
        a[: len(specials)] = torch.tensor(specials, dtype=dtype)
        b[: len(specials)] = torch.tensor(specials[::-1], dtype=dtype)
        leaves[name] = (a, b)
    on_true = {k: a for k, (a, _) in leaves.items()}
    on_false = {k: b.clone() for k, (_, b) in leaves.items()}
    expected = {k: torch.where(torch.tensor(pred), a, b) for k, (a, b) in leaves.items()}
    owned = {id(x) for x in on_false.values()}
    out = select_into(torch.tensor(pred), on_true, on_false, lambda x: id(x) in owned)
    for k in leaves:
        assert out[k] is on_false[k]  # written in place
        assert torch.equal(out[k].view(BITS[dtype]), expected[k].view(BITS[dtype])), k
        assert torch.equal(on_true[k].view(BITS[dtype]), leaves[k][0].view(BITS[dtype]))


# -- the compiled-mode treespecs (DictSpec, NestedSpec) agree with optree -----------------------
def _trees() -> st.SearchStrategy[Any]:
    leaf = st.integers(1, 3).map(lambda n: torch.arange(float(n)))
    keys = st.sampled_from(["b", "a", "c", "w.x"])
    return st.recursive(
        leaf | st.none(),
        lambda kids: (
            st.dictionaries(keys, kids, max_size=3)
            | st.lists(kids, max_size=3)
            | st.lists(kids, max_size=3).map(tuple)
            | st.tuples(kids, kids).map(lambda ab: Pair(*ab))
        ),
        max_leaves=8,
    )


@settings(max_examples=150, deadline=None)
@given(_trees())
def test_compiled_flatten_specs_match_optree(tree: Any) -> None:
    """Under compile ``flatten`` makes its own specs for dicts, lists, tuples, NamedTuples and
    None: the same leaves in the same order, equal to optree's treespec (both ways), printed
    alike, rebuilt to the same structure, and ``flatten_up_to`` takes what optree's takes."""
    want_leaves, want = optree.tree_flatten(tree, namespace=T.NAMESPACE)
    with mock.patch.object(T, "compiling", lambda: True):
        leaves, spec = T.flatten(tree)
    assert len(leaves) == len(want_leaves)
    assert all(a is b for a, b in zip(leaves, want_leaves))
    assert spec == want and want == spec
    assert not spec != want  # noqa: SIM202 (the __ne__ of the spec itself)
    assert T.spec_text(spec) == str(want).replace(", namespace='funcamp'", "")
    rebuilt = T.unflatten(spec, leaves)
    assert optree.tree_structure(rebuilt, namespace=T.NAMESPACE) == want
    # a tree with a subtree at each leaf: optree's flatten_up_to and the spec's agree
    bigger = optree.tree_unflatten(want, [[x, x] for x in want_leaves])
    assert [len(s) for s in spec.flatten_up_to(bigger)] == [2] * len(want_leaves)
    # and a leaf where the spec has a node is refused by both
    if not want.is_leaf():
        with pytest.raises(ValueError):
            want.flatten_up_to("x")
        with pytest.raises(ValueError):
            spec.flatten_up_to("x")


def test_nested_spec_traces_in_one_graph() -> None:
    """An optimizer state (a NamedTuple of dicts) flattened and rebuilt under
    torch.compile(fullgraph=True) gives the eager result, through a NestedSpec."""
    state = funcamp.adamw(0.1).init({"w": torch.ones(2), "b": torch.zeros(1)})

    def roundtrip(s: Any) -> Any:
        leaves, spec = T.flatten(s)
        assert isinstance(spec, T.NestedSpec)
        return T.unflatten(spec, [x + 1 for x in leaves])

    got = torch.compile(roundtrip, backend="eager", fullgraph=True)(state)
    want = optree.tree_map(lambda x: x + 1, state, namespace=T.NAMESPACE)
    assert type(got) is type(want)
    for a, b in zip(optree.tree_leaves(got), optree.tree_leaves(want)):
        assert torch.equal(a, b)
