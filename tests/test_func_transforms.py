"""``amp`` commutes with every torch.func transform, in both orders, as torch.autocast does.

For each transform T and each model of a small zoo: ``T(amp(f))`` against ``T(autocast(f))``
and ``amp(T(f))`` against ``autocast(T(f))``, bit for bit (values and dtypes), where the
reference is torch.autocast("cpu", bf16) followed by amp's output cast (what ``amp`` adds to
autocast). Every cell is a test; the cells where torch.autocast is not what amp reproduces are
listed in ``KNOWN`` with the reason, each pinned (docs/differences.md has the rows):

- ``"formulas"``: torch.autocast casts the ops of T's derivative formulas too (the backward
  when T runs inside autocast, forward-mode tangents in either order: they are computed during
  the forward), which a function mode cannot see; amp casts the function's ops only, as
  autocast does with the backward outside it (torch's advice).
- ``"vmap"``: under vmap CPU autocast sees ``convolution`` (unlisted on CPU, listed on CUDA) and
  sdpa's math decomposition instead of the listed ops, so it leaves them uncast; amp keeps the
  policy's rule (docs/differences.md, "under vmap").
- ``"sdpa"``: under a transform that batches sdpa or carries tangents or gradients through it,
  torch decomposes it before autocast sees it, and autocast casts the pieces.
- ``"torch"``: torch.autocast itself raises (mixed-dtype derivative formulas of layer_norm and
  sdpa under vmap, randomness inside jacfwd); amp must then give finite values or raise too.

Both orders of amp also equal each other everywhere both run (``test_amp_orders_agree``): amp
commutes with T. The CUDA-list preset ("mixed_bfloat16") has no torch.autocast on a CPU; for
the zoo's ops its lists coincide with CPU's except layer_norm (float32 on CUDA's list), which a
reference model runs in float32 by hand under torch.autocast("cpu").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from exhaustive import exhaustive
from torch import nn
from torch.func import (
    functional_call,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    stack_module_state,
    vjp,
    vmap,
)

import funcamp
from funcamp.policy.policy import cast_floating

BF16, F32 = torch.bfloat16, torch.float32


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- the zoo ----------------------------------------------------------------------------------
class Lin(nn.Module):
    def __init__(self, cuda_reference: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class CNN(nn.Module):
    def __init__(self, cuda_reference: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 2 * 2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(h.flatten(-3))


class LN(nn.Module):
    """Linear -> LayerNorm -> Linear. ``cuda_reference`` runs layer_norm as CUDA's autocast
    list does (float32), by hand, for the CUDA-list preset's reference."""

    def __init__(self, cuda_reference: bool = False) -> None:
        super().__init__()
        self.cuda_reference = cuda_reference
        self.a, self.norm, self.b = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.cuda_reference:
            with torch.autocast("cpu", enabled=False):
                h = self.norm(h.float())
        else:
            h = self.norm(h)
        return self.b(h)


class Attn(nn.Module):
    def __init__(self, cuda_reference: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v)


class Drop(nn.Module):
    def __init__(self, cuda_reference: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc(x), 0.5, training=True)


ZOO: dict[str, tuple[type[nn.Module], tuple[int, ...]]] = {
    "linear": (Lin, (4,)),
    "cnn": (CNN, (2, 4, 4)),
    "layernorm": (LN, (4,)),
    "attention": (Attn, (3, 4)),
    "dropout": (Drop, (4,)),
}


class Case:
    """A model of the zoo as ``f(params, x)``, its params and a batch of 3 samples."""

    def __init__(self, name: str, cuda_reference: bool = False) -> None:
        cls, shape = ZOO[name]
        torch.manual_seed(0)
        self.model = cls(cuda_reference)
        self.params = {k: v.detach() for k, v in self.model.named_parameters()}
        self.x = torch.randn(3, *shape, generator=torch.Generator().manual_seed(1))

    def f(self, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, p, (x,))


def _loss(f: Callable[..., Any]) -> Callable[..., Any]:
    return lambda p, x: f(p, x).float().pow(2).mean()


def _ensemble(f: Callable[..., Any], p: Any, x: torch.Tensor) -> Any:
    """Model ensembling as torch's tutorial writes it: stacked copies of the params, vmapped."""
    copies = [{k: v * (1 + 0.1 * i) for k, v in p.items()} for i in range(2)]
    stacked = stack_module_state_of(copies)
    return vmap(f, in_dims=(0, None), randomness="different")(stacked, x)


