"""Op rules and op tables: which torch op runs in which dtype under ``amp``.

torch.autocast keeps its op lists in C++ (``aten/src/ATen/autocast_mode.cpp`` and
``autocast_mode.h``) and applies them at the aten level. funcamp applies the same lists at the
Python level, through a :class:`torch.overrides.TorchFunctionMode`. So the tables below map every
Python entry point that reaches a listed aten op onto one canonical op name. The entry points are
``torch.*``, ``torch.nn.functional.*``, ``torch.linalg.*``, ``torch.fft.*``, and ``Tensor``
methods and operators such as ``@`` and ``**``.

Workaround of torch internals (docs/internals.md#workarounds):

- Root cause: a TorchFunctionMode receives the C builtins (torch._C._nn.pad,
  torch._C._VariableFunctions.*, torch._C.TensorBase methods), so the op tables name them there.
- Upstream: none filed.
- Why it is safe: names only; tests/test_opinfo.py compares every op with torch.autocast.
- Tested on: torch 2.13 and 2.14.
- Delete when: a mode receives public callables, or amp stops being a TorchFunctionMode.

"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["OpKey", "OpPolicy", "OpRule", "closest_table", "from_table", "op_name"]


class OpRule(enum.Enum):
    """How ``amp`` casts the inputs of one op.

    - ``COMPUTE``: cast floating inputs to the policy's compute dtype (autocast's
      ``lower_precision_fp``).
    - ``FLOAT32``: cast floating inputs to float32 (autocast's ``fp32``). Some ops have a
      ``dtype`` argument (softmax, log_softmax, sum, prod, cumsum, cumprod, vector/matrix
      norms). For them the input is left alone, and ``dtype=torch.float32`` is passed instead,
      as torch's ``fp32_set_opt_dtype`` does. An explicit ``dtype=`` from the caller is kept.
    - ``PROMOTE``: cast floating inputs to the widest of the compute dtype and the floating
      input dtypes (autocast's ``promote``).
    - ``NONE``: run the op as called.

    float64 tensors are never cast, whatever the rule (as in torch).

    Example:
        >>> import funcamp
        >>> funcamp.OpRule("float32")
        <OpRule.FLOAT32: 'float32'>
    """

    COMPUTE = "compute"
    FLOAT32 = "float32"
    PROMOTE = "promote"
    NONE = "none"

    @classmethod
    def _missing_(cls, value: object) -> OpRule:
        raise ValueError(
            f"funcamp.OpRule: `value` must be one of {[r.value for r in cls]} (or an OpRule), "
            f"got {value!r}"
        )


#: An op is named by its canonical (aten-style) name, e.g. ``"linear"``, or given as a callable.
OpKey = str | Callable[..., Any]

# ---------------------------------------------------------------------------------------------
# torch.autocast's lists (aten op names), read from torch's aten/src/ATen/autocast_mode.{h,cpp}.
# ---------------------------------------------------------------------------------------------
_UPSAMPLE = (
    "upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d "
    "_upsample_nearest_exact2d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "_upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa"
)

_CUDA_LOWER = (
    "_convolution conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d "
    "conv_transpose3d convolution prelu addmm addmv addr matmul einsum mm mv linalg_vecdot "
    "linear addbmm baddbmm bmm chain_matmul linalg_multi_dot _thnn_fused_lstm_cell "
    "_thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell "
    "_scaled_dot_product_flash_attention scaled_dot_product_attention"
)
_CUDA_FP32 = (
    "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow "
    "softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm nuclear_norm "
    "cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d "
    "hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss "
    "margin_ranking_loss multilabel_margin_loss soft_margin_loss triplet_margin_loss "
    "multi_margin_loss binary_cross_entropy_with_logits dist pdist cdist renorm logsumexp "
    + _UPSAMPLE
)
# fp32_set_opt_dtype (and norm, which autocast redispatches with a dtype appended).
_CUDA_FP32_DTYPE_ARG = (
    "prod softmax log_softmax cumprod cumsum linalg_vector_norm linalg_matrix_norm sum norm"
)
_CUDA_PROMOTE = (
    "addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
)

_CPU_LOWER = (
    "conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm _addmm_activation addbmm linear "
    "_convolution matmul conv_tbc mkldnn_rnn_layer conv_transpose1d conv_transpose2d "
    "conv_transpose3d prelu scaled_dot_product_attention _native_multi_head_attention"
)
_CPU_FP32 = (
    "avg_pool3d binary_cross_entropy grid_sampler grid_sampler_2d _grid_sampler_2d_cpu_fallback "
    "grid_sampler_3d polar prod quantile nanquantile stft cdist trace view_as_complex cholesky "
    "cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d "
    "max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d "
    "replication_pad1d replication_pad2d replication_pad3d mse_loss cosine_embedding_loss "
    "nll_loss nll_loss2d hinge_embedding_loss poisson_nll_loss smooth_l1_loss cross_entropy_loss "
    "l1_loss huber_loss margin_ranking_loss soft_margin_loss triplet_margin_loss "
    "multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits "
    "fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 "
    "fft_irfft2 fft_rfftn fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank "
    "linalg_solve linalg_cholesky linalg_svdvals linalg_eigvals linalg_eigvalsh linalg_inv "
    "linalg_householder_product linalg_tensorinv linalg_tensorsolve "
    "fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve "
    "fractional_max_pool2d fractional_max_pool3d adaptive_max_pool3d "
    "multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex linalg_svd linalg_eig "
    "linalg_eigh linalg_lstsq linalg_inv_ex"
)
_CPU_PROMOTE = "stack cat index_copy"

# Composites that a function mode sees only from outside, while torch.autocast sees the listed
# aten op they decompose into: C++ composites without a Python copy (funcamp/casting/cpp_composites.py makes the
# inner calls of einsum, tensordot, cov, pinv, the RNN cells ... visible instead), and Python
# wrappers whose inner builtin dynamo does not dispatch to function modes
# (builtins missing from torch.overrides.get_overridable_functions(), e.g.
# torch._C._nn.cross_entropy_loss and upsample_*): listing the wrapper keeps eager and compiled
# runs identical. The presets give them the rule their inner op gets, per device.
_CUDA_COMPOSITES = {
    "cross_entropy": OpRule.FLOAT32,  # F.cross_entropy -> log_softmax(dtype=f32) + nll_loss
    "interpolate": OpRule.FLOAT32,  # F.interpolate -> upsample_* (fp32)
    "upsample": OpRule.FLOAT32,
    "upsample_bilinear": OpRule.FLOAT32,
    "linalg_matmul": OpRule.COMPUTE,  # -> matmul
    "special_softmax": OpRule.FLOAT32,  # -> softmax
    "special_log_softmax": OpRule.FLOAT32,  # -> log_softmax
    "special_expm1": OpRule.FLOAT32,  # -> expm1
    "special_log1p": OpRule.FLOAT32,  # -> log1p
    "special_logsumexp": OpRule.FLOAT32,  # -> logsumexp
    "cross_entropy_loss": OpRule.FLOAT32,  # -> log_softmax(dtype=f32) + nll_loss (fp32)
    "nll_loss_nd": OpRule.FLOAT32,  # -> nll_loss / nll_loss2d
    "binary_cross_entropy": OpRule.FLOAT32,  # torch.autocast("cuda") raises; funcamp upcasts
    "lstm": OpRule.COMPUTE,  # -> lstm_cell / _thnn_fused_lstm_cell / cudnn
    "gru": OpRule.COMPUTE,
    "rnn_tanh": OpRule.COMPUTE,
    "rnn_relu": OpRule.COMPUTE,
}
_CPU_COMPOSITES = {
    "cross_entropy": OpRule.FLOAT32,  # F.cross_entropy -> cross_entropy_loss (fp32)
    "concat": OpRule.PROMOTE,  # -> cat
    "concatenate": OpRule.PROMOTE,  # -> cat
    "linalg_matmul": OpRule.COMPUTE,  # -> matmul
    "nll_loss_nd": OpRule.FLOAT32,  # -> nll_loss / nll_loss2d
    "chain_matmul": OpRule.COMPUTE,  # -> mm
    "linalg_multi_dot": OpRule.COMPUTE,  # -> mm
    "lstm": OpRule.COMPUTE,  # -> mkldnn_rnn_layer / linear
    "gru": OpRule.COMPUTE,  # -> linear
    "rnn_tanh": OpRule.COMPUTE,
    "rnn_relu": OpRule.COMPUTE,
}

#: Ops that take ``dtype=`` and get ``dtype=torch.float32`` under ``OpRule.FLOAT32``.
DTYPE_ARG_OPS = frozenset(
    [
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "sum",
        "norm",
        "special_softmax",
        "special_log_softmax",
    ]
)


def _rules(**groups: str) -> dict[str, OpRule]:
    table: dict[str, OpRule] = {}
    for rule_name, names in groups.items():
        for name in names.split():
            table[name] = OpRule[rule_name.upper()]
    return table


_CUDA_TABLE = {
    **_rules(
        compute=_CUDA_LOWER, float32=_CUDA_FP32 + " " + _CUDA_FP32_DTYPE_ARG, promote=_CUDA_PROMOTE
    ),
    **_CUDA_COMPOSITES,
}
_CPU_TABLE = {
    **_rules(compute=_CPU_LOWER, float32=_CPU_FP32, promote=_CPU_PROMOTE),
    **_CPU_COMPOSITES,
}


# ---------------------------------------------------------------------------------------------
# Python entry points of each op.
# ---------------------------------------------------------------------------------------------
_EXTRA_ENTRY_POINTS: dict[str, tuple[tuple[Any, str], ...]] = {
    "matmul": ((torch.Tensor, "__matmul__"), (torch.Tensor, "__rmatmul__")),
    "pow": ((torch.Tensor, "__pow__"), (torch.Tensor, "__rpow__")),
    "nll_loss_nd": ((torch._C._nn, "nll_loss_nd"),),
    "cross_entropy_loss": ((torch._C._nn, "cross_entropy_loss"),),
    "grid_sampler": ((torch.nn.functional, "grid_sample"),),
    "index_put": ((torch.Tensor, "index_put"),),
    "_native_multi_head_attention": ((torch, "_native_multi_head_attention"),),
}
_PREFIXED_NAMESPACES = (("linalg_", torch.linalg), ("fft_", torch.fft), ("special_", torch.special))


def _entry_points(name: str) -> list[Callable[..., Any]]:
    """Every Python-level callable that reaches the aten op ``name``."""
    found: list[Callable[..., Any]] = []
    spaces: list[tuple[Any, str]] = [
        (torch, name),
        (torch.nn.functional, name),
        (torch._C._nn, name),
        (torch._C._VariableFunctions, name),
        (torch.Tensor, name),
        (torch._C.TensorBase, name),
    ]
    for prefix, module in _PREFIXED_NAMESPACES:
        if name.startswith(prefix):
            spaces.append((module, name[len(prefix) :]))
    spaces.extend(_EXTRA_ENTRY_POINTS.get(name, ()))
    for owner, attr in spaces:
        fn = getattr(owner, attr, None)
        if fn is not None and callable(fn) and not isinstance(fn, type) and fn not in found:
            found.append(fn)
    return found


@functools.cache
def name_index() -> dict[Any, str]:
    """Map every known entry point to its canonical op name."""
    index: dict[Any, str] = {}
    for name in sorted(set(_CUDA_TABLE) | set(_CPU_TABLE)):
        for fn in _entry_points(name):
            index.setdefault(fn, name)
    return index


def op_name(op: OpKey) -> str | None:
    """Return the canonical op name of a callable (``torch.nn.functional.linear`` -> ``"linear"``).

    Returns None for callables funcamp does not know by name.

    Example:
        >>> import torch
        >>> from funcamp.policy.ops import op_name
        >>> op_name(torch.nn.functional.linear), op_name(torch.Tensor.__matmul__)
        ('linear', 'matmul')
    """
    if isinstance(op, str):
        return op
    return name_index().get(op)


def _normalize_key(op: Any, api: str) -> OpKey:
    if isinstance(op, str):
        if not op or not (_entry_points(op) or op in _CUDA_TABLE or op in _CPU_TABLE):
            raise ValueError(
                f"funcamp.{api}: unknown op name {op!r}: no torch, torch.nn.functional, "
                "torch.linalg, torch.fft or Tensor entry point has that name; pass the callable "
                "itself instead"
            )
        return op
    if callable(op):
        return op_name(op) or op
    raise TypeError(
        f"funcamp.{api}: op keys must be op names (str) or callables, got {type(op).__name__} "
        f"{op!r}"
    )


class OpPolicy(Mapping[OpKey, OpRule]):
    """An immutable, hashable mapping from op (canonical name or callable) to :class:`OpRule`.

    Ops not in the mapping run as called (``OpRule.NONE``). A table may also cast at entry
    (:meth:`cast_at_entry`): ``amp`` then casts every floating input to the compute dtype before
    the function runs, and the rules apply on top.

    Example:
        >>> import torch, funcamp
        >>> ops = funcamp.OpPolicy.default()
        >>> ops["linear"], ops["softmax"], ops[torch.matmul]
        (<OpRule.COMPUTE: 'compute'>, <OpRule.FLOAT32: 'float32'>, <OpRule.COMPUTE: 'compute'>)
        >>> ops.with_rules({"softmax": funcamp.OpRule.COMPUTE})["softmax"]
        <OpRule.COMPUTE: 'compute'>
    """

    __slots__ = ("_entry", "_hash", "_items", "_name")

    def __init__(
        self,
        rules: Mapping[OpKey, OpRule] | Iterable[tuple[OpKey, OpRule]] = (),
        *,
        name: str | None = None,
        _trusted: bool = False,
        _entry: bool = False,
    ) -> None:
        items = dict(rules.items() if isinstance(rules, Mapping) else rules)
        normalized: dict[OpKey, OpRule] = {}
        for op, rule in items.items():
            if _trusted:
                normalized[op] = rule
                continue
            key = _normalize_key(op, "OpPolicy")
            if not isinstance(rule, OpRule):
                raise TypeError(
                    f"funcamp.OpPolicy: the rule for {_key_str(key)!r} must be an OpRule "
                    f"(OpRule.COMPUTE, OpRule.FLOAT32, OpRule.PROMOTE or OpRule.NONE), got "
                    f"{type(rule).__name__} {rule!r}"
                )
            normalized[key] = rule
        self._items = normalized
        self._name = name
        self._entry = _entry
        self._hash = hash((frozenset(normalized.items()), _entry))

    @classmethod
    def default(cls) -> OpPolicy:
        """torch's CUDA autocast lists, applied on every device (funcamp's default).

        Example:
            >>> import funcamp
            >>> funcamp.OpPolicy.default()["layer_norm"]
            <OpRule.FLOAT32: 'float32'>
        """
        return _DEFAULT

    @classmethod
    def autocast(cls, device: str) -> OpPolicy:
        """torch.autocast's lists for ``device`` (``"cpu"`` or ``"cuda"``).

        Example:
            >>> import funcamp
            >>> "layer_norm" in funcamp.OpPolicy.autocast("cpu")
            False
        """
        if device == "cuda":
            return _CUDA
        if device == "cpu":
            return _CPU
        raise ValueError(
            f"funcamp.OpPolicy.autocast: `device` must be 'cpu' or 'cuda', got {device!r}"
        )

    @classmethod
    def none(cls) -> OpPolicy:
        """An empty table: every op runs as called.

        Example:
            >>> import funcamp
            >>> len(funcamp.OpPolicy.none())
            0
        """
        return _NONE

    @classmethod
    def cast_at_entry(cls) -> OpPolicy:
        """Cast at entry: no op rules; ``amp`` casts the floating inputs to the compute dtype first.

        What haiku's ``set_policy``, jmp's ``cast_to_compute`` and FSDP2's
        ``MixedPrecisionPolicy`` do: every floating param and input goes to the compute dtype
        once, on entry, and each op runs in the dtypes it gets. ``with_rules`` adds rules on top.

        Example:
            >>> import funcamp
            >>> ops = funcamp.OpPolicy.cast_at_entry()
            >>> ops.casts_at_entry, len(ops), ops == funcamp.OpPolicy.none()
            (True, 0, False)
        """
        return _ENTRY

    @property
    def casts_at_entry(self) -> bool:
        """Whether ``amp`` casts the floating inputs to the compute dtype on entry."""
        return self._entry

    def with_rules(self, rules: Mapping[OpKey, OpRule]) -> OpPolicy:
        """Return a new table with ``rules`` added or replaced; this one is unchanged."""
        if not isinstance(rules, Mapping):
            raise TypeError(
                "funcamp.OpPolicy.with_rules: `rules` must be a mapping {op: OpRule}, got "
                f"{type(rules).__name__}"
            )
        merged = dict(self._items)
        merged.update(OpPolicy(rules)._items)
        return OpPolicy(merged, _trusted=True, _entry=self._entry)

    def __getitem__(self, op: OpKey) -> OpRule:
        key = op if isinstance(op, str) else (op_name(op) or op)
        return self._items[key]

    def __iter__(self) -> Iterator[OpKey]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, op: object) -> bool:
        try:
            self[op]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpPolicy):
            return NotImplemented
        return self._entry == other._entry and self._items == other._items

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if self._name is not None:
            return self._name
        entry = ", cast at entry" if self._entry else ""
        return f"OpPolicy({len(self._items)} rules{entry})"

    def dispatch_table(self) -> dict[Any, OpRule]:
        """Return the table the amp mode looks each call up in.

        It maps the ``__name__`` of every Python entry point of every listed op to its rule
        (``"linear"``, ``"__rmatmul__"``, ...). Ops given as callables that funcamp does not know
        by name map as ``{callable: rule}``.

        The amp mode matches a torch call by the ``__name__`` torch gives its callable: names
        are what dynamo reliably constant-folds, where dict lookups keyed by functions are not.
        """
        return _dispatch_table(self)


def _key_str(key: OpKey) -> str:
    return key if isinstance(key, str) else getattr(key, "__qualname__", repr(key))


@functools.lru_cache(maxsize=64)
def _dispatch_table(policy: OpPolicy) -> dict[Any, OpRule]:
    table: dict[Any, OpRule] = {}
    for key, rule in policy.items():
        if isinstance(key, str):
            table[key] = rule
            for fn in _entry_points(key):
                name = getattr(fn, "__name__", None)
                if name is not None:
                    table[name] = rule
        else:
            table[key] = rule
    return table


_DEFAULT = OpPolicy(_CUDA_TABLE, name="OpPolicy.default()", _trusted=True)
_CUDA = OpPolicy(_CUDA_TABLE, name='OpPolicy.autocast("cuda")', _trusted=True)
_CPU = OpPolicy(_CPU_TABLE, name='OpPolicy.autocast("cpu")', _trusted=True)
_NONE = OpPolicy({}, name="OpPolicy.none()", _trusted=True)
_ENTRY = OpPolicy({}, name="OpPolicy.cast_at_entry()", _trusted=True, _entry=True)


# Python composites the amp mode re-enters, so the torch calls they make inside are seen too.
_TENSOR_REENTRY = (
    "__floordiv__",
    "__rfloordiv__",
    "__rdiv__",
    "__rtruediv__",
    "__rmod__",
    "__rsub__",
    "norm",
)
_FUNCTIONAL_SKIP = frozenset({"boolean_dispatch", "handle_torch_function", "overload", "_overload"})


@functools.cache
def python_composites() -> frozenset[Any]:
    """Python functions whose body calls further torch ops (re-entered by the amp mode)."""
    found: set[Any] = set()
    for module in (torch.nn.functional, torch.functional):
        for attr, fn in vars(module).items():
            if (
                isinstance(fn, types.FunctionType)
                and attr not in _FUNCTIONAL_SKIP
                and "<locals>" not in fn.__qualname__
                and fn.__module__ == module.__name__
            ):
                found.add(fn)
    for attr in _TENSOR_REENTRY:
        fn = getattr(torch.Tensor, attr, None)
        if isinstance(fn, types.FunctionType):
            found.add(fn)
    return frozenset(found)


#: The tables a policy string can name (``ops=...``); the default table is named by omission.
#: ``OpPolicy.default()`` holds CUDA's lists, so ``autocast_cuda`` names the default table too.
OPS_BY_NAME = {
    "default": _DEFAULT,
    "autocast_cuda": _CUDA,
    "autocast_cpu": _CPU,
    "none": _NONE,
    "cast_at_entry": _ENTRY,
}
#: The rule text of an op a named table lists and a policy's table does not.
UNLISTED = "unlisted"


def _differences(ops: OpPolicy, table: OpPolicy) -> dict[OpKey, OpRule | None]:
    """What ``ops`` has on top of ``table``: changed or added rules, and None for removed ops."""
    out: dict[OpKey, OpRule | None] = {
        k: r for k, r in ops._items.items() if table._items.get(k) is not r
    }
    out.update({k: None for k in table._items if k not in ops._items})
    return out


def closest_table(ops: OpPolicy) -> tuple[str, dict[OpKey, OpRule | None]]:
    """The named table ``ops`` is closest to, and the differences on top of it.

    The table casts at entry exactly when ``ops`` does; among those, the one with the fewest
    differences wins, ``default`` on a tie (``autocast_cuda`` is the same table: never chosen).
    A difference is a rule, or None for an op the table lists and ``ops`` does not.
    """
    best: tuple[str, dict[OpKey, OpRule | None]] | None = None
    for name, table in OPS_BY_NAME.items():
        if name == "autocast_cuda" or table._entry != ops._entry:
            continue
        found = _differences(ops, table)
        if best is None or len(found) < len(best[1]):
            best = (name, found)
    assert best is not None
    return best


def from_table(name: str, changes: Mapping[OpKey, OpRule | None]) -> OpPolicy:
    """The named table with ``changes`` applied (a None rule removes the op): the inverse of
    :func:`closest_table`. Keys are checked as :meth:`OpPolicy.with_rules` checks them."""
    table = OPS_BY_NAME[name]
    if not changes:
        return table
    items = dict(table._items)
    for op, rule in changes.items():
        key = _normalize_key(op, "get_policy")
        if rule is None:
            items.pop(key, None)
        else:
            items[key] = rule
    return OpPolicy(items, _trusted=True, _entry=table._entry)


def ops_name(ops: OpPolicy) -> str | None:
    """The name a policy string gives ``ops``.

    None for the default table, and for tables that are not one of ``OPS_BY_NAME`` (those
    print as the closest named table and the differences: :func:`closest_table`).
    """
    if ops == _DEFAULT:
        return None
    for name, table in OPS_BY_NAME.items():
        if ops == table:
            return name
    return None
