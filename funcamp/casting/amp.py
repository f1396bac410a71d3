"""``amp`` and ``full_precision``: per-op casting as a pure function transform.

The transform enters a :class:`torch.overrides.TorchFunctionMode` for the duration of the wrapped
call. It leaves it on exit (also on error), so no global state survives the call. The mode looks
each torch call up in the policy's dispatch table (callable -> rule). It casts the floating inputs
as the rule says and runs the op with the mode off. Python composites such as
``F.multi_head_attention_forward`` are re-entered with the mode on, so the torch calls they make
inside are seen too. So are the Python copies of C++ composites (``einsum``, ``cov``,
``linalg.pinv`` ...). The ops inside them are thus cast as torch.autocast casts them (see
``funcamp/casting/reentry.py`` and ``funcamp/casting/cpp_composites.py``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

import torch
import torch.utils.checkpoint
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode

from funcamp._core.context import (
    compiling,
    dual_level_active,
    in_transform,
    marking_inputs,
    transform_while_tracing,
)
from funcamp.casting.entry import cast_at_entry
from funcamp.casting.fp8_matmul import FP8_OPS, Fp8Fallback, prepare_trace, run_fp8
from funcamp.casting.reentry import COMPOSITES as _COMPOSITES  # noqa: F401 (tests re-enter)
from funcamp.casting.reentry import backward_entries, reentered
from funcamp.casting.transforms import BIAS_PRODUCTS, cast_with_tangent, vmapped_bias_product
from funcamp.compiler.hooks import route_cross_entropy
from funcamp.policy.modules import glob_match
from funcamp.policy.ops import DTYPE_ARG_OPS, OpPolicy, OpRule, name_index, op_name
from funcamp.policy.policy import Policy, as_policy, cast_floating

__all__ = ["amp", "amp_keeping", "full_precision", "recompute_under"]

F = TypeVar("F", bound=Callable[..., Any])

_FLOAT64 = torch.float64
_FLOAT32 = torch.float32


class _Context(NamedTuple):
    """What the mode applies right now: the innermost policy in force.

    Built eagerly (when ``amp`` wraps a function), never while dynamo traces.
    """

    policy: Policy
    compute_dtype: torch.dtype
    output_dtype: torch.dtype
    table: dict[Any, tuple[OpRule, str]]  # __name__ (or a user's callable) -> (rule, op)
    by_identity: bool  # whether the table also holds callables (ops funcamp knows no name of)
    modules: tuple[tuple[Any, _Context], ...]
    composites: dict[tuple[str, str], Any]  # the Python composites to re-enter under this table


@functools.lru_cache(maxsize=128)
def mode_context(policy: Policy) -> _Context:
    if policy.fp8 is not None:
        prepare_trace()
    table: dict[Any, tuple[OpRule, str]] = {}
    for key, rule in policy.ops.dispatch_table().items():
        if rule is not OpRule.NONE:
            name = key if isinstance(key, str) else (op_name(key) or _qualname(key))
            table[key] = (rule, _NAME_TO_OP.get(name, name) if isinstance(key, str) else name)
    modules = tuple((key, mode_context(sub)) for key, sub in policy.module_policies)
    by_identity = any(not isinstance(k, str) for k in table)
    composites = reentered(table)
    return _Context(
        policy, policy.compute_dtype, policy.output_dtype, table, by_identity, modules, composites
    )


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


# __name__ of an entry point -> canonical op name (e.g. "__rmatmul__" -> "matmul")
_NAME_TO_OP = {getattr(fn, "__name__", ""): name for fn, name in name_index().items()}


# -- casting ------------------------------------------------------------------------------------
def _cast(x: Any, dtype: torch.dtype) -> Any:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype is not dtype and x.dtype is not _FLOAT64:
            return x.to(dtype)
        return x
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], torch.Tensor):
        return type(x)(_cast(e, dtype) for e in x)
    return x


def _promote(dtype: torch.dtype, x: Any) -> torch.dtype:
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype is not _FLOAT64:
            return torch.promote_types(dtype, x.dtype)
        return dtype
    if isinstance(x, (list, tuple)):
        for e in x:
            dtype = _promote(dtype, e)
    return dtype


def _has_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("dtype") is not None:
        return True
    return any(isinstance(a, torch.dtype) for a in args)


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype is not _FLOAT64


def cast_args(
    rule: OpRule,
    name: str,
    compute_dtype: torch.dtype,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Apply ``rule`` to the arguments of the op ``name`` (the mode's casting step)."""
    if rule is OpRule.COMPUTE:
        dtype = compute_dtype
    elif rule is OpRule.FLOAT32:
        if name in DTYPE_ARG_OPS:
            if args and _eligible(args[0]) and not _has_dtype(args, kwargs):
                kwargs = {**kwargs, "dtype": _FLOAT32}
            return args, kwargs
        dtype = _FLOAT32
    elif rule is OpRule.PROMOTE:
        dtype = compute_dtype
        for a in args:
            dtype = _promote(dtype, a)
        for v in kwargs.values():
            dtype = _promote(dtype, v)
    else:
        return args, kwargs
    cast = cast_with_tangent if dual_level_active() else _cast
    args = tuple([cast(a, dtype) for a in args])
    if kwargs:
        kwargs = {k: cast(v, dtype) for k, v in kwargs.items()}
    return args, kwargs