def stack_module_state_of(copies: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    modules = []
    for c in copies:
        m = nn.Module()
        for k, v in c.items():
            m.register_parameter(k.replace(".", "_"), nn.Parameter(v.clone()))
        modules.append(m)
    params, _ = stack_module_state(modules)
    return {k: params[k.replace(".", "_")].detach() for k in copies[0]}


def _vjp(f: Callable[..., Any], p: Any, x: torch.Tensor) -> Any:
    out, pull = vjp(lambda p: f(p, x), p)
    return out, pull(torch.ones_like(out))


def _linearize(f: Callable[..., Any], p: Any, x: torch.Tensor) -> Any:
    out, push = linearize(lambda x: f(p, x), x)
    return out, push(torch.ones_like(x))


TRANSFORMS: dict[str, Callable[[Callable[..., Any], Any, torch.Tensor], Any]] = {
    "grad": lambda f, p, x: grad(_loss(f))(p, x),
    "grad_and_value": lambda f, p, x: grad_and_value(_loss(f), argnums=(0, 1))(p, x),
    "vjp": _vjp,
    "jacrev": lambda f, p, x: jacrev(f, argnums=1)(p, x[0]),
    "jacfwd": lambda f, p, x: jacfwd(f, argnums=1, randomness="same")(p, x[0]),
    "jvp": lambda f, p, x: jvp(lambda x: f(p, x), (x,), (torch.ones_like(x),)),
    "hessian": lambda f, p, x: hessian(_loss(f), argnums=1)(p, x[:1]),
    "linearize": _linearize,
    "vmap": lambda f, p, x: vmap(f, in_dims=(None, 0), randomness="different")(p, x),
    "vmap_grad": lambda f, p, x: vmap(grad(_loss(f)), (None, 0), randomness="different")(p, x),
    "functional_call": lambda f, p, x: f(p, x),
    "ensemble": _ensemble,
}

ORDERS_ = ORDERS = ("inside", "outside")

#: (model, transform, order) -> why torch.autocast is not what amp reproduces there.
KNOWN: dict[tuple[str, str, str], str] = {
    # sdpa under a transform that batches it or carries tangents/gradients through it: torch
    # decomposes it (math path) before autocast sees it, and autocast casts the pieces.
    **{("attention", t, o): "sdpa" for t in TRANSFORMS for o in ORDERS_},
    # backward formulas of sdpa/layer_norm mix dtypes where autocast casts the forward only.
    **{
        ("attention", t, "inside"): "torch"
        for t in ("grad", "grad_and_value", "hessian", "jacrev", "vjp", "vmap_grad")
    },
    ("layernorm", "jacrev", "inside"): "torch",
    ("layernorm", "jacrev", "outside"): "torch",
    ("layernorm", "linearize", "inside"): "torch",
    ("layernorm", "linearize", "outside"): "torch",
    ("dropout", "hessian", "inside"): "torch",  # randomness="error" inside jacfwd: torch's rule
    ("dropout", "hessian", "outside"): "torch",
    # forward-mode tangents (computed inside autocast's region in both orders) and the
    # backward of a reverse-over-forward hessian: autocast casts their formulas' ops.
    ("layernorm", "jacfwd", "inside"): "formulas",
    ("layernorm", "jacfwd", "outside"): "formulas",
    ("layernorm", "hessian", "outside"): "formulas",
    # convolution under vmap: unlisted on CPU's autocast list (listed on CUDA's).
    **{("cnn", t, o): "vmap" for t in ("vmap", "ensemble") for o in ORDERS_},
}
for _o in ORDERS_:  # sdpa unbatched, with no tangent: cast whole by both
    for _t in ("functional_call", "linearize"):
        KNOWN.pop(("attention", _t, _o))
KNOWN[("attention", "linearize", "outside")] = "sdpa"


def _autocast(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.autocast("cpu", bf16) around ``fn``, then amp's output cast (float32)."""

    def run(*args: Any) -> Any:
        with torch.autocast("cpu", BF16):
            out = fn(*args)
        return cast_floating(out, F32)

    return run


def _run(order: str, transform: str, f: Callable[..., Any], p: Any, x: Any, wrap: Any) -> Any:
    t = TRANSFORMS[transform]
    torch.manual_seed(7)
    if order == "inside":  # T(amp(f))
        return t(wrap(f), p, x)
    return wrap(lambda p, x: t(f, p, x))(p, x)  # amp(T(f))


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as e:
        return e


def _same(a: Any, b: Any) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(la, lb, strict=True)
    )


def _finite(a: Any) -> bool:
    return all(bool(t.isfinite().all()) for t in torch.utils._pytree.tree_leaves(a))


# torch 2.14 changed scaled_dot_product_attention's CPU dispatch under torch.func: its flash
# kernel runs (no decomposition) where 2.13 decomposed it, so reverse mode now matches autocast
# bit for bit in both orders, forward mode raises for both (the flash kernel has no forward-mode
# derivative), and autocast still raises inside jacrev/vmap(grad). Measured on 2.14.1 (CPU).
if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 14):
    for _o in ORDERS_:
        for _t in ("grad", "grad_and_value", "vjp"):
            KNOWN.pop(("attention", _t, _o), None)
        for _t in ("hessian", "jvp", "linearize"):
            KNOWN[("attention", _t, _o)] = "torch"
        for _t in ("jacfwd", "jacrev", "vmap_grad", "vmap", "ensemble"):
            KNOWN[("attention", _t, _o)] = "sdpa"
    KNOWN[("attention", "jacrev", "inside")] = "torch"
    KNOWN[("attention", "vmap_grad", "inside")] = "torch"


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("model", sorted(ZOO))
def test_amp_equals_autocast_under_transform(model: str, transform: str, order: str) -> None:
    case = Case(model)
    amped = _attempt(
        lambda: _run(order, transform, case.f, case.params, case.x, _amp("autocast_cpu"))
    )
    ref = _attempt(lambda: _run(order, transform, case.f, case.params, case.x, _autocast))
    known = KNOWN.get((model, transform, order))
    if known is None:
        assert not isinstance(amped, Exception), amped
        assert not isinstance(ref, Exception), ref
        assert _same(amped, ref)
        return
    if known == "torch":
        assert isinstance(ref, Exception)
        assert isinstance(amped, Exception) or _finite(amped)
    else:  # a pinned difference: it still differs (else drop it from KNOWN)
        assert not isinstance(amped, Exception), amped
        assert isinstance(ref, Exception) or not _same(amped, ref)


