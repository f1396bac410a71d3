"""Execution paths: how an optimizer's algorithm runs, chosen in one place.

An algorithm (see :func:`funcamp.optim.elementwise`) is written once against an :class:`Ops`
object: leaf-wise arithmetic on lists of tensors. Every op is the torch op torch.optim's
single-tensor step calls (``add(alpha=)``, ``lerp``, ``addcmul``, ``sqrt``, ...), so an eager
update gives torch.optim's numbers bit for bit. :func:`choose_ops` picks one of two paths for the
whole update, from all of its input tensors:

``"eager"``: :class:`EagerOps`
    Plain eager tensors on CPU/CUDA that autograd does not track, outside ``torch.compile`` and
    ``torch.func`` transforms. Arithmetic runs as torch's ``_foreach_*`` kernels (on the CPU
    they run the single-tensor kernel leaf by leaf: the same bits). An op given ``into=xs``
    writes its result into ``xs`` when this update owns ``xs`` (a temporary it made, or grads
    its caller donated).

``"traced"``: :class:`TracedOps`
    Everything else (``torch.compile``, ``vmap``/``grad``, autograd through the update, tensor
    subclasses, other devices). The same torch ops, leaf by leaf, never in place. Run as
    kernels they give the eager path's bits; compiled, they are what inductor makes of them,
    as for ``torch.compile`` of torch.optim's step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from funcamp._core.context import plain_eager_tensors
from funcamp._core.donation import writing
from funcamp._core.numerics import as_dtype, f32, hoist_scalar, math_dtype, spread
from funcamp.optim._base import SkipWrites

__all__ = ["EagerOps", "Ops", "TracedOps", "choose_ops"]

Tensors = list[torch.Tensor]
#: A scalar operand: a Python float (rounded to float32 first, as torch's kernels round a scalar),
#: a 0-d tensor, or one tensor per leaf.
Scalar = Any


def _scalar(y: Scalar) -> Scalar:
    return f32(y) if isinstance(y, float) else y


def _python_float(op: str, name: str, value: Any) -> float:
    """``value`` as a Python float rounded to float32; a tensor is refused (reading it would be
    a host sync, and under compile a graph break)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"funcamp.optim.Ops.{op}: `{name}` must be a Python float, got "
            f"{type(value).__name__}; for a tensor factor use ops.fma / ops.mul"
        )
    return f32(float(value))


def _fits(o: torch.Tensor, operands: Sequence[Any]) -> bool:
    """Whether ``o`` can receive the elementwise result of ``operands`` (tensors or Python
    scalars) with nothing cast or broadcast into it: each tensor has ``o``'s dtype and shape, or
    is a 0-d floating tensor (a step scalar, which does not promote a dimensioned result)."""
    if not o.is_floating_point():
        return False
    anchored = False  # an operand of o's own dtype and shape: the result's
    for t in operands:
        if not isinstance(t, torch.Tensor):
            if isinstance(t, complex):
                return False
            continue
        if t.dtype == o.dtype and t.shape == o.shape:
            anchored = True
        elif not (t.dim() == 0 and o.dim() > 0 and t.is_floating_point()):
            return False
    return anchored


def _step_scalar(y: Any) -> bool:
    """A Python real number, or a 0-d floating tensor: beside a dimensioned leaf neither
    changes the result's dtype or shape."""
    if isinstance(y, torch.Tensor):
        return y.dim() == 0 and y.is_floating_point()
    return isinstance(y, (int, float))


def _addcmul(z: torch.Tensor, x: torch.Tensor, y: torch.Tensor, value: float, out: Any) -> Any:
    return torch.addcmul(z, x, y, value=value, out=out)  # value is keyword-only


def _pick(y: Scalar, i: int) -> Scalar:
    return y[i] if isinstance(y, (list, tuple)) else y


