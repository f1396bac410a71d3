"""funcamp's compiler patches (``funcamp/compiler/``): off torch's default path, opt-in outside
the allowlist, scoped to funcamp's own compiles, in inductor's cache key, installed once.

Each test states funcamp's contract (same bits, torch's code path for everything else), not
inductor's internals. The fixes this file pins, and how each was seen to fail without them:
the nested-list liveness of ``dead_stores`` (``_live_ids`` flattening one level), the patches'
state in the FX graph cache key (``PatchKey``), the channels-last pass moving a tensor a
fixed-stride custom op reads, and the race of two threads installing ``cpp_bundle``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from fresh_compile import fresh_inductor
from torch import nn
from torch._dynamo.utils import counters

import funcamp
from funcamp._core import context
from funcamp.compiler import (
    cpp_bundle,
    cross_entropy,
    dead_stores,
    gate,
    hooks,
    layouts,
    switch,
    torch_release,
)
from funcamp.train.compiling import compile_fn, fresh_code, patches_for

try:
    from torch._inductor.utils import fresh_cache
except ImportError:  # torch < 2.8
    from torch._inductor.utils import fresh_inductor_cache as fresh_cache


def _update(p, m, g):
    """An update written into its inputs: the case dead_stores changes (and C++ kernels)."""
    m_new = m * 0.9 + g * 0.1
    p_new = p - 0.01 * m_new / (m_new.abs().sqrt() + 1e-8)
    m.copy_(m_new)
    p.copy_(p_new)
    return p_new.sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(33, 5, generator=g) for _ in range(3)]


def _fresh(fn):
    """A function of its own (dynamo keeps compiled code per code object)."""
    return types.FunctionType(fresh_code(fn.__code__), fn.__globals__)


# -- import: nothing patched, no compiler module loaded ----------------------------------------

_PROBE = """
import json, sys, time
import torch
start = time.perf_counter()
import funcamp
seconds = time.perf_counter() - start
loaded = sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor")))
patch_modules = sorted(m for m in sys.modules if m.startswith("funcamp.compiler.")
                       and m.rsplit(".", 1)[1] not in ("gate", "hooks"))