# -- module policies ----------------------------------------------------------------------------
_GLOBAL_PRE_HOOKS = _nn_module._global_forward_pre_hooks
_GLOBAL_HOOKS = _nn_module._global_forward_hooks
_GLOBAL_HOOKS_ALWAYS_CALLED = _nn_module._global_forward_hooks_always_called


class _ModuleFrame(NamedTuple):
    path: str
    ctx: _Context | None  # the module policy that matched, or None
    fp8: bool = False  # whether this module's linear and addmm calls run in FP8


class _ModuleTracker:
    """Global module hooks, registered only for the duration of one ``amp`` call."""

    def __init__(self, mode: _AmpMode, rules: tuple[tuple[Any, _Context], ...]) -> None:
        self.mode = mode
        self.rules = rules
        self.frames: list[_ModuleFrame] = []
        self.paths: dict[int, str] = {}

    def __enter__(self) -> _ModuleTracker:
        # Written into torch's global hook dicts directly, keyed by this tracker, instead of
        # through ``register_module_forward_(pre_)hook``: their ``RemovableHandle`` bumps a
        # class-level id counter, which dynamo cannot trace (a graph break, so
        # ``torch.compile(fullgraph=True)`` of an amp call with module policies failed). Dict
        # insertions and deletions trace fine, and the hooks then apply inside the same graph.
        _GLOBAL_PRE_HOOKS[self] = self._pre
        _GLOBAL_HOOKS[self] = self._post
        _GLOBAL_HOOKS_ALWAYS_CALLED[self] = True
        return self

    def __exit__(self, *exc: Any) -> None:
        _GLOBAL_PRE_HOOKS.pop(self, None)
        _GLOBAL_HOOKS.pop(self, None)
        _GLOBAL_HOOKS_ALWAYS_CALLED.pop(self, None)

    def _active(self) -> bool:
        # Global hooks fire for modules run in any thread and under any mode: act only for
        # modules run by this tracker's thread while its mode is the innermost one there.
        stack = _ACTIVE.stack
        return bool(stack) and stack[-1] is self.mode

    def _match(self, module: torch.nn.Module, path: str) -> _Context | None:
        found: _Context | None = None
        for key, policy in self.rules:  # globs win over classes; later entries win
            if isinstance(key, type) and isinstance(module, key) and found is None:
                found = policy
        for key, policy in self.rules:
            if isinstance(key, str) and glob_match(path, key):
                found = policy
        return found

    def _pre(self, module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
        if not self._active() or self.mode.dormant():
            return None
        if not self.frames:
            root = module
            if self.mode.recompute_only:  # a checkpointed block: paths from the forward's root
                root = (_ROOT.ref() if _ROOT.ref is not None else None) or module
            else:
                _ROOT.ref = weakref.ref(module)
            self.paths = {}
            for name, sub in root.named_modules(remove_duplicate=False):
                self.paths.setdefault(id(sub), name)
        path = self.paths.get(id(module), type(module).__name__)
        ctx = self._match(module, path)
        fp8 = self.mode.fp8 is not None and self.mode.fp8.matches(module, path)
        self.frames.append(_ModuleFrame(path, ctx, fp8))
        if ctx is None:
            return None
        self.mode.push(ctx)
        return cast_floating(args, ctx.compute_dtype)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not self.frames or not self._active() or self.mode.dormant():
            return None
        frame = self.frames.pop()
        if frame.ctx is None:
            return None
        self.mode.pop()
        return cast_floating(output, frame.ctx.output_dtype)

    @property
    def path(self) -> str | None:
        return self.frames[-1].path if self.frames else None

    @property
    def fp8_site(self) -> str | None:
        """The innermost module's path when its linear and addmm calls run in FP8."""
        return self.frames[-1].path if self.frames and self.frames[-1].fp8 else None


# -- the mode -------------------------------------------------------------------------------------
class _AmpMode(TorchFunctionMode):
    def __init__(self, ctx: _Context, recorder: Any = None, recompute_only: bool = False) -> None:
        super().__init__()
        self.recompute_only = recompute_only  # see recompute_under
        self.ctx = ctx
        self.saved: list[_Context] = []
        self.recorder = recorder
        self.tracker: _ModuleTracker | None = None
        self.fp8 = ctx.policy.fp8  # the FP8 linears of the policy given to amp (or None)

    def push(self, ctx: _Context) -> None:
        self.saved.append(self.ctx)
        self.ctx = ctx

    def pop(self) -> None:
        self.ctx = self.saved.pop()

    def dormant(self) -> bool:
        """In a backward pass (:func:`recompute_under`), the mode casts only what runs with
        grad mode on: a checkpointed region the backward recomputes. The backward's own
        Python code (an autograd function's ``backward``, a hook) runs with grad mode off, as
        it runs outside torch.autocast. An ``amp`` call inside the block (a forward pass run
        there) has a mode of its own, and this one stands aside meanwhile."""
        if not self.recompute_only:
            return False
        stack = _ACTIVE.stack  # an amp call inside the block (a forward pass) has its own mode
        return not torch.is_grad_enabled() or (bool(stack) and stack[-1] is not self)

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.recompute_only:
            unchecked = _BACKWARD_ENTRIES.get(func)
            if unchecked is not None:  # a backward run from inside: it keeps the mode on
                with self:
                    return unchecked(*args, **kwargs)
            if self.dormant():
                return func(*args, **kwargs)
        if func is _REQUIRES_GRAD_ and _asks_grad(args, kwargs) and _foreign_mark():
            # transformers' enable_input_require_grads (gradient_checkpointing_enable) marks
            # the embeddings' output, for torch.autograd to reach a reentrant checkpoint behind
            # frozen embeddings. Under torch.func every value is tracked already; it refuses
            # the call, which here means nothing: the tensor as it is. torch.func's own marks
            # of its inputs (grad, vjp, jacrev when amp wraps the transform) run as they are.
            return args[0]
        ctx = self.ctx
        name = getattr(func, "__name__", None)
        if self.fp8 is not None and name in FP8_OPS and self.tracker is not None:
            site = self.tracker.fp8_site
            if site is not None:
                record = None
                if self.recorder is not None:
                    record = functools.partial(self.recorder.record_fp8, func, ctx, self)
                out = run_fp8(name, self.fp8, site, ctx.compute_dtype, args, kwargs, record)
                if not isinstance(out, Fp8Fallback):
                    return out
                if self.recorder is not None:
                    self.recorder.record_fp8_fallback(out)  # then the policy runs the call
        if func is _CHECKPOINT and args:
            return self._checkpoint(func, args, kwargs)
        entry = ctx.table.get(name)
        if entry is None and ctx.by_identity:
            entry = ctx.table.get(func)
        if entry is None or kwargs.get("out") is not None:  # out= calls are never cast
            composite = ctx.composites.get((getattr(func, "__module__", None), name))
            if composite is not None:
                with self:
                    out = composite(*args, **kwargs)
                if out is not NotImplemented:  # a copy declines inputs it does not reproduce
                    return out
            if (
                name is not None
                and getattr(func, "__module__", None) == "torch._tensor"
                and compiling()
                and args
                and type(args[0]) is torch.Tensor
                and getattr(torch.Tensor, name, None) is func
            ):
                # A Tensor method written in Python (split, norm, ...), called as the method:
                # called as the function, dynamo would put `torch._tensor.<name>` in the graph,
                # which AOTAutograd's cache refuses (a warm start would re-trace the whole step).
                out = getattr(args[0], name)(*args[1:], **kwargs)
            else:
                out = func(*args, **kwargs)
            if self.recorder is not None:
                self.recorder.record(func, None, ctx, args, kwargs, out, self)
            return out
        rule, name = entry
        if rule is OpRule.COMPUTE and name in BIAS_PRODUCTS:
            # Under vmap, as torch.autocast there: the product cast, the bias added in float32.
            out = vmapped_bias_product(name, ctx.compute_dtype, args, kwargs)
            if out is not None:
                if self.recorder is not None:
                    self.recorder.record(func, rule, ctx, args, kwargs, out, self)
                return out
        cargs, ckwargs = cast_args(rule, name, ctx.compute_dtype, args, kwargs)
        out = func(*cargs, **ckwargs)
        if self.recorder is not None:
            self.recorder.record(func, rule, ctx, cargs, ckwargs, out, self)
        return out

    def _checkpoint(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``torch.utils.checkpoint.checkpoint`` reaching the mode: only while dynamo traces
        (it dispatches the call to the active modes, and would run the checkpointed function
        with this mode off: its ops uncast). The function runs with the mode on again, as
        an eager checkpoint runs it, under the policy in force at the call (dynamo traces the
        body there and then; the body may not change the mode's state, which dynamo refuses
        inside a checkpoint as a side effect: module policies inside a checkpointed region
        are an error when compiled)."""
        fn = args[0]

        def under_policy(*a: Any, **k: Any) -> Any:
            with self:
                return fn(*a, **k)

        if kwargs.get("use_reentrant") is False and kwargs.get("context_fn") in (
            None,
            _NOOP_CONTEXT,
        ):
            # The graph recomputes the region in its backward part (AOTAutograd's remat pass
            # for a forward-loss-backward graph), which refuses a seeded op in the region
            # (attention, dropout: tagged nondeterministic_seeded); their outputs are saved
            # instead of recomputed: the same values, as eager replays the RNG state.
            kwargs = {**kwargs, "context_fn": _SAVE_SEEDED}
        return func(under_policy, *args[1:], **kwargs)


_CHECKPOINT = torch.utils.checkpoint.checkpoint
_REQUIRES_GRAD_ = torch.Tensor.requires_grad_


def _asks_grad(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``tensor.requires_grad_(...)``'s argument is True (its default)."""
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    return flag is True


def _foreign_mark() -> bool:
    """A ``requires_grad_()`` call inside a torch.func transform that torch.func does not make
    itself (:func:`marking_inputs`): one torch.func would refuse."""
    transformed = transform_while_tracing() if compiling() else in_transform()
    return transformed and not marking_inputs()


_NOOP_CONTEXT = torch.utils.checkpoint.noop_context_fn


def _save_seeded(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing's policy for a compiled region: recompute all but seeded ops."""
    seeded = torch.Tag.nondeterministic_seeded in getattr(op, "tags", ())
    policy = torch.utils.checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if seeded else policy.PREFER_RECOMPUTE


_SAVE_SEEDED = functools.partial(
    torch.utils.checkpoint.create_selective_checkpoint_contexts, _save_seeded
)
_BACKWARD_ENTRIES = backward_entries()


class _Root(threading.local):
    def __init__(self) -> None:
        self.ref: weakref.ref[torch.nn.Module] | None = None


_ROOT = _Root()  # the root module of this thread's latest amp forward (for its module paths)
_FULL_PRECISION = mode_context(Policy(ops=OpPolicy.none()))


class _ActiveModes(threading.local):
    def __init__(self) -> None:
        self.stack: list[_AmpMode] = []


_ACTIVE = _ActiveModes()


def run_in_mode(
    ctx: _Context, fn: Callable[..., Any], args: Any, kwargs: Any, recorder: Any = None
) -> Any:
    """Run ``fn`` with ``ctx`` in force: in a new mode, or as a scope of the active one."""
    stack = _ACTIVE.stack
    if stack and recorder is None and not stack[-1].recompute_only:
        mode = stack[-1]
        mode.push(ctx)
        try:
            return fn(*args, **kwargs)
        finally:
            mode.pop()
    mode = _AmpMode(ctx, recorder)
    stack.append(mode)
    try:
        with mode:
            rules = ctx.modules
            if rules or recorder is not None or mode.fp8 is not None:
                mode.tracker = _ModuleTracker(mode, rules)
                with mode.tracker:
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
    finally:
        stack.pop()


@contextlib.contextmanager
def recompute_under(policy: Policy | str) -> Iterator[None]:
    """Run a backward pass in which activation-checkpointed regions are recomputed under
    ``policy``, as in their forward pass.

    ``torch.utils.checkpoint`` (reentrant or not) re-runs a checkpointed function in the backward
    pass. It re-enters the torch.autocast state the function had in the forward. An ``amp`` call
    has returned by then, so without this its ops would run uncast. (A non-reentrant checkpoint
    then refuses the recomputed values: ``CheckpointError: ... different metadata``.)

    While the block runs, the recomputation (what runs with grad mode on) is cast by ``policy``,
    module policies included. Everything else in the backward pass runs as it does outside
    torch.autocast (the backward of an autograd function, a hook). The recomputed values equal the
    forward's bit for bit. So the gradients are those of the same model without checkpointing.
    :func:`funcamp.make_train_step` does this itself; wrap your own ``loss.backward()`` or
    ``torch.autograd.grad`` in it. Eager only: a compiled function recomputes inside its graph, so
    there is nothing to do there.

    Example:
        >>> import torch, funcamp
        >>> from torch.utils.checkpoint import checkpoint
        >>> lin = torch.nn.Linear(4, 4)
        >>> f = funcamp.amp(lambda x: checkpoint(lin, x, use_reentrant=False).sum(), "mixed_bfloat16")
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> with funcamp.recompute_under("mixed_bfloat16"):
        ...     f(x).backward()
        >>> x.grad.dtype, lin.weight.grad.shape
        (torch.float32, torch.Size([4, 4]))
    """
    if compiling():  # the graph recomputes (or keeps) what it needs: nothing to re-enter
        yield
        return
    ctx = mode_context(as_policy(policy, "recompute_under"))
    mode = _AmpMode(ctx, recompute_only=True)
    stack = _ACTIVE.stack
    stack.append(mode)
    try:
        with mode:
            if ctx.modules or mode.fp8 is not None:
                mode.tracker = _ModuleTracker(mode, ctx.modules)
                with mode.tracker:
                    yield
            else:
                yield
    finally:
        stack.pop()


def check_fn(fn: Any, api: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"funcamp.{api}: `fn` must be callable (the function to transform), got "
            f"{type(fn).__name__} {fn!r}"
        )


def amp(fn: F, policy: Policy | str) -> F:
    """Transform ``fn`` so that every torch op inside runs in the dtype ``policy`` says.

    Inside the call each torch op is cast by its :class:`OpRule`. With the default table, matmuls
    and convolutions go to the compute dtype, and reductions, norms and losses to float32. Every
    floating tensor ``fn`` returns is cast to ``policy.output_dtype``. That includes tensors in
    tuples, lists, dicts and other mappings, NamedTuples, dataclasses, and types registered with
    torch's pytree (Hugging Face's ``ModelOutput``). Other objects (a KV cache) pass through as
    they are. Inputs and params are not cast at entry (autocast semantics), unless the op table
    casts at entry (``ops=cast_at_entry``, FSDP2's and haiku's meaning): then every floating
    tensor argument goes to the compute dtype first. Either way gradients come back in the
    params' dtype.

    It works eagerly, under ``torch.func.grad/vjp/jvp/vmap/functional_call`` and inside
    ``torch.compile(fullgraph=True)``. Nothing stays active after the call returns or raises. It
    commutes with the torch.func transforms: ``grad(amp(f))`` and ``amp(grad(f))`` give the same
    result (and so for ``vjp``, ``jacrev``, ``hessian``, ``vmap`` ...).

    Args:
        fn: the function to transform.
        policy: a :class:`Policy` or a policy string for :func:`get_policy`.

    Returns:
        A function with ``fn``'s signature.

    Example:
        >>> import torch, funcamp
        >>> def f(x, w):
        ...     return torch.softmax(x @ w, dim=-1)
        >>> g = funcamp.amp(f, "params=float32,compute=bfloat16,output=bfloat16")
        >>> g(torch.randn(2, 3), torch.randn(3, 3)).dtype   # matmul in bf16, softmax in f32
        torch.bfloat16
        >>> w = torch.tensor([1.0, 2.0])
        >>> loss = lambda w: (w * w).sum()
        >>> funcamp.amp(torch.func.grad(loss), "float32")(w)   # either order
        tensor([2., 4.])
        >>> torch.func.grad(funcamp.amp(loss, "float32"))(w)
        tensor([2., 4.])
    """
    check_fn(fn, "amp")
    return amp_keeping(fn, as_policy(policy, "amp"))


def amp_keeping(fn: F, policy: Policy, keep: tuple[int, ...] = ()) -> F:
    """``amp(fn, policy)``, whose cast at entry (``ops=cast_at_entry``) leaves the positional
    arguments numbered in ``keep`` as they are: a train step's buffers, as FSDP2 leaves them."""
    ctx = mode_context(policy)
    # A CrossEntropyLoss built inside fn, once compiled, reaches the mode (funcamp.compiler).
    route_cross_entropy(_AmpMode)
    at_entry = policy.ops.casts_at_entry

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if at_entry:
            args, kwargs = cast_at_entry(policy, args, kwargs, keep)
        out = run_in_mode(ctx, fn, args, kwargs)
        return cast_floating(out, ctx.output_dtype)

    wrapped.policy = policy  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]


def full_precision(fn: F) -> F:
    """Run ``fn`` in float32 with casting suspended, also inside an ``amp``-wrapped function.

    Floating tensor inputs (float16/bfloat16) are cast to float32, and no op inside is cast.
    This is what ``torch.amp.custom_fwd(cast_inputs=torch.float32)`` and
    ``autocast(enabled=False)`` do. Float64 inputs pass through.

    Example:
        >>> import torch, funcamp
        >>> def f(x, w):
        ...     return funcamp.full_precision(torch.matmul)(x, w)
        >>> funcamp.amp(f, "mixed_bfloat16")(torch.randn(2, 2), torch.randn(2, 2)).dtype
        torch.float32
    """
    check_fn(fn, "full_precision")

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_floating((args, kwargs), _FLOAT32)
        if not _ACTIVE.stack:
            return fn(*args, **kwargs)
        return run_in_mode(_FULL_PRECISION, fn, args, kwargs)

    return wrapped  # type: ignore[return-value]