def _each(y: Scalar, n: int) -> Sequence[Scalar]:
    """``y`` leaf by leaf: its own list, or the one scalar for each of ``n`` leaves
    (:func:`~funcamp._core.numerics.spread`). Zipped with the leaves: dynamo traces
    ``enumerate`` in Python, ``zip`` and ``range`` natively."""
    return y if isinstance(y, (list, tuple)) else spread(y, n)


def _replace_items(xs: Tensors, replaces: Tensors | None) -> Tensors:
    """``replaces`` (a list) holding ``xs``'s tensors, or ``xs`` where nothing is replaced."""
    if replaces is None or replaces is xs:
        return xs
    if not isinstance(replaces, list) or len(replaces) != len(xs):
        raise TypeError(
            "funcamp.optim: `ops.kept(xs, replaces=buf)` takes the state buffer's list of "
            f"tensors, one per leaf of `xs` ({len(xs)}), got {type(replaces).__name__}"
        )
    replaces[:] = xs
    return replaces


class Ops:
    """Leaf-wise arithmetic on lists of tensors, as an optimizer's algorithm sees it.

    Scalars are Python floats (rounded to float32 first, as torch's kernels round a scalar
    operand), 0-d tensors or lists of tensors (one per leaf). ``into=xs`` says that ``xs`` is
    dead after this op: the eager path may write the result into it when it owns it. Results are
    new lists; never write into an input yourself.

    Example:
        >>> import torch, funcamp
        >>> from typing import NamedTuple
        >>> def step(ops, grads, params, buffers, lr, count):  # see funcamp.optim.elementwise
        ...     print(type(ops).__name__, ops.fma(grads, 0.5, grads))
        ...     return grads, {}
        >>> class State(NamedTuple):
        ...     count: torch.Tensor
        ...     low: tuple
        >>> opt = funcamp.optim.elementwise("demo", State, step, 0.1)
        >>> _ = opt.update({"w": torch.tensor([2.0])}, opt.init({"w": torch.zeros(1)}))
        EagerOps [tensor([3.])]
    """

    path = "?"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    # -- scalars
    def scalar(self, value: float | torch.Tensor) -> float | torch.Tensor:
        """A step scalar: a Python float rounded to float32, or a 0-d tensor moved to this
        update's device as float32 and computed once per compiled step."""
        if isinstance(value, torch.Tensor):
            return hoist_scalar(value.to(device=self.device, dtype=torch.float32))
        return f32(float(value))

    # -- interface (see the two paths)
    def to_math(self, xs: Tensors, like: Tensors | None = None) -> Tensors:
        """``xs`` in the math dtype (float32, float64 for float64 leaves): that of ``like``'s
        leaves when given (grads in their params' math dtype, as the state is)."""
        dtypes = [x.dtype for x in (xs if like is None else like)]
        return [as_dtype(x, math_dtype(d)) for x, d in zip(xs, dtypes)]

    def target(self, *candidates: Tensors | None) -> Tensors | None:
        """The first of ``candidates`` this update may write into (for ``into=``), or None.

        Donated buffers and params come first where the step is known to apply: they are
        then written in place, as torch.optim writes them. The traced path writes nothing.
        """
        return None

    def kept(self, xs: Tensors, replaces: Tensors | None = None) -> Tensors:
        """Mark ``xs`` as kept (it goes into the new state): never written into afterwards.

        ``replaces`` is the state buffer whose new value ``xs`` is. On a donated eager step the
        caller gave up its state (:class:`~funcamp.optim.Writes`' ``skip``). There the new values
        are written into that buffer at once through ``skip.write``, and the buffer is returned.
        A skipped step leaves it bit-identical. ``xs`` is then dead (free for ``into=``). Call it
        once nothing that can raise is left. Elsewhere ``xs`` is returned.

        On every path the list ``replaces`` holds the new values afterwards (its tensors are
        replaced, on a donated step written into): an algorithm that reads it again reads the
        same numbers everywhere, never the old buffer on one path and the new one on another.
        """
        return _replace_items(xs, replaces)

    def add(self, xs: Tensors, y: Scalar, into: Tensors | None = None) -> Tensors:
        return self._binary("add", xs, y, into)

    def sub(self, xs: Tensors, y: Scalar, into: Tensors | None = None) -> Tensors:
        return self._binary("sub", xs, y, into)

    def mul(self, xs: Tensors, y: Scalar, into: Tensors | None = None) -> Tensors:
        return self._binary("mul", xs, y, into)

    def div(self, xs: Tensors, y: Scalar, into: Tensors | None = None) -> Tensors:
        return self._binary("div", xs, y, into)

    def sign(self, xs: Tensors, into: Tensors | None = None) -> Tensors:
        raise NotImplementedError

    def maximum(self, xs: Tensors, ys: Tensors, into: Tensors | None = None) -> Tensors:
        """``torch.maximum(x, y)`` leaf by leaf (a NaN in either wins, as in torch).
        (torch.optim.Adam's ``torch.maximum(max_exp_avg_sq, exp_avg_sq)`` with ``amsgrad``.)"""
        raise NotImplementedError

    def sqrt(self, xs: Tensors, into: Tensors | None = None) -> Tensors:
        """``torch.sqrt(x)`` leaf by leaf (torch.optim's ``exp_avg_sq.sqrt()``)."""
        raise NotImplementedError

    def fma(self, xs: Tensors, y: Scalar, zs: Tensors, into: Tensors | None = None) -> Tensors:
        """``torch.add(z, x, alpha=y)`` leaf by leaf (``z.add_(x, alpha=y)`` in torch.optim).

        For a 0-d tensor ``y`` it is ``torch.addcmul(z, x, y)``: on the CPU both round once, and
        give the same bits for the same float32 value of ``y``.
        """
        raise NotImplementedError

    def lerp(
        self, xs: Tensors, ys: Tensors, weight: Scalar, into: Tensors | None = None
    ) -> Tensors:
        """``torch.lerp(x, y, weight)`` leaf by leaf (torch.optim.Adam's
        ``exp_avg.lerp_(grad, 1 - b1)``). ``weight`` is a Python float or a 0-d tensor."""
        raise NotImplementedError

    def addcmul(
        self, zs: Tensors, xs: Tensors, ys: Tensors, value: float, into: Tensors | None = None
    ) -> Tensors:
        """``torch.addcmul(z, x, y, value=value)`` leaf by leaf (torch.optim.Adam's
        ``exp_avg_sq.addcmul_(grad, grad, value=1 - b2)``). ``value`` is a Python float."""
        raise NotImplementedError

    def addcdiv(
        self, zs: Tensors, xs: Tensors, ys: Tensors, value: Scalar, into: Tensors | None = None
    ) -> Tensors:
        """``torch.addcdiv(z, x, y, value=value)`` leaf by leaf, that is ``z + (value * x) / y``
        with one rounding each (torch.optim.Adam's ``p.addcdiv_(exp_avg, denom,
        value=-step_size)``). ``value`` is a Python float or a 0-d tensor."""
        d = self.mul(xs, value)
        return self.add(zs, self.div(d, ys, into=d), into=into)

    def writable(self, xs: Tensors | None) -> bool:
        """Whether :meth:`target` would give ``xs`` (asked before computing into it, without
        marking the first write into a donated state)."""
        return False

    def where(self, cond: torch.Tensor, xs: Tensors, ys: Tensors) -> Tensors:
        """``torch.where(cond, x, y)`` leaf by leaf (``cond`` a 0-d bool tensor)."""
        return [torch.where(c, x, y) for c, x, y in zip(spread(cond, len(xs)), xs, ys)]

    def _binary(self, op: str, xs: Tensors, y: Scalar, into: Tensors | None) -> Tensors:
        raise NotImplementedError