def _amp(policy: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return lambda fn: funcamp.amp(fn, policy)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("model", sorted(ZOO))
def test_amp_orders_agree(model: str, transform: str) -> None:
    """``amp(T(f))`` equals ``T(amp(f))`` (never zeros), wherever both run."""
    case = Case(model)
    runs = [
        _attempt(lambda o=o: _run(o, transform, case.f, case.params, case.x, _amp("autocast_cpu")))
        for o in ORDERS
    ]
    if any(isinstance(r, Exception) for r in runs):
        assert all(isinstance(r, Exception) for r in runs), runs
        return
    assert _same(*runs)
    assert any(bool(t.ne(0).any()) for t in torch.utils._pytree.tree_leaves(runs[0]))


# -- the CUDA-list preset -----------------------------------------------------------------------
CUDA_LISTS = "mixed_bfloat16"  # OpPolicy.default(): torch's CUDA lists, bf16 compute
CUDA_CELLS = [
    (m, t, o)
    for m in ("cnn", "dropout", "layernorm", "linear")
    for t in ("grad", "jacrev", "vjp", "vmap", "vmap_grad", "ensemble")
    for o in ORDERS
    if KNOWN.get((m, t, o)) is None
]


@pytest.mark.parametrize(("model", "transform", "order"), CUDA_CELLS)
def test_cuda_lists_preset_equals_autocast_with_cuda_rules_by_hand(
    model: str, transform: str, order: str
) -> None:
    """torch.autocast("cpu") cannot run CUDA's lists; for the zoo's ops they coincide with
    CPU's except layer_norm (float32 on CUDA's), which the reference model runs in float32 by
    hand (``cuda_reference``) under torch.autocast("cpu")."""
    case, ref_case = Case(model), Case(model, cuda_reference=True)
    amped = _run(order, transform, case.f, case.params, case.x, _amp(CUDA_LISTS))
    ref = _run(order, transform, ref_case.f, ref_case.params, ref_case.x, _autocast)
    assert _same(amped, ref)


def test_cuda_lists_layer_norm_runs_in_float32() -> None:
    """The layernorm model is where the two presets differ: CUDA's list runs layer_norm in
    float32 (what the reference does by hand), CPU's in the input's bf16."""
    case = Case("layernorm")

    def norm_dtypes(policy: str) -> list[tuple[torch.dtype, ...]]:
        records = funcamp.trace(case.f, policy)(case.params, case.x[0]).records
        return [r.input_dtypes for r in records if r.op == "layer_norm"]

    assert norm_dtypes(CUDA_LISTS) == [(F32, F32, F32)]
    assert norm_dtypes("autocast_cpu") == [(BF16, F32, F32)]


# -- compiled (aot_eager) ---------------------------------------------------------------------
# torch.compile of jvp through layer_norm fails with torch.autocast as with amp (dynamo's fake
# tensor call of layer_norm on a GradTrackingTensor: an InferenceMode internal assert).
COMPILE_FAILS = {("layernorm", "jvp")}
COMPILED_QUICK = {("linear", "grad", "outside"), ("linear", "vmap", "inside")}


_COMPILED_MODELS = ("layernorm", "linear", "cnn")
_COMPILED_TRANSFORMS = ("grad", "vjp", "vmap", "vmap_grad", "jacrev", "jvp")


def _compiles(m: str, t: str, o: str) -> bool:
    return KNOWN.get((m, t, o)) is None and (m, t) not in COMPILE_FAILS


def _suite_cells() -> set[tuple[str, str, str]]:
    """The whole suite's cells: every transform in both orders once, the models taking turns
    (each (transform, order) on the next model that compiles it); the rest of the grid is an
    exhaustive sweep."""
    cells = set(COMPILED_QUICK)
    for i, (t, o) in enumerate((t, o) for t in _COMPILED_TRANSFORMS for o in ORDERS):
        turns = [_COMPILED_MODELS[(i + k) % 3] for k in range(3)]
        m = next((m for m in turns if _compiles(m, t, o)), None)
        if m is not None and not any((m2, t, o) in cells for m2 in _COMPILED_MODELS):
            cells.add((m, t, o))
    return cells


def _compiled_cells() -> list[Any]:
    suite = _suite_cells()
    cells = []
    for m in _COMPILED_MODELS:
        for t in _COMPILED_TRANSFORMS:
            for o in ORDERS:
                if not _compiles(m, t, o):
                    continue
                if (m, t, o) in COMPILED_QUICK:
                    marks = []
                else:
                    marks = [pytest.mark.slow] + ([] if (m, t, o) in suite else [exhaustive])
                cells.append(pytest.param(m, t, o, marks=marks, id=f"{m}-{t}-{o}"))
    return cells


@pytest.mark.parametrize(("model", "transform", "order"), _compiled_cells())
def test_compiled_equals_autocast_under_transform(model: str, transform: str, order: str) -> None:
    """``torch.compile(T(amp(f)))`` and ``torch.compile(amp(T(f)))`` (aot_eager, fullgraph):
    the eager reference, bit for bit."""
    torch._dynamo.reset()
    case = Case(model)
    t = TRANSFORMS[transform]
    amp = _amp("autocast_cpu")
    if order == "inside":
        amped = amp(case.f)  # built eagerly: amp reads its policy outside the trace
        fn = torch.compile(lambda p, x: t(amped, p, x), backend="aot_eager", fullgraph=True)
    else:
        fn = torch.compile(amp(lambda p, x: t(case.f, p, x)), backend="aot_eager", fullgraph=True)
    torch.manual_seed(7)
    got = fn(case.params, case.x)
    ref = _run(order, transform, case.f, case.params, case.x, _autocast)
    assert _same(got, ref)


INDUCTOR_CELLS = [
    ("linear", "grad", "outside"),
    ("linear", "vmap", "inside"),
    ("cnn", "vmap_grad", "inside"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "transform", "order"), INDUCTOR_CELLS)
def test_inductor_amp_equals_inductor_autocast(model: str, transform: str, order: str) -> None:
    """The budgeted inductor subset: ``torch.compile`` (inductor, fullgraph) of the transformed
    amp function equals the same compile of the transformed autocast function, bit for bit, and
    the eager reference within inductor's own fusion rounding."""
    case = Case(model)
    t = TRANSFORMS[transform]

    def compiled(wrap: Any) -> Any:
        torch._dynamo.reset()
        if order == "inside":
            wrapped = wrap(case.f)
            fn = torch.compile(lambda p, x: t(wrapped, p, x), fullgraph=True)
        else:
            fn = torch.compile(wrap(lambda p, x: t(case.f, p, x)), fullgraph=True)
        torch.manual_seed(7)
        return fn(case.params, case.x)

    got, want = compiled(_amp("autocast_cpu")), compiled(_autocast)
    assert _same(got, want)
    ref = _run(order, transform, case.f, case.params, case.x, _autocast)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


# -- trace of a transformed function ----------------------------------------------------------
def _traced_transforms(case: Case) -> dict[str, Callable[..., Any]]:
    """Each transform of ``case.f`` with every tensor it needs made outside (tangents,
    cotangents, stacked params), so that the ops the trace sees are the model's and torch.func's."""
    f, p, x = case.f, case.params, case.x
    x0, out = x[0], f(p, x)
    loss = _loss(f)
    stacked = stack_module_state_of([p, p])
    return {
        "grad": lambda: grad(loss)(p, x),
        "grad_and_value": lambda: grad_and_value(loss)(p, x),
        "vjp": lambda: vjp(lambda p: f(p, x), p)[1](out),
        "jacrev": lambda: jacrev(f, argnums=1)(p, x0),
        "jacfwd": lambda: jacfwd(f, argnums=1)(p, x0),
        "jvp": lambda: jvp(lambda x: f(p, x), (x,), (x,)),
        "hessian": lambda: hessian(loss, argnums=1)(p, x0),
        "linearize": lambda: linearize(lambda x: f(p, x), x)[1](x),
        "vmap": lambda: vmap(f, in_dims=(None, 0))(p, x),
        "vmap_grad": lambda: vmap(grad(loss), in_dims=(None, 0))(p, x),
        "ensemble": lambda: vmap(f, in_dims=(0, None))(stacked, x),
    }


@pytest.mark.parametrize("transform", sorted(TRANSFORMS.keys() - {"functional_call"}))
def test_trace_of_a_transformed_function_lists_the_model_ops_only(transform: str) -> None:
    """torch.func's own calls (marking its inputs, grad-mode switches, ``dim``/``size``
    checks, the ``autograd.grad`` it runs, ``make_dual``) are not the model's ops: ``trace``
    lists the same ops under every transform as without one (plus the loss's, where T needs a
    scalar)."""
    case = Case("linear")
    run = _traced_transforms(case)[transform]
    ops = [r.op for r in funcamp.trace(run, "autocast_cpu")()]
    scalar = transform in ("grad", "grad_and_value", "hessian", "vmap_grad")
    assert ops == ["linear", *(["float", "pow", "mean"] if scalar else [])]


# -- products with a bias under vmap ----------------------------------------------------------
def _bias_products() -> dict[str, tuple[Callable[..., Any], torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(3, 4, generator=g), torch.randn(3, generator=g)
    m2, bias = torch.randn(4, 5, generator=g), torch.randn(3, 5, generator=g)
    b2 = torch.randn(3, 4, 5, generator=g)
    return {
        "linear_1d": (lambda x: F.linear(x, w, b), torch.randn(2, 4, generator=g)),
        "linear_2d": (lambda x: F.linear(x, w, b), torch.randn(2, 3, 4, generator=g)),
        "addmm": (lambda x: torch.addmm(bias, x, m2, beta=0.5, alpha=2.0), torch.randn(2, 3, 4)),
        "baddbmm": (lambda x: torch.baddbmm(bias[:, None], x, b2), torch.randn(2, 3, 3, 4)),
        "addbmm": (lambda x: bias.addbmm(x, b2), torch.randn(2, 3, 3, 4)),
    }


def _with_output(op: Callable[..., Any]) -> Callable[..., Any]:
    return lambda x: (op(x).float().sum(), op(x))


@pytest.mark.parametrize("under", ["vmap", "vmap_grad"])
@pytest.mark.parametrize("op", sorted(_bias_products()))
def test_products_with_a_bias_under_vmap_as_autocast(op: str, under: str) -> None:
    """Under vmap, autocast sees linear/addmm/baddbmm/addbmm after functorch decomposed them:
    the product cast, the bias added in float32 (a float32 result); under grad above the vmap,
    the whole call cast, except linear of a 1-d input. amp gives the same values and dtype."""
    fn, x = _bias_products()[op]
    if under == "vmap":
        t = vmap(fn)
    else:
        t = lambda x: vmap(grad(_with_output(fn), has_aux=True))(x)[1]  # noqa: E731
    box: list[Any] = []
    funcamp.amp(lambda x: box.append(t(x)), "autocast_cpu")(x)
    with torch.autocast("cpu", BF16):
        ref = t(x)
    assert box[0].dtype == ref.dtype and torch.equal(box[0], ref)
    decomposed = under == "vmap" or op == "linear_1d"
    assert ref.dtype == (F32 if decomposed else BF16)


# -- differences under vmap (docs/differences.md) ---------------------------------------------
def _raw_under(t: Callable[..., Any], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    box: list[Any] = []
    funcamp.amp(lambda x: box.append(t(x)), "autocast_cpu")(x)
    with torch.autocast("cpu", BF16):
        ref = t(x)
    return box[0], ref


def test_difference_convolution_under_vmap() -> None:
    """Under vmap CPU autocast sees ``convolution`` (batching rule of conv2d), which CPU's list
    lacks (CUDA's has it): the convolution runs uncast, in float32. amp keeps conv2d's rule
    (bf16), as unbatched and as on CUDA; sample by sample the two agree."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g)
    x = torch.randn(2, 3, 6, 6, generator=g)
    t = vmap(lambda x: F.conv2d(x, w, b))
    ours, ref = _raw_under(t, x)
    assert ref.dtype == F32 and torch.equal(ref, t(x))  # autocast: not cast at all
    assert ours.dtype == BF16
    one, one_ref = _raw_under(lambda x: F.conv2d(x, w, b), x[0])
    assert torch.equal(one, one_ref) and torch.equal(ours[0], one)
    assert 0 < (ours.float() - ref).abs().max() < 0.1


def test_difference_float32_losses_under_vmap() -> None:
    """Under vmap the CPU float32-list losses decompose before autocast sees them: their
    pieces run in the input's bf16 (a bf16 loss). amp keeps the float32 rule."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 8, generator=g), torch.rand(2, 8, generator=g)
    t = vmap(lambda x, y: F.binary_cross_entropy_with_logits(x.bfloat16(), y.bfloat16()))
    box: list[Any] = []
    funcamp.amp(lambda x, y: box.append(t(x, y)), "autocast_cpu")(x, y)
    with torch.autocast("cpu", BF16):
        ref = t(x, y)
    assert ref.dtype == BF16 and box[0].dtype == F32
    assert 0 < (box[0] - ref.float()).abs().max() < 0.02


def _ntk(f: Callable[..., Any], p: Any, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The empirical neural tangent kernel as torch's tutorial computes it: per-sample
    Jacobians (``vmap(jacrev)``), contracted with ``einsum``."""

    def one(p: Any, x: torch.Tensor) -> torch.Tensor:
        return f(p, x[None])[0]

    j1 = vmap(jacrev(one), (None, 0))(p, x1)
    j2 = vmap(jacrev(one), (None, 0))(p, x2)
    return sum(torch.einsum("Naf,Mbf->NMab", a.flatten(2), b.flatten(2)) for a, b in zip(j1.values(), j2.values(), strict=True))  # fmt: skip


@pytest.mark.parametrize("order", ORDERS)
def test_neural_tangent_kernel(order: str) -> None:
    """The NTK tutorial's computation, with amp inside (around the model) or outside (around
    the whole kernel): equal to torch.autocast placed the same way, never zeros."""
    case = Case("linear")
    x1, x2 = case.x, case.x.flip(0)
    if order == "inside":
        ours = _ntk(_amp("autocast_cpu")(case.f), case.params, x1, x2)
        ref = _ntk(_autocast(case.f), case.params, x1, x2)
    else:
        ours = _amp("autocast_cpu")(lambda: _ntk(case.f, case.params, x1, x2))()
        ref = _autocast(lambda: _ntk(case.f, case.params, x1, x2))()
    assert _same(ours, ref) and bool(ours.ne(0).any())
