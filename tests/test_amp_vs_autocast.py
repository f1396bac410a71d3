"""Differential tests: amp with OpPolicy.autocast("cpu") against torch.autocast("cpu", bf16).

Outputs and gradients must be bit-identical on the model zoo, and every op must come out in
the dtype torch.autocast gives it. The differences that remain (C++ composites hiding listed ops
from a function mode, where no copy sees through them) are listed in docs/differences.md and
pinned here; tests/test_opinfo.py holds amp to torch.autocast over torch's OpInfo samples.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from amp_zoo import ZOO, make_case, one_thread  # noqa: F401 (autouse fixture)
from torch import nn
from torch.func import grad, vmap
from torch.overrides import TorchFunctionMode

import funcamp
from funcamp import OpPolicy, Policy
from funcamp.casting.amp import _COMPOSITES

BF16 = torch.bfloat16
POLICY = Policy(compute_dtype=BF16, ops=OpPolicy.autocast("cpu"))
# Leaves fn's outputs as the ops made them, so dtypes can be compared with autocast's.
RAW = Policy(compute_dtype=BF16, output_dtype=BF16, ops=OpPolicy.autocast("cpu"))
SEEDS = (0, 1, 2)


def autocast_call(fn: Any, *args: Any) -> Any:
    try:
        with torch.autocast("cpu", BF16):
            return fn(*args)
    except RuntimeError as e:
        # torch.autocast runs a bf16 LSTM through oneDNN, which has no such primitive on CPUs
        # without AVX512 (seen on an AMD EPYC): there is no reference to compare with there.
        if "could not create a primitive descriptor" not in str(e):
            raise
        pytest.skip(f"torch.autocast itself fails on this CPU: {str(e).splitlines()[0][:80]}")


def _dtypes(x: Any) -> tuple[torch.dtype, ...]:
    if isinstance(x, torch.Tensor):
        return (x.dtype,)
    if isinstance(x, (list, tuple)):
        return tuple(d for e in x for d in _dtypes(e))
    return ()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_loss_and_grads_bit_identical(name: str, seed: int) -> None:
    _, params, loss, (x, y) = make_case(name, seed)
    ref = autocast_call(loss, params, x, y)
    ref_grads = autocast_call(grad(loss), params, x, y)

    out = funcamp.amp(loss, POLICY)(params, x, y)
    grads = grad(funcamp.amp(loss, POLICY))(params, x, y)

    assert out.dtype == ref.dtype == torch.float32
    assert torch.equal(out, ref), (out.item(), ref.item())
    assert grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert grads[k].dtype == ref_grads[k].dtype == torch.float32, k
        assert torch.equal(grads[k], ref_grads[k]), k


@pytest.mark.parametrize("name", ["cnn", "block"])
def test_autocast_cpu_preset_is_the_cpu_table(name: str) -> None:
    """The ``"autocast_cpu"`` preset is this module's policy: a conv net and a transformer
    block give torch.autocast's loss and grads bit for bit."""
    assert funcamp.get_policy("autocast_cpu") == POLICY
    _, params, loss, (x, y) = make_case(name, 0)
    assert torch.equal(
        funcamp.amp(loss, "autocast_cpu")(params, x, y), autocast_call(loss, params, x, y)
    )
    grads = grad(funcamp.amp(loss, "autocast_cpu"))(params, x, y)
    ref = autocast_call(grad(loss), params, x, y)
    assert all(torch.equal(grads[k], ref[k]) for k in ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_params_that_require_grad_bit_identical(name: str, seed: int) -> None:
    """The other ``requires_grad`` state, as torch's recipe runs it: params that require grad on
    both sides (torch's CPU sdpa picks its math kernel then, flash attention for detached inputs),
    the forward under autocast or amp, ``backward`` outside it."""
    _, params, loss, (x, y) = make_case(name, seed)
    params = {k: v.clone().requires_grad_() for k, v in params.items()}
    ref = autocast_call(loss, params, x, y)
    ref_grads = torch.autograd.grad(ref, list(params.values()))
    out = funcamp.amp(loss, POLICY)(params, x, y)
    grads = torch.autograd.grad(out, list(params.values()))

    assert torch.equal(out, ref), (out.item(), ref.item())
    for k, got, want in zip(params, grads, ref_grads):
        assert got.dtype == want.dtype == torch.float32, k
        assert torch.equal(got, want), k


class _Calls(TorchFunctionMode):
    """Records each torch call with its original (uncast) arguments and its result.

    Entered inside the function run under amp, this mode sits above amp's mode: it sees the
    arguments before amp casts them, then hands the call on to amp. Python composites are
    re-entered as amp does, so the calls they make are recorded one by one.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any], Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        composite = _COMPOSITES.get((getattr(func, "__module__", None), name))
        if composite is not None:
            with self:
                out = composite(*args, **kwargs)
            if out is not NotImplemented:  # a copy declining: recorded as called below
                return out
        out = func(*args, **kwargs)
        if name not in ("__get__", "__set__", "__torch_function__"):
            self.calls.append((func, args, kwargs, out))
        return out


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_every_op_dtype_matches_autocast(name: str) -> None:
    """Each op under amp comes out in the dtype the same call gets under torch.autocast."""
    _, params, loss, (x, y) = make_case(name, 0)

    def recorded(recorder: _Calls) -> Any:
        def fn(p: Any, x: Any, y: Any) -> Any:
            with recorder:
                return loss(p, x, y)

        return fn

    ours = _Calls()
    t = funcamp.trace(recorded(ours), RAW)(params, x, y)
    theirs = _Calls()
    autocast_call(recorded(theirs), params, x, y)

    # trace recorded exactly the calls amp handled, in order, with their output dtypes.
    assert [r.output_dtypes for r in t] == [_dtypes(out) for *_, out in ours.calls]
    # The same calls, in the same dtypes, as under torch.autocast.
    assert [(f.__name__, _dtypes(o)) for f, *_, o in ours.calls] == [
        (f.__name__, _dtypes(o)) for f, *_, o in theirs.calls
    ]
    # Each call replayed alone under autocast, from amp's uncast arguments, gives amp's dtype.
    listed = 0
    with torch.no_grad():
        for (func, args, kwargs, out), record in zip(ours.calls, t):
            listed += record.rule is not funcamp.OpRule.NONE
            if record.inplace or not _dtypes(out):
                continue
            with torch.autocast("cpu", BF16):
                replayed = func(*args, **kwargs)
            assert _dtypes(replayed) == _dtypes(out), record
    assert listed >= 3


# -- documented differences (docs/differences.md) ---------------------------------------------
def _raw(fn: Any, *args: Any) -> torch.Tensor:
    """fn's tensor result under amp, in the dtype the ops made it (not the output dtype)."""

    def keep_dtype(*args: Any) -> tuple[torch.dtype, torch.Tensor]:
        out = fn(*args)
        return out.dtype, out.double()  # float64 leaves pass the output cast untouched

    dtype, value = funcamp.amp(keep_dtype, POLICY)(*args)
    return value.to(dtype)


def _raw_fn(fn: Any) -> Any:
    """``fn`` under amp, its tensor result in the dtype the ops made it (vmap-able)."""

    def keep(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = fn(*args)
        return out.double(), torch.zeros((), dtype=out.dtype)

    amped = funcamp.amp(keep, POLICY)

    def run(*args: Any) -> torch.Tensor:
        value, marker = amped(*args)
        return value.to(marker.dtype)

    return run


@pytest.mark.parametrize(
    "equation", ["ij,ij->ij", "bij->bi", "ij->ji", "ij,kj->ik", "bij,bjk->bik", "ijk,kl->il"]
)
def test_einsum_matches_whether_or_not_it_reaches_bmm(equation: str) -> None:
    """einsum's Python copy makes the calls its C++ kernel makes: an equation that never reaches bmm
    (one operand, or no contracted dimension) stays float32, one that does runs its bmm in bf16
    after summing, in float32, the dimensions only one operand has (``ijk,kl->il`` sums ``j``)."""
    torch.manual_seed(0)
    shapes = {
        "ij,ij->ij": [(5, 3), (5, 3)],
        "bij->bi": [(2, 5, 3)],
        "ij->ji": [(5, 3)],
        "ij,kj->ik": [(5, 3), (4, 3)],
        "bij,bjk->bik": [(2, 5, 3), (2, 3, 4)],
        "ijk,kl->il": [(5, 6, 3), (3, 4)],
    }[equation]
    operands = [torch.randn(*shape) for shape in shapes]

    def run(*ops: torch.Tensor) -> torch.Tensor:
        return torch.einsum(equation, *ops)

    ref = autocast_call(run, *operands)
    assert ref.dtype == (torch.float32 if equation in ("ij,ij->ij", "bij->bi", "ij->ji") else BF16)
    assert _raw(run, *operands).dtype == ref.dtype
    assert torch.equal(_raw(run, *operands), ref)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_pad_reflect_replicate_matches_on_bf16(mode: str) -> None:
    x = torch.randn(2, 3, 6)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (2, 2), mode=mode)

    # float32 input: identical (the pad kernel's float32 rule changes nothing).
    assert torch.equal(_raw(pad, x), autocast_call(pad, x))
    # bf16 input: autocast upcasts reflection/replication pads, and so does F.pad's Python copy.
    xb = x.to(BF16)
    assert autocast_call(pad, xb).dtype == torch.float32
    assert _raw(pad, xb).dtype == torch.float32
    assert torch.equal(_raw(pad, xb), autocast_call(pad, xb))


def test_difference_cpu_gru() -> None:
    """``nn.GRU`` runs its cells inside one C++ kernel (``_VF.gru``) that no Python copy stands for."""
    torch.manual_seed(0)
    module = nn.GRU(5, 7)
    x = torch.randn(4, 5)

    def run(x: torch.Tensor) -> torch.Tensor:
        return module(x)[0]

    ref = autocast_call(run, x)
    ours = _raw(run, x)
    # autocast: bf16 matmuls inside, float32 hidden state keeps the result in float32.
    assert ref.dtype == torch.float32
    assert not torch.equal(ref, run(x))
    # amp: the whole composite runs in bf16 (the rule of its inner linear).
    assert ours.dtype == BF16
    assert (ours.float() - ref).abs().max() < 0.1


@pytest.mark.parametrize("kind", ["GRUCell", "LSTMCell", "RNNCell", "RNNCell-relu"])
def test_rnn_cells_match_on_cpu(kind: str) -> None:
    """The cells' copies make their kernels' two ``linear`` calls (cast) and the gate arithmetic
    (not cast): bf16 gates, and a float32 result where the float32 hidden state promotes it."""
    torch.manual_seed(0)
    module = {
        "GRUCell": nn.GRUCell(5, 7),
        "LSTMCell": nn.LSTMCell(5, 7),
        "RNNCell": nn.RNNCell(5, 7),
        "RNNCell-relu": nn.RNNCell(5, 7, nonlinearity="relu"),
    }[kind]
    x = torch.randn(4, 5)

    def run(x: torch.Tensor) -> torch.Tensor:
        out = module(x)
        return out[0] if isinstance(out, tuple) else out

    ref = autocast_call(run, x)
    assert ref.dtype == (torch.float32 if kind in ("GRUCell", "LSTMCell") else BF16)
    assert torch.equal(_raw(run, x), ref) and _raw(run, x).dtype == ref.dtype


def test_lstm_and_rnn_match_on_cpu() -> None:
    """The counterpart of the GRU difference: LSTM (mkldnn_rnn_layer) and RNN match."""
    torch.manual_seed(0)
    x = torch.randn(3, 4, 5)
    for module in (nn.LSTM(5, 7), nn.RNN(5, 7), nn.RNNCell(5, 7)):
        inp = x[0] if isinstance(module, nn.RNNCell) else x

        def run(x: torch.Tensor, module: nn.Module = module) -> torch.Tensor:
            out = module(x)
            return out[0] if isinstance(out, tuple) else out

        assert torch.equal(_raw(run, inp), autocast_call(run, inp)), module


def test_bilinear_matches() -> None:
    torch.manual_seed(0)
    a, b, w, bias = torch.randn(4, 5), torch.randn(4, 6), torch.randn(3, 5, 6), torch.randn(3)

    def bil(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.bilinear(a, b, w, bias)

    exact = bil(a, b)
    ref = autocast_call(bil, a, b)
    # autocast casts the bmm inside _trilinear's kernel; the result is float32 but rounded, and
    # bilinear's Python copy runs the same loop of bmm calls.
    assert ref.dtype == torch.float32 and not torch.equal(ref, exact)
    assert torch.equal(_raw(bil, a, b), ref)


def test_difference_transformer_encoder_fast_path() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        ref = autocast_call(layer, x)
        t = funcamp.trace(layer, RAW)(x)
    # autocast takes the fused fast path (_transformer_encoder_layer_fwd, bf16 inside);
    # an active torch function mode disables it, so amp runs the Python slow path.
    assert ref.dtype == BF16
    assert not t.ops("_transformer_encoder_layer_fwd")
    assert t.records[-1].op == "layer_norm" and t.records[-1].output_dtypes == (torch.float32,)
    assert {r.output_dtypes for r in t.ops("linear")} == {(BF16,)}


def _autocast_backward(loss: Any, a: torch.Tensor) -> torch.Tensor:
    """The gradient as torch recommends it: forward under autocast, backward outside it."""
    a = a.clone().requires_grad_()
    with torch.autocast("cpu", BF16):
        out = loss(a)
    out.backward()
    assert a.grad is not None
    return a.grad


def test_difference_gradients_of_bilinear_and_pinv() -> None:
    """``_trilinear`` (under ``F.bilinear``) and ``linalg.pinv`` have backward formulas of their
    own: autocast records one node, whose backward runs in float32 from what it saved; the copies
    record the bf16 bmm/matmul calls they made and autograd differentiates those. The forward
    results are identical (test_opinfo.py)."""
    torch.manual_seed(0)
    a, b, w, m = torch.randn(4, 5), torch.randn(4, 6), torch.randn(3, 5, 6), torch.randn(5, 5)

    def bil(a: torch.Tensor) -> torch.Tensor:
        return F.bilinear(a, b, w).sum()

    def pinv(m: torch.Tensor) -> torch.Tensor:
        return torch.linalg.pinv(m).sum()

    ours, ref = grad(funcamp.amp(bil, POLICY))(a), _autocast_backward(bil, a)
    assert not torch.equal(ours, ref)
    assert (ours - ref).abs().max() < 0.01 * ref.abs().max()  # measured: 0.17-0.27 %
    # torch's own pinv backward refuses the bf16 result autocast saved; amp's grads are finite.
    with pytest.raises(RuntimeError, match="same dtype"):
        _autocast_backward(pinv, m)
    assert torch.isfinite(grad(funcamp.amp(pinv, POLICY))(m)).all()


def test_difference_leaf_cast_cache() -> None:
    """autocast casts a leaf that requires grad once per autocast region and reuses the copy
    (its weight cache), so the gradients of every use add up in bf16 before the one cast back;
    amp casts at each use and adds them in float32. A tensor that is not such a leaf, or a leaf
    used once, gets the same gradients."""
    torch.manual_seed(0)
    m = torch.randn(5, 5)

    def twice(m: torch.Tensor) -> torch.Tensor:
        return (m @ m).sum()

    def twice_not_leaf(m: torch.Tensor) -> torch.Tensor:
        return ((m * 1) @ (m * 1)).sum()

    ours, ref = grad(funcamp.amp(twice, POLICY))(m), _autocast_backward(twice, m)
    assert not torch.equal(ours, ref)
    assert (ours - ref).abs().max() < 0.01 * ref.abs().max()  # measured: 0.2-0.3 %
    assert torch.equal(
        grad(funcamp.amp(twice_not_leaf, POLICY))(m), _autocast_backward(twice_not_leaf, m)
    )


def test_difference_backward_inside_autocast() -> None:
    """``torch.func.grad`` called inside ``torch.autocast`` runs the backward under autocast
    too, so a backward formula that calls a listed op on float32 tensors is cast: ``linalg.inv``
    (float32 on CPU's list) differentiates through ``matmul``, which runs in bf16 there. amp
    casts the forward only, as autocast does when the backward runs outside it (torch's advice):
    amp equals that, not the backward inside autocast."""
    torch.manual_seed(0)
    m = torch.randn(4, 4)

    def power(m: torch.Tensor) -> torch.Tensor:
        return torch.linalg.matrix_power(m * 1, -2).sum()

    ours = grad(funcamp.amp(power, POLICY))(m)
    assert torch.equal(ours, _autocast_backward(power, m))
    assert not torch.equal(ours, autocast_call(grad(power), m))


def test_difference_rnn_cells_under_vmap() -> None:
    """torch has no batching rule for ``gru_cell``/``lstm_cell``: under ``vmap`` it runs them
    sample by sample, each ``linear`` a 2-d ``addmm`` (bias added inside, rounded once). The
    copies' ``linear`` calls are batched by linear's own batching rule, which rounds the bf16
    product and the bias add separately -- as a vmapped bf16 ``F.linear`` differs from the same
    call sample by sample in torch itself. Unbatched, both agree bit for bit."""
    torch.manual_seed(0)
    cell = nn.GRUCell(4, 4)
    x = torch.randn(2, 4, 4)

    def run(x: torch.Tensor) -> torch.Tensor:
        return cell(x, x.flip(0))

    ours = vmap(_raw_fn(run))(x)
    ref = autocast_call(vmap(run), x)
    assert torch.equal(autocast_call(run, x[0]), ref[0])  # torch: vmap = sample by sample
    assert torch.equal(_raw(run, x[0]), ref[0])  # amp: identical unbatched
    assert not torch.equal(ours, ref) and (ours - ref).abs().max() < 0.02
    w, b = torch.randn(6, 4, dtype=BF16), torch.randn(6, dtype=BF16)
    xb = x.to(BF16)
    batched = vmap(lambda x: F.linear(x, w, b))(xb)
    assert not torch.equal(batched, torch.stack([F.linear(xb[0], w, b), F.linear(xb[1], w, b)]))