# funcamp's dynamo marks still act once dynamo is there: a module policy's glob match (a
# constant of the trace, see funcamp/policy/modules.py) compiles with no graph break
policy = funcamp.get_policy("mixed_bfloat16").with_module_policies({"0": "float32"})
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
f = funcamp.amp(lambda x: model(x), policy)
out = torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2, 4))
from torch._dynamo.variables.user_defined import UserDefinedClassVariable
print(json.dumps({
    "loaded": loaded, "patch_modules": patch_modules, "seconds": seconds,
    "equal": torch.equal(out, f(torch.ones(2, 4))),
    "dynamo_patched_by_amp": hasattr(UserDefinedClassVariable._call_cross_entropy_loss,
                                     "__wrapped__"),
}))
"""


def test_import_funcamp_imports_no_compiler_module_and_patches_nothing():
    """``import funcamp`` imports neither dynamo nor any inductor module (nor any of funcamp's
    patch modules); funcamp's marks for dynamo still act when a compile comes later. The one
    dynamo patch, the cross-entropy routing, is installed when :func:`funcamp.amp` first wraps
    a function (where this torch's dynamo has the special case it routes)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["loaded"] == [] and seen["patch_modules"] == []
    assert seen["equal"] is True
    funcamp.amp(lambda x: x, "float32")  # installs the routing in this process
    assert seen["dynamo_patched_by_amp"] is cross_entropy.installed()


def test_funcamps_constant_mark_is_what_dynamos_decorator_sets():
    """:func:`funcamp._core.context.constant_result` sets dynamo's mark itself on the releases of
    ``MARK_RELEASES`` (so that ``import funcamp`` need not import dynamo): there, torch's own
    ``assume_constant_result`` must do exactly that and nothing else."""

    def fn():
        return 1

    def ours():
        return 1

    assert context.constant_result(ours) is ours
    if torch_release() not in context.MARK_RELEASES:
        pytest.skip(f"torch {torch_release()}: funcamp calls torch's decorator itself")
    assert torch.compiler.assume_constant_result(fn) is fn
    assert vars(fn) == vars(ours) == {"_dynamo_marked_constant": True}


# -- the gate ------------------------------------------------------------------------------------


def test_auto_is_on_only_on_the_allowlist_and_says_once_elsewhere(monkeypatch, caplog):
    monkeypatch.setattr(gate, "ALLOWLIST", frozenset({(gate.torch_release(), "cpu")}))
    monkeypatch.setattr(gate, "_SAID", set())

    def on(*args):
        return patches_for(*args).on

    assert on("auto", "cpu", {}) is True
    with caplog.at_level(logging.INFO, logger="funcamp"):
        assert on("auto", "cuda", {}) is False
        assert on("auto", "cuda", {}) is False
    assert caplog.text.count("compiler patches off") == 1
    assert on(True, "cuda", {}) is True  # an explicit choice wins
    assert on(False, "cpu", {}) is False
    assert on(True, "cpu", {"backend": "aot_eager"}) is False  # no inductor, no patch
    monkeypatch.setattr(gate, "ALLOWLIST", frozenset())  # another torch release
    assert on("auto", "cpu", {}) is False
    with gate.compiler_patches(True):
        assert on("auto", "cpu", {}) is True
        assert on(False, "cpu", {}) is False


def test_the_choice_is_checked():
    with pytest.raises(TypeError, match="compiler_patches"):
        funcamp.make_train_step(lambda p, b, x: x.sum(), funcamp.sgd(0.1), "float32",
                                compile=funcamp.Compile(compiler_patches="yes"))  # fmt: skip
    with pytest.raises(TypeError, match="compiler_patches"):
        funcamp.make_eval_step(
            lambda p, b, x: x.sum(), "float32", compile=funcamp.Compile(compiler_patches=1)
        )


def test_a_step_off_the_allowlist_gets_none_of_the_inductor_options(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    monkeypatch.setattr(gate, "ALLOWLIST", frozenset())
    for choice in ("auto", False, True):
        state = funcamp.TrainState.create({"w": torch.ones(2)}, funcamp.sgd(0.1), "float32")
        step = funcamp.make_train_step(
            lambda p, b, x: (x @ p["w"]).sum(), funcamp.sgd(0.1), "float32",
            compile=funcamp.Compile(compiler_patches=choice),
        )  # fmt: skip
        step(state, torch.ones(3, 2))
    keyed = ["post_grad_custom_pre_pass" in (kw["options"] or {}) for kw in calls]
    passes = ["post_grad_custom_post_pass" in (kw["options"] or {}) for kw in calls]
    assert keyed == [False, False, True] and passes == [False, False, True]


# -- dead_stores: nested sequences ----------------------------------------------------------------


def _lazy():
    """A lazily computed inductor value (a pointwise TensorBox, not stored)."""
    ir = torch._inductor.ir
    loops = ir.Pointwise(device=torch.device("cpu"), dtype=torch.float32,
                         inner_fn=lambda index: None, ranges=[4])  # fmt: skip
    return ir.TensorBox.create(loops)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_a_value_held_at_any_depth_of_a_live_node_stays_a_reader(depth):
    """inductor registers readers found at any depth of a node's value (``register_users_of``
    recurses); a reader held two levels deep was judged dead, dropped, and read after the write
    (a wrong result, no error). Failed for depth >= 2 with ``_live_ids`` flattening one level."""
    value = _lazy()
    held = value
    for _ in range(depth):
        held = [held] if depth % 2 else (held,)
    graph = types.SimpleNamespace(name_to_users={"buf0": [value]}, env={"node": held})
    dead_stores.drop_dead_readers(graph, "buf0")
    assert graph.name_to_users["buf0"] == [value]
    freed = types.SimpleNamespace(name_to_users={"buf0": [value]}, env={})
    dead_stores.drop_dead_readers(freed, "buf0")  # nothing holds it: dead, dropped
    assert freed.name_to_users["buf0"] == []


# -- the cache key -------------------------------------------------------------------------------


def _compile_and_count(fn, patched, env):
    """Compile ``fn`` the way a funcamp step is compiled (options and the running block), with
    the environment ``env``; ``(fxgraph cache hits, misses, outputs)`` of that compile."""
    torch._dynamo.reset()
    hits, misses = (
        counters["inductor"]["fxgraph_cache_hit"],
        counters["inductor"]["fxgraph_cache_miss"],
    )
    args = _inputs()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with hooks.running(patched):
            out = compile_fn(fn, {}, "cpu", patches=patched)(*args)
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    new = counters["inductor"]
    return new["fxgraph_cache_hit"] - hits, new["fxgraph_cache_miss"] - misses, (out, args)


def test_the_patches_state_is_part_of_inductors_cache_key():
    """A graph cached while dead_stores was on is not loaded with it off (FUNCAMP_DEAD_STORES=0)
    nor with the patches off, and is loaded again with it on: the same bits each way. Without
    :class:`~funcamp.compiler.keys.PatchKey` the second compile was a cache hit."""
    fn = _fresh(_update)
    with fresh_cache():  # inductor's default caches: FX graphs and AOTAutograd's
        first = _compile_and_count(fn, True, {"FUNCAMP_DEAD_STORES": "1"})
        env_off = _compile_and_count(fn, True, {"FUNCAMP_DEAD_STORES": "0"})
        patches_off = _compile_and_count(fn, False, {})
        again = _compile_and_count(fn, True, {"FUNCAMP_DEAD_STORES": "1"})
    torch._dynamo.reset()
    assert first[:2] == (0, 1)
    assert env_off[:2] == (0, 1)
    assert patches_off[:2] == (0, 1)
    assert again[:2] == (1, 0)
    for other in (env_off, patches_off, again):
        for a, b in zip(torch.utils._pytree.tree_leaves(first[2]),
                        torch.utils._pytree.tree_leaves(other[2])):  # fmt: skip
            assert torch.equal(a, b)


# -- scope: funcamp's compiles only, whatever the thread ----------------------------------------


def test_a_compile_outside_funcamps_is_left_to_torch_in_any_thread():
    """While a funcamp compile runs with the patches on in one thread, a plain torch.compile of
    another function in another thread (and later in the same thread) runs torch's code: the
    patches' own code paths ran only in the funcamp thread. The same bits on both sides."""
    funcamp_fn, user_fn, later_fn = _fresh(_update), _fresh(_update), _fresh(_update)
    results: dict[str, object] = {}
    started = threading.Event()

    def funcamp_compile():
        with fresh_inductor(), hooks.running(True):
            started.set()
            results["funcamp"] = (
                threading.get_ident(),
                compile_fn(funcamp_fn, {}, "cpu", patches=True)(*_inputs()),
            )

    def user_compile():
        started.wait(60)
        with fresh_inductor():
            results["user"] = (threading.get_ident(), torch.compile(user_fn)(*_inputs()))

    switch.ACTED.clear()
    torch._dynamo.reset()
    threads = [threading.Thread(target=funcamp_compile), threading.Thread(target=user_compile)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    with fresh_inductor():
        later = torch.compile(later_fn)(*_inputs())
    torch._dynamo.reset()
    acted = list(switch.ACTED)
    funcamp_thread, funcamp_out = results["funcamp"]
    user_thread, user_out = results["user"]
    assert {name for name, _ in acted} == {"cpp_bundle", "dead_stores"}
    assert {thread for _, thread in acted} == {funcamp_thread} != {user_thread}
    assert torch.equal(funcamp_out, user_out) and torch.equal(user_out, later)


class _Float64Losses(torch.overrides.TorchFunctionMode):
    """A user's own mode: cross-entropy in float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.cross_entropy:
            args = (args[0].double(), *args[1:])
        return func(*args, **kwargs)


def _ce_under_user_mode(x, y):
    with _Float64Losses():
        return nn.CrossEntropyLoss()(x, y)


def test_the_cross_entropy_routing_is_for_funcamps_amp_mode_only():
    """A torch function mode of the user's own keeps dynamo's fast path for an in-graph
    CrossEntropyLoss (the mode does not see it, as without funcamp); funcamp's amp mode gets
    it (the float32 loss eager amp computes)."""
    funcamp.amp(lambda x: x, "float32")  # installs the routing
    if not cross_entropy.installed():
        pytest.skip(
            f"torch {torch_release()}'s dynamo has no CrossEntropyLoss special case to route"
        )
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    assert _ce_under_user_mode(x, y).dtype == torch.float64  # eager: the mode sees the call
    with funcamp.compiler.compiler_patches(True):
        torch._dynamo.reset()
        out = torch.compile(_ce_under_user_mode, backend="eager", fullgraph=True)(x, y)
    assert out.dtype == torch.float32  # dynamo's own trace, untouched by funcamp
    amp_loss = funcamp.amp(lambda a, b: nn.CrossEntropyLoss()(a @ a.T, b), "mixed_bfloat16")
    x = torch.randn(4, 4)
    eager = amp_loss(x, y)
    with funcamp.compiler.compiler_patches(False):
        torch._dynamo.reset()
        unrouted = torch.compile(amp_loss, backend="eager", fullgraph=True)(x, y)
    with funcamp.compiler.compiler_patches(True):
        torch._dynamo.reset()
        routed = torch.compile(amp_loss, backend="eager", fullgraph=True)(x, y)
    torch._dynamo.reset()
    assert torch.equal(routed, eager)
    assert not torch.equal(unrouted, eager)  # off: dynamo's fast path (a bf16 loss)


def test_by_default_the_routing_follows_the_allowlist_for_the_traced_tensors_device(
    monkeypatch, caplog
):
    """``"auto"``: routed only where the device of the tensors the compiled function was called
    with is on the allowlist with this release (here: a step's batch in a dict, and a module's
    parameters); elsewhere dynamo's own trace, said once."""
    funcamp.amp(lambda x: x, "float32")  # installs the routing
    if not cross_entropy.installed():
        pytest.skip(
            f"torch {torch_release()}'s dynamo has no CrossEntropyLoss special case to route"
        )
    model = nn.Linear(4, 3)
    loss = funcamp.amp(lambda m, b: nn.CrossEntropyLoss()(m(b["x"]), b["y"]), "mixed_bfloat16")
    batch = {"x": torch.randn(5, 4), "y": torch.tensor([0, 1, 2, 0, 1])}
    eager = loss(model, batch)

    def compiled(allowlist):
        monkeypatch.setattr(gate, "ALLOWLIST", frozenset(allowlist))
        monkeypatch.setattr(gate, "_SAID", set())
        torch._dynamo.reset()
        with caplog.at_level(logging.INFO, logger="funcamp"):
            return torch.compile(loss, backend="eager", fullgraph=True)(model, batch)

    assert torch.equal(compiled({(torch_release(), "cpu")}), eager)
    caplog.clear()
    assert not torch.equal(compiled({(torch_release(), "cuda")}), eager)
    assert caplog.text.count("compiler patches off for torch") == 1
    assert not torch.equal(compiled({("0.0", "cpu")}), eager)  # another release
    torch._dynamo.reset()
    assert cross_entropy.trace_devices(None) == frozenset()


# -- layouts: a tensor a fixed-stride custom op reads stays as traced ---------------------------


@torch.library.custom_op(
    "funcamp_test::strides_of", mutates_args=(), tags=(torch._C.Tag.needs_fixed_stride_order,)
)
def _strides_of(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor(x.stride(), dtype=torch.float32)


@_strides_of.register_fake
def _(x):
    return x.new_empty(x.dim(), dtype=torch.float32)


def _conv_and_backward(w1, w2, x, grad_y):
    h = torch.relu(nn.functional.conv2d(x, w1, padding=1))  # read by conv 2 and its backward
    y = nn.functional.conv2d(h, w2, padding=1)
    _, grad_w2, _ = torch.ops.aten.convolution_backward(
        grad_y, h, w2, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False]
    )
    return y.sum(), grad_w2, _strides_of(h)


def test_the_channels_last_pass_leaves_what_a_fixed_stride_op_reads():
    """The activation both convolutions read is also read by a custom op of fixed stride order:
    inductor hands it the tensor in its traced strides, which the pass would have changed (the
    op saw channels-last strides (800, 1, 80, 8) instead of eager's (800, 100, 10, 1))."""
    torch.manual_seed(0)
    args = (torch.randn(8, 3, 3, 3), torch.randn(8, 8, 3, 3), torch.randn(2, 3, 10, 10),
            torch.randn(2, 8, 10, 10))  # fmt: skip
    want = _conv_and_backward(*args)
    torch._dynamo.reset()
    options = {"post_grad_custom_post_pass": layouts.ChannelsLastConvBackward()}
    got = torch.compile(_conv_and_backward, fullgraph=True, options=options)(*args)
    torch._dynamo.reset()
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-4, atol=1e-4)


# -- cpp_bundle: installed once, whichever threads ask --------------------------------------------


class _SlowModule(types.ModuleType):
    """``torch._inductor.async_compile`` whose attributes take a while to read: the window in
    which a second thread, unlocked, installed the patch a second time."""

    def __init__(self, inner):
        super().__init__(inner.__name__)
        self._inner = inner

    def __getattr__(self, name):
        time.sleep(0.05)
        return getattr(self._inner, name)


def test_two_threads_entering_bundling_at_once_install_it_once(monkeypatch):
    cls = torch._inductor.async_compile.AsyncCompile
    wrapper = torch._inductor.codegen.wrapper.PythonWrapperCodegen
    original = getattr(cls.cpp_pybinding, "__wrapped__", cls.cpp_pybinding)
    define = getattr(wrapper.define_kernel, "__wrapped__", wrapper.define_kernel)
    monkeypatch.setattr(cls, "cpp_pybinding", original)  # as torch has it (restored after)
    monkeypatch.setattr(wrapper, "define_kernel", define)
    monkeypatch.setattr(cpp_bundle, "_ORIGINAL", None)
    monkeypatch.setattr(switch, "_INSTALLED", set())
    monkeypatch.setattr(cpp_bundle, "_async_compile", _SlowModule(cpp_bundle._async_compile))
    barrier = threading.Barrier(4)

    def enter():
        barrier.wait()
        with cpp_bundle.bundling(True):
            pass

    threads = [threading.Thread(target=enter) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert cls.cpp_pybinding.__wrapped__ is original  # one layer of funcamp, over torch's own
    assert wrapper.define_kernel.__wrapped__ is define