class EagerOps(Ops):
    """The ``"eager"`` path: foreach kernels, torch's fused kernels, writes into owned lists."""

    path = "eager"

    def __init__(
        self,
        device: torch.device,
        owned: Iterable[torch.Tensor] = (),
        donated: Iterable[torch.Tensor] = (),
        skip: SkipWrites | None = None,
    ) -> None:
        super().__init__(device)
        # Weak references: temporaries die as soon as the algorithm drops them, and a dead
        # one's id reused by another tensor is not mistaken for it.
        self._owned: dict[int, weakref.ref[torch.Tensor]] = {}
        self._own(owned)
        # A donated state: its buffers receive their new values in `kept`, through the
        # step's skip (which keeps the old values where the step overflowed).
        self._donated = {id(x): x for x in donated} if skip is not None else {}
        self._skip = skip
        # Known on the host to apply (funcamp.scaling.skip.Skip.decided): the donated tensors
        # are written in place, as torch.optim writes them, with no select afterwards.
        self._in_place = skip is not None and bool(donated) and skip.decided is False
        self._marked = False
        if self._in_place:
            self._own(donated)

    def _own(self, xs: Iterable[torch.Tensor]) -> None:
        for x in xs:
            self._owned[id(x)] = weakref.ref(x)

    def _owns(self, xs: Tensors | None) -> bool:
        if not xs:
            return False
        for x in xs:
            ref = self._owned.get(id(x))
            if ref is None or ref() is not x:
                return False
        return True

    def _fresh(self, xs: Tensors) -> Tensors:
        self._own(xs)
        return xs

    def target(self, *candidates: Tensors | None) -> Tensors | None:
        for xs in candidates:
            if xs is not None and self._owns(xs):
                if not self._marked and id(xs[0]) in self._donated:
                    writing()  # the first write into a donated state (funcamp._core.donation)
                    self._marked = True
                return xs
        return None

    def to_math(self, xs: Tensors, like: Tensors | None = None) -> Tensors:
        out = super().to_math(xs, like)
        self._own(m for m, x in zip(out, xs) if m is not x)
        return out

    def kept(self, xs: Tensors, replaces: Tensors | None = None) -> Tensors:
        skip = self._skip
        if skip is not None and replaces is not None and self._commits(xs, replaces):
            writing()  # the first write into a donated state (funcamp._core.donation)
            skip.write(replaces, xs)
            for old in replaces:
                self._donated.pop(id(old))  # written once
            return replaces
        for x in xs:
            self._owned.pop(id(x), None)
        return _replace_items(xs, replaces)

    def _commits(self, xs: Tensors, replaces: Tensors) -> bool:
        """Whether ``xs`` goes into the donated buffers ``replaces`` now: every one of them
        donated and not yet written, each new leaf of its buffer's dtype and shape on its
        device, and no new leaf the buffer itself."""
        if len(xs) != len(replaces) or not self._donated:
            return False
        for new, old in zip(xs, replaces):
            if (
                self._donated.get(id(old)) is not old
                or new is old
                or new.dtype != old.dtype
                or new.shape != old.shape
                or new.device != old.device
            ):
                return False
        return True

    def _into(self, into: Tensors | None, *operands: Any) -> Tensors | None:
        """``into`` if this update owns it and each of its tensors can take its leaf's result
        with nothing cast (:func:`_fits`); else None: the result is a fresh tensor."""
        if into is None or not self._owns(into):
            return None
        # the common case in one comparison per list: lists of into's dtypes and shapes, and
        # Python numbers (a 0-d tensor scalar, a complex number: the leaf-by-leaf test)
        layout = [(o.dtype, o.shape) for o in into]
        lists = [op for op in operands if isinstance(op, (list, tuple))]
        if (
            lists
            and all(d.is_floating_point and shape for d, shape in layout)  # no 0-d leaf
            and all(isinstance(op, (list, tuple)) or _step_scalar(op) for op in operands)
            and all([(t.dtype, t.shape) for t in op] == layout for op in lists)
        ):
            return into
        n = len(into)
        each = [op if isinstance(op, (list, tuple)) else [op] * n for op in operands]
        for i in range(n):
            if not _fits(into[i], [operand[i] for operand in each]):
                return None
        return into

    def _foreach(
        self,
        op: str,
        lists: list[Tensors],
        scalar: Scalar,
        into: Tensors | None,
        one: Callable[..., torch.Tensor],
    ) -> Tensors:
        """torch's ``_foreach_<op>`` over ``lists`` and ``scalar``: in place when ``into`` is
        the first list and ours, leaf by leaf (``one(*leaves, scalar, out=o)``: the same
        kernel, no allocation) into another dead list of ours, else fresh."""
        outs = self._into(into, *lists, scalar)
        if outs is lists[0]:
            getattr(torch, f"_foreach_{op}_")(*lists, scalar)
            return outs
        if outs is not None:
            scalars = _each(scalar, len(outs))
            return [one(*leaves, y, out=o) for *leaves, y, o in zip(*lists, scalars, outs)]
        return self._fresh(list(getattr(torch, f"_foreach_{op}")(*lists, scalar)))

    def _binary(self, op: str, xs: Tensors, y: Scalar, into: Tensors | None) -> Tensors:
        return self._foreach(op, [xs], _scalar(y), into, getattr(torch, op))

    def sign(self, xs: Tensors, into: Tensors | None = None) -> Tensors:
        if into is xs and self._owns(xs):
            torch._foreach_sign_(xs)
            return xs
        return self._fresh(list(torch._foreach_sign(xs)))

    def maximum(self, xs: Tensors, ys: Tensors, into: Tensors | None = None) -> Tensors:
        outs = self._into(into, xs, ys)
        if outs is xs:
            torch._foreach_maximum_(xs, ys)
            return xs
        if outs is not None:
            return [torch.maximum(x, y, out=o) for x, y, o in zip(xs, ys, outs)]
        return self._fresh(list(torch._foreach_maximum(xs, ys)))

    def sqrt(self, xs: Tensors, into: Tensors | None = None) -> Tensors:
        outs = self._into(into, xs)
        if outs is xs:
            torch._foreach_sqrt_(xs)
            return xs
        if outs is not None:
            return [torch.sqrt(x, out=o) for x, o in zip(xs, outs)]
        return self._fresh(list(torch._foreach_sqrt(xs)))

    def fma(self, xs: Tensors, y: Scalar, zs: Tensors, into: Tensors | None = None) -> Tensors:
        y = _scalar(y)
        outs = self._into(into, xs, y, zs)
        results = []
        for i, (x, z) in enumerate(zip(xs, zs)):
            yi, o = _pick(y, i), (None if outs is None else outs[i])
            if isinstance(yi, torch.Tensor):
                r = torch.addcmul(z, x, yi) if o is None else torch.addcmul(z, x, yi, out=o)
            else:
                r = torch.add(z, x, alpha=yi) if o is None else torch.add(z, x, alpha=yi, out=o)
            results.append(r)
        return results if outs is not None else self._fresh(results)

    def lerp(
        self, xs: Tensors, ys: Tensors, weight: Scalar, into: Tensors | None = None
    ) -> Tensors:
        if isinstance(weight, torch.Tensor):  # a 0-d tensor weight: torch's tensor kernel
            outs = self._into(into, xs, ys, weight)
            if outs is None:
                return self._fresh([torch.lerp(x, y, weight) for x, y in zip(xs, ys)])
            return [torch.lerp(x, y, weight, out=o) for x, y, o in zip(xs, ys, outs)]
        w = _python_float("lerp", "weight", weight)
        return self._foreach("lerp", [xs, ys], w, into, torch.lerp)

    def addcmul(
        self, zs: Tensors, xs: Tensors, ys: Tensors, value: float, into: Tensors | None = None
    ) -> Tensors:
        v = _python_float("addcmul", "value", value)
        return self._foreach("addcmul", [zs, xs, ys], v, into, _addcmul)

    def addcdiv(
        self, zs: Tensors, xs: Tensors, ys: Tensors, value: Scalar, into: Tensors | None = None
    ) -> Tensors:
        # In place on the CPU: torch's own kernel, with no temporary (a 0-d tensor value is
        # read by the kernel as a list of scalars: on the CPU, no device to wait for).
        v = _scalar(value)
        if into is zs and zs and self._owns(zs) and all(z.is_cpu for z in zs):
            if isinstance(v, float):
                torch._foreach_addcdiv_(zs, xs, ys, v)
                return zs
            if isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_cpu:
                torch._foreach_addcdiv_(zs, xs, ys, v.reshape(1).expand(len(zs)).contiguous())
                return zs
        return super().addcdiv(zs, xs, ys, value, into)

    def writable(self, xs: Tensors | None) -> bool:
        return xs is not None and self._owns(xs)

    def where(self, cond: torch.Tensor, xs: Tensors, ys: Tensors) -> Tensors:
        return self._fresh(super().where(cond, xs, ys))


