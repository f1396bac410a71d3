"""Tree assertions that name the leaf path that differs: :func:`assert_trees_equal` (bit for
bit) and :func:`assert_trees_close`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import optree
import torch

from funcamp._core.tree import NAMESPACE, PyTree, path_str

__all__ = ["assert_trees_close", "assert_trees_equal"]


def _flatten(tree: PyTree) -> tuple[list[str], list[Any], Any]:
    paths, leaves, spec = optree.tree_flatten_with_path(tree, namespace=NAMESPACE)
    return [path_str(p) for p in paths], leaves, spec


def _check_structure(api: str, actual: PyTree, expected: PyTree) -> tuple[list[str], list, list]:
    a_paths, a_leaves, a_spec = _flatten(actual)
    e_paths, e_leaves, e_spec = _flatten(expected)
    if a_spec != e_spec:
        e_set, a_set = set(e_paths), set(a_paths)
        missing = [p for p in e_paths if p not in a_set]
        extra = [p for p in a_paths if p not in e_set]
        if missing:
            detail = f"leaf {missing[0]} is in `expected` but not in `actual`"
        elif extra:
            detail = f"leaf {extra[0]} is in `actual` but not in `expected`"
        else:
            detail = "the containers (types, keys or static metadata) differ"
        raise AssertionError(
            f"funcamp.testing.{api}: the trees differ in structure: {detail}\n"
            f"  actual:   {a_spec}\n  expected: {e_spec}"
        )
    return a_paths, a_leaves, e_leaves


def _default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    # torch.testing.assert_close's defaults.
    return {
        torch.float16: (1e-3, 1e-5),
        torch.bfloat16: (1.6e-2, 1e-5),
        torch.float32: (1.3e-6, 1e-5),
        torch.float64: (1e-7, 1e-7),
    }.get(dtype, (0.0, 0.0))


def _compare_tensors(
    api: str,
    path: str,
    a: torch.Tensor,
    e: torch.Tensor,
    rtol: float,
    atol: float,
    equal_nan: bool,
    check_dtype: bool,
) -> None:
    where = f"funcamp.testing.{api}: leaf {path}"
    if a.shape != e.shape:
        raise AssertionError(f"{where} differs in shape: {tuple(a.shape)} vs {tuple(e.shape)}")
    if check_dtype and a.dtype != e.dtype:
        raise AssertionError(f"{where} differs in dtype: {a.dtype} vs {e.dtype}")
    if a.device != e.device:
        raise AssertionError(f"{where} differs in device: {a.device} vs {e.device}")
    if a.is_complex() or e.is_complex():
        a, e = torch.view_as_real(a.detach().cdouble()), torch.view_as_real(e.detach().cdouble())
    a64 = a.detach().cpu().to(torch.float64)
    e64 = e.detach().cpu().to(torch.float64)
    if a.dtype == torch.bool or not (a.is_floating_point() or e.is_floating_point()):
        # Integer and bool leaves: exact, compared as integers (float64 would round int64).
        ok = a.detach().cpu() == e.detach().cpu()
        if rtol or atol:
            diff_i = (a.detach().cpu().long() - e.detach().cpu().long()).abs()
            ok = ok | (diff_i.double() <= atol + rtol * e.detach().cpu().long().abs().double())
    else:
        both_nan = torch.isnan(a64) & torch.isnan(e64)
        same = a64 == e64  # also equal infinities of one sign
        # Only finite pairs may differ by the tolerance; infinities must match exactly.
        close = torch.isfinite(a64) & torch.isfinite(e64)
        close &= (a64 - e64).abs() <= atol + rtol * e64.abs()
        ok = same | close
        if equal_nan:
            ok = ok | both_nan
    if bool(ok.all()):
        return
    bad = ~ok
    abs_err = (a64 - e64).abs()
    rel_err = abs_err / e64.abs()
    abs_err = torch.where(bad, abs_err.nan_to_num(nan=math.inf), torch.zeros_like(abs_err))
    rel_err = torch.where(bad, rel_err.nan_to_num(nan=math.inf), torch.zeros_like(rel_err))
    idx: tuple[int, ...] = ()
    if a64.dim():
        worst = torch.tensor(int(abs_err.reshape(-1).argmax()))
        idx = tuple(int(i) for i in torch.unravel_index(worst, a64.shape))
    tol = f" (rtol={rtol:g}, atol={atol:g})" if (rtol or atol) else ""
    raise AssertionError(
        f"{where} differs{tol}\n"
        f"  {int(bad.sum())} of {a64.numel()} elements, shape {tuple(a.shape)}, dtype {a.dtype}\n"
        f"  max abs error {float(abs_err.max()):.6g}, max rel error {float(rel_err.max()):.6g}\n"
        f"  worst at index {idx}: actual {a64[idx].item()!r}, expected {e64[idx].item()!r}"
    )


def _compare(
    api: str,
    actual: PyTree,
    expected: PyTree,
    tolerances: Callable[[torch.dtype], tuple[float, float]],
    equal_nan: bool,
    check_dtype: bool,
) -> None:
    paths, a_leaves, e_leaves = _check_structure(api, actual, expected)
    for path, a, e in zip(paths, a_leaves, e_leaves):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            # The looser tolerance of the two dtypes (a bfloat16 result vs a float32 reference).
            (r1, a1), (r2, a2) = tolerances(a.dtype), tolerances(e.dtype)
            rtol, atol = max(r1, r2), max(a1, a2)
            _compare_tensors(api, path, a, e, rtol, atol, equal_nan, check_dtype)
        elif isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor):
            raise AssertionError(
                f"funcamp.testing.{api}: leaf {path} is a tensor in only one tree: "
                f"{type(a).__name__} vs {type(e).__name__}"
            )
        else:
            same = a == e or (
                equal_nan
                and isinstance(a, float)
                and isinstance(e, float)
                and math.isnan(a)
                and math.isnan(e)
            )
            if not same:
                raise AssertionError(f"funcamp.testing.{api}: leaf {path} differs: {a!r} vs {e!r}")


def assert_trees_equal(
    actual: PyTree, expected: PyTree, *, equal_nan: bool = True, check_dtype: bool = True
) -> None:
    """Assert two pytrees have one structure and equal leaves (tensors: same shape, dtype,
    device and values).

    Floating values compare with ``==`` (so ``-0.0`` equals ``0.0``; infinities must match in
    sign); ``nan`` equals ``nan`` unless ``equal_nan=False``. Structure includes container
    types, dict keys and static pytree metadata (a :class:`funcamp.ScalerState`'s
    configuration). On failure the ``AssertionError`` names the first differing leaf path and
    shows how many elements differ, the max abs/rel error and the worst element.

    Args:
        actual: the tree under test.
        expected: the reference tree.
        equal_nan: treat ``nan`` as equal to ``nan``.
        check_dtype: require tensor leaves to have the same dtype.

    Example:
        >>> import torch
        >>> from funcamp.testing import assert_trees_equal
        >>> assert_trees_equal({"w": torch.ones(2)}, {"w": torch.ones(2)})
        >>> assert_trees_equal({"w": [torch.ones(2)]}, {"w": [torch.tensor([1.0, 1.5])]})
        Traceback (most recent call last):
        ...
        AssertionError: funcamp.testing.assert_trees_equal: leaf ['w'][0] differs
          1 of 2 elements, shape (2,), dtype torch.float32
          max abs error 0.5, max rel error 0.333333
          worst at index (1,): actual 1.0, expected 1.5
    """
    _compare("assert_trees_equal", actual, expected, lambda _: (0.0, 0.0), equal_nan, check_dtype)


def assert_trees_close(
    actual: PyTree,
    expected: PyTree,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    equal_nan: bool = True,
    check_dtype: bool = True,
) -> None:
    """Assert two pytrees have one structure and leaves within ``atol + rtol * |expected|``.

    Tolerances default per dtype to ``torch.testing.assert_close``'s. That is rtol 1e-3, atol
    1e-5 for float16; 1.6e-2, 1e-5 for bfloat16; 1.3e-6, 1e-5 for float32; 1e-7, 1e-7 for
    float64. Give both ``rtol`` and ``atol`` to override. Infinities must match exactly.
    ``nan`` equals ``nan`` unless ``equal_nan=False``. Non-tensor leaves must be equal. Errors
    are computed in float64. On failure the ``AssertionError`` names the leaf path. It shows
    the max abs and rel error, and the worst element.

    Args:
        actual: the tree under test.
        expected: the reference tree.
        rtol: relative tolerance.
        atol: absolute tolerance.
        equal_nan: treat ``nan`` as equal to ``nan``.
        check_dtype: require tensor leaves to have the same dtype (set False to compare a
            bfloat16 result with a float32 reference).

    Example:
        >>> import torch
        >>> from funcamp.testing import assert_trees_close
        >>> x = torch.linspace(0, 1, 7)
        >>> assert_trees_close(x.bfloat16(), x, check_dtype=False)
        >>> assert_trees_close({"y": x}, {"y": x * 1.01}, rtol=1e-3, atol=0.0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: funcamp.testing.assert_trees_close: leaf ['y'] differs (rtol=0.001, atol=0)
        ...
    """
    if (rtol is None) != (atol is None):
        raise ValueError(
            "funcamp.testing.assert_trees_close: give both `rtol` and `atol` or neither, got "
            f"rtol={rtol!r}, atol={atol!r}"
        )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (not isinstance(value, (int, float)) or value < 0):
            raise ValueError(
                f"funcamp.testing.assert_trees_close: `{name}` must be a float >= 0, got {value!r}"
            )

    def tolerances(dtype: torch.dtype) -> tuple[float, float]:
        if rtol is not None and atol is not None:
            return float(rtol), float(atol)
        return _default_tolerances(dtype)

    _compare("assert_trees_close", actual, expected, tolerances, equal_nan, check_dtype)