class TracedOps(Ops):
    """The ``"traced"`` path: pure per-leaf torch ops (``into`` is ignored): differentiable,
    vmappable, and compiled as ``torch.compile`` compiles torch.optim's step."""

    path = "traced"

    def _binary(self, op: str, xs: Tensors, y: Scalar, into: Tensors | None) -> Tensors:
        y = _scalar(y)
        fn = getattr(torch, op)
        return [fn(x, yi) for x, yi in zip(xs, _each(y, len(xs)))]

    def sign(self, xs: Tensors, into: Tensors | None = None) -> Tensors:
        return [torch.sign(x) for x in xs]

    def maximum(self, xs: Tensors, ys: Tensors, into: Tensors | None = None) -> Tensors:
        return [torch.maximum(x, y) for x, y in zip(xs, ys)]

    def sqrt(self, xs: Tensors, into: Tensors | None = None) -> Tensors:
        return [torch.sqrt(x) for x in xs]

    def fma(self, xs: Tensors, y: Scalar, zs: Tensors, into: Tensors | None = None) -> Tensors:
        y = _scalar(y)
        return [
            torch.addcmul(z, x, yi) if isinstance(yi, torch.Tensor) else torch.add(z, x, alpha=yi)
            for x, yi, z in zip(xs, _each(y, len(xs)), zs)
        ]

    def lerp(
        self, xs: Tensors, ys: Tensors, weight: Scalar, into: Tensors | None = None
    ) -> Tensors:
        if not isinstance(weight, torch.Tensor):
            weight = _python_float("lerp", "weight", weight)
        return [torch.lerp(x, y, weight) for x, y in zip(xs, ys)]

    def addcmul(
        self, zs: Tensors, xs: Tensors, ys: Tensors, value: float, into: Tensors | None = None
    ) -> Tensors:
        v = _python_float("addcmul", "value", value)
        return [torch.addcmul(z, x, y, value=v) for z, x, y in zip(zs, xs, ys)]


def choose_ops(
    tensors: Sequence[Any],
    *,
    owned: Sequence[torch.Tensor] = (),
    device: Any = None,
    donated: Sequence[torch.Tensor] = (),
    skip: SkipWrites | None = None,
) -> Ops:
    """The execution path for one update whose input tensors are ``tensors``.

    ``tensors`` are the grads, params, state leaves and the learning rate. The path is
    :class:`EagerOps` when :func:`plain_eager_tensors` holds, else :class:`TracedOps`. The eager
    path owns ``owned`` (grads donated by the caller). With ``skip``, the state buffers
    ``donated`` receive their new values in :meth:`Ops.kept`.
    """
    if device is None:
        first = next((x for x in tensors if isinstance(x, torch.Tensor)), None)
        device = first.device if first is not None else torch.device("cpu")
    if plain_eager_tensors(tensors):
        if skip is not None and not plain_eager_tensors([skip.found_inf]):
            skip = None  # then the caller selects and writes the new state itself
        return EagerOps(device, owned, donated, skip)
    return TracedOps(device)
