"""``Policy``: which dtype params, computation and outputs use, and how each op is cast."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import optree
import torch

from funcamp._core.tree import NAMESPACE, map_tensors, tree_cast
from funcamp.policy.fp8 import Fp8Config
from funcamp.policy.ops import OpKey, OpPolicy, OpRule, from_table
from funcamp.policy.text import (
    AUTOCAST,
    DTYPE_NAMES,
    PRESETS,
    autocast_refused,
    parse_dtype,
    parse_parts,
    policy_text,
    spec_help,
    unknown_name,
)

__all__ = ["ModuleKey", "Policy", "as_policy", "get_policy", "parse_dtype"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: A module override is keyed by an ``nn.Module`` subclass or a glob of module paths.
ModuleKey = type | str


def _check_dtype(value: Any, field: str) -> None:
    if not isinstance(value, torch.dtype) or value not in _FLOAT_DTYPES:
        got = repr(value) if isinstance(value, torch.dtype) else f"{type(value).__name__} {value!r}"
        raise TypeError(
            f"funcamp.Policy: `{field}` must be a floating torch.dtype (torch.float16, "
            f"torch.bfloat16, torch.float32 or torch.float64), got {got}; use "
            f"funcamp.get_policy('...') to build a policy from names"
        )


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast float16/bfloat16/float32 leaves to ``dtype``; float64 only when ``dtype`` is float64."""
    if dtype == torch.float64:
        return tree_cast(tree, dtype)

    def cast(x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point() and x.dtype != dtype and x.dtype != torch.float64:
            return x.to(dtype)
        return x

    return map_tensors(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """A mixed-precision policy: immutable, hashable, inspectable.

    Attributes:
        param_dtype: dtype parameters are stored in.
        compute_dtype: dtype ops with the ``COMPUTE`` rule run in.
        output_dtype: dtype floating outputs of an ``amp``-wrapped function are cast to.
        ops: the op table (:class:`OpPolicy`); defaults to ``OpPolicy.default()`` (torch's CUDA
            autocast lists, on every device); ``OpPolicy.cast_at_entry()`` casts the floating
            inputs on entry instead (FSDP2's and haiku's mixed precision).
        module_policies: per-module overrides, ``((ModuleClass or "glob.path", Policy), ...)``;
            build them with :meth:`with_module_policies`.
        fp8: which linear and addmm calls run as scaled FP8 matmuls, and with which recipe, or
            None; build it with :meth:`with_fp8`.

    ``str(policy)`` writes every part in :func:`get_policy`'s grammar, and reads back as an
    equal policy when every part has a name; a part without one (a module class, an op given
    as an unnamed callable) prints as a marker in angle brackets, which ``get_policy`` refuses.

    Example:
        >>> import torch, funcamp
        >>> p = funcamp.Policy(compute_dtype=torch.bfloat16)
        >>> str(p)
        'params=float32,compute=bfloat16,output=float32'
        >>> str(p.with_module_policies({"head": "float32"}))
        'params=float32,compute=bfloat16,output=float32,module:head=(params=float32,compute=float32,output=float32)'
        >>> p.cast_to_compute({"x": torch.ones(2), "i": torch.arange(2)})["x"].dtype
        torch.bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    ops: OpPolicy = dataclasses.field(default_factory=OpPolicy.default)
    module_policies: tuple[tuple[ModuleKey, Policy], ...] = ()
    fp8: Fp8Config | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            _check_dtype(getattr(self, field), field)
        if not isinstance(self.ops, OpPolicy):
            raise TypeError(
                f"funcamp.Policy: `ops` must be an OpPolicy (e.g. OpPolicy.default()), got "
                f"{type(self.ops).__name__}"
            )
        if not isinstance(self.module_policies, tuple):
            raise TypeError(
                "funcamp.Policy: `module_policies` must be a tuple of (key, Policy) pairs; use "
                f"Policy.with_module_policies({{...}}), got {type(self.module_policies).__name__}"
            )
        for entry in self.module_policies:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise TypeError(
                    "funcamp.Policy: `module_policies` entries must be (key, Policy) pairs, got "
                    f"{entry!r}"
                )
            check_module_key(entry[0], "Policy")
            if not isinstance(entry[1], Policy):
                raise TypeError(
                    f"funcamp.Policy: the module policy for {entry[0]!r} must be a Policy, got "
                    f"{type(entry[1]).__name__}"
                )
            if entry[1].ops.casts_at_entry:
                raise ValueError(
                    f"funcamp.Policy: the module policy for {entry[0]!r} casts at entry "
                    "(ops=cast_at_entry), which a module policy cannot do: params are cast where "
                    "the whole function is entered, not where a module runs; give the module a "
                    "table of rules instead (e.g. 'float32': its ops in float32)"
                )
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Config):
            raise TypeError(
                "funcamp.Policy: `fp8` must be None or built by Policy.with_fp8(recipe), got "
                f"{type(self.fp8).__name__}"
            )

    # -- casting ------------------------------------------------------------------------------
    def cast_to_param(self, tree: Any) -> Any:
        """Cast the floating tensor leaves of ``tree`` to ``param_dtype``.

        Integer, bool, non-tensor leaves and float64 leaves (unless ``param_dtype`` is float64)
        pass through untouched.

        Example:
            >>> import torch, funcamp
            >>> funcamp.get_policy("bf16-true").cast_to_param([torch.ones(1)])[0].dtype
            torch.bfloat16
        """
        return cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast the floating tensor leaves of ``tree`` to ``compute_dtype`` (see
        :meth:`cast_to_param`).

        Example:
            >>> import torch, funcamp
            >>> p = funcamp.get_policy("mixed_bfloat16")
            >>> p.cast_to_compute((torch.ones(1), torch.ones(1, dtype=torch.float64)))[1].dtype
            torch.float64
        """
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Cast the floating tensor leaves of ``tree`` to ``output_dtype`` (see
        :meth:`cast_to_param`).

        Example:
            >>> import torch, funcamp
            >>> p = funcamp.get_policy("mixed_bfloat16")
            >>> p.cast_to_output(torch.ones(1, dtype=torch.bfloat16)).dtype
            torch.float32
        """
        return cast_floating(tree, self.output_dtype)

    # -- derived policies ----------------------------------------------------------------------
    def with_op_rules(self, rules: Mapping[OpKey, OpRule]) -> Policy:
        """Return a policy whose op table has ``rules`` added or replaced.

        Keys are op names (``"softmax"``) or callables (``torch.nn.functional.softmax``); values
        are :class:`OpRule`. This policy is unchanged.

        Example:
            >>> import funcamp
            >>> p = funcamp.get_policy("mixed_bfloat16")
            >>> q = p.with_op_rules({"softmax": funcamp.OpRule.COMPUTE})
            >>> p.ops["softmax"], q.ops["softmax"]
            (<OpRule.FLOAT32: 'float32'>, <OpRule.COMPUTE: 'compute'>)
        """
        if not isinstance(rules, Mapping):
            raise TypeError(
                "funcamp.Policy.with_op_rules: `rules` must be a mapping {op: OpRule}, got "
                f"{type(rules).__name__}"
            )
        for op, rule in rules.items():
            if not isinstance(rule, OpRule):
                raise TypeError(
                    f"funcamp.Policy.with_op_rules: the rule for {op!r} must be an OpRule "
                    f"(OpRule.COMPUTE, OpRule.FLOAT32, OpRule.PROMOTE or OpRule.NONE), got "
                    f"{type(rule).__name__} {rule!r}"
                )
        return dataclasses.replace(self, ops=self.ops.with_rules(rules))

    def with_module_policies(self, policies: Mapping[ModuleKey, Policy | str]) -> Policy:
        """Return a policy with per-module overrides added (or replaced, for the same key).

        While a matching module runs, its floating inputs are cast to the module policy's
        compute dtype on entry. Its floating outputs are cast to its output dtype on exit. Its
        op rules apply inside. The innermost matching module wins. Keys are ``nn.Module``
        subclasses, or glob patterns over module paths as ``named_modules()`` gives them for the
        root module (e.g. ``"encoder.*.norm"``). A value given as a string is parsed with
        :func:`get_policy` (default op table). A module policy cannot cast at entry
        (``ops=cast_at_entry``): params are cast where the whole function is entered.

        Example:
            >>> import torch, funcamp
            >>> p = funcamp.get_policy("mixed_bfloat16")
            >>> q = p.with_module_policies({torch.nn.LayerNorm: "float32"})
            >>> q.module_policies[0][0] is torch.nn.LayerNorm
            True
        """
        if not isinstance(policies, Mapping):
            raise TypeError(
                "funcamp.Policy.with_module_policies: `policies` must be a mapping "
                f"{{ModuleClass or 'glob.path': Policy or str}}, got {type(policies).__name__}"
            )
        merged: dict[ModuleKey, Policy] = dict(self.module_policies)
        for key, value in policies.items():
            check_module_key(key, "Policy.with_module_policies")
            if isinstance(value, str):
                value = get_policy(value)
            elif not isinstance(value, Policy):
                raise TypeError(
                    f"funcamp.Policy.with_module_policies: the policy for {key!r} must be a "
                    f"Policy or a policy string, got {type(value).__name__} {value!r}"
                )
            merged.pop(key, None)
            merged[key] = value
        return dataclasses.replace(self, module_policies=tuple(merged.items()))

    def with_fp8(
        self,
        recipe: Any,
        *,
        modules: tuple[ModuleKey, ...] = (torch.nn.Linear,),
        exclude: tuple[ModuleKey, ...] = (),
    ) -> Policy:
        """Return a policy whose matching linear and addmm calls run as scaled FP8 matmuls.

        Two calls can run in FP8. One is a linear call (``F.linear``, what ``nn.Linear`` runs).
        The other is an ``addmm(bias, x, w)`` call (``torch.addmm`` or ``Tensor.addmm``, what
        Hugging Face's ``Conv1D`` runs, with ``w`` of shape ``(in, out)``). A call runs in FP8
        when the innermost module running it matches ``modules`` and no ``exclude`` entry
        (``exclude`` wins). Entries are ``nn.Module`` subclasses, or globs over module paths as
        ``named_modules()`` gives them.

        In FP8, input and weight are quantized to ``float8_e4m3fn``, and the output gradient to
        ``float8_e5m2``. Each gets a per-tensor scale chosen by ``recipe``. The matmuls are done
        by ``torch._scaled_mm``. The output (and the bias add) is in the compute dtype of the
        policy in force. An addmm runs in FP8 only with 2-D ``x`` and ``w``, a 1-D bias and
        ``beta = alpha = 1``. Other calls of a selected module (and float64 ones) follow the
        policy. :func:`funcamp.trace` lists them with the reason (``AmpTrace.fp8_fallbacks``).
        Everything else follows this policy. See the FP8 guide for the exact numerics.

        Args:
            recipe: a :class:`funcamp.Fp8Recipe` (``Fp8Recipe.current()`` or
                ``Fp8Recipe.delayed(history, margin)``).
            modules: module classes or path globs whose linear and addmm calls run in FP8
                (``(transformers.pytorch_utils.Conv1D, torch.nn.Linear)`` for GPT-2).
            exclude: module classes or path globs that stay out of FP8.

        Example:
            >>> import torch, funcamp
            >>> p = funcamp.get_policy("mixed_bfloat16").with_fp8(
            ...     funcamp.Fp8Recipe.current(), exclude=("head",))
            >>> p.fp8.recipe.kind, p.fp8.exclude, str(p)
            ('current', ('head',), 'params=float32,compute=bfloat16,output=float32,fp8=current,fp8.exclude=(head)')
        """
        return dataclasses.replace(self, fp8=Fp8Config.build(recipe, modules, exclude))

    def __str__(self) -> str:
        return policy_text(self)

    def __repr__(self) -> str:
        return f"Policy({policy_text(self)!r})"


def off_policy_param(policy: Policy, params: Any) -> tuple[str, torch.Tensor] | None:
    """The first floating leaf of ``params`` that is not in ``policy.param_dtype``, with its
    path (``"['w']"``), or None. float64 leaves are kept as they are by every policy, and
    1-byte (FP8) leaves follow their own recipe: neither counts."""
    paths, leaves, _ = optree.tree_flatten_with_path(params, namespace=NAMESPACE)
    for path, leaf in zip(paths, leaves):
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.dtype not in (policy.param_dtype, torch.float64)
            and leaf.element_size() > 1
        ):
            return "".join(f"[{k!r}]" for k in path), leaf
    return None


def check_module_key(key: Any, api: str) -> None:
    if isinstance(key, str):
        if not key:
            raise ValueError(f"funcamp.{api}: a module path glob must not be empty")
        return
    if isinstance(key, type) and issubclass(key, torch.nn.Module):
        return
    raise TypeError(
        f"funcamp.{api}: module keys must be torch.nn.Module subclasses or module-path glob "
        f"strings (e.g. torch.nn.LayerNorm or 'encoder.*.norm'), got {type(key).__name__} {key!r}"
    )


def get_policy(spec: str) -> Policy:
    """Build a :class:`Policy` from a string, in jmp's grammar; ``str(policy)`` writes it back.

    ``spec`` is comma-separated ``key=value`` with keys ``p|params``, ``c|compute``,
    ``o|output`` and dtype names ``f32|float32|full``, ``f16|float16|half``,
    ``bf16|bfloat16``, ``f64|float64``. Params default to float32, compute follows params,
    output follows compute. A bare dtype name sets all three. An ``ops`` key names the op table:
    ``default`` (torch's CUDA autocast lists, on every device: the default), ``autocast_cpu``
    (torch's CPU lists), ``autocast_cuda`` (the same as ``default``), ``none``, or
    ``cast_at_entry`` (floating params and inputs cast to the compute dtype on entry, each op
    run in the dtypes it gets: FSDP2's, haiku's and jmp's mixed precision).

    Every other part of a policy has a text form too, so ``get_policy(str(p)) == p``:
    ``ops.NAME=RULE`` (an op rule on top of the table; ``unlisted`` drops an op the table lists),
    ``module:GLOB=(POLICY)`` (a module policy for a module-path glob) and ``fp8=current``,
    ``fp8=delayed(history=16,margin=0)``, ``fp8.modules=(GLOB,...)``, ``fp8.exclude=(GLOB,...)``.
    A part with no text form (an op given as an unnamed callable, a module class) prints as a
    marker in angle brackets, which this function refuses with the way to build it.

    Presets: ``"mixed_float16"``/``"16-mixed"``, ``"mixed_bfloat16"``/``"bf16-mixed"``
    (CUDA's lists on every device: equal to ``torch.autocast("cpu")`` only for models whose ops
    both lists treat alike; a LayerNorm or softmax on bfloat16 values is not),
    ``"bf16-true"``, ``"16-true"``, ``"float32"``/``"32-true"``, ``"64-true"``, and:

    * ``"autocast_cpu"``: bfloat16 with CPU's lists, bit-identical to ``torch.autocast("cpu")``;
    * ``"autocast_cuda"``: float16 with CUDA's lists, equal to ``"mixed_float16"``;
    * ``"fsdp_bfloat16"``, ``"fsdp_float16"``: cast at entry, params and outputs float32; FSDP2's
      ``MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32)`` bit for bit.

    ``"autocast"`` alone is refused: torch.autocast's defaults depend on the device.

    Raises:
        ValueError: naming the bad part of ``spec`` and listing what is valid.

    Example:
        >>> import funcamp
        >>> str(funcamp.get_policy("c=bf16"))
        'params=float32,compute=bfloat16,output=bfloat16'
        >>> str(funcamp.get_policy("fsdp_bfloat16"))
        'params=float32,compute=bfloat16,output=float32,ops=cast_at_entry'
        >>> p = funcamp.get_policy("mixed_float16").with_op_rules({"softmax": funcamp.OpRule.COMPUTE})
        >>> str(p)
        'params=float32,compute=float16,output=float32,ops.softmax=compute'
        >>> funcamp.get_policy(str(p)) == p
        True
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"funcamp.get_policy: `spec` must be a str such as 'mixed_bfloat16' or "
            f"'params=float32,compute=bfloat16', got {type(spec).__name__} {spec!r}"
        )
    text = spec.strip()
    if text.lower() == AUTOCAST:
        raise ValueError(autocast_refused(spec))
    text = PRESETS.get(text.lower(), text)
    if not text:
        raise ValueError(spec_help("empty policy spec"))
    if "=" not in text:
        if text.lower().removeprefix("torch.") not in DTYPE_NAMES:
            raise ValueError(unknown_name(spec, text.lower()))
        dtype = parse_dtype(text)
        return Policy(dtype, dtype, dtype)
    parsed = parse_parts(spec, text)
    param = parsed.dtypes.get("param_dtype", torch.float32)
    compute = parsed.dtypes.get("compute_dtype", param)
    output = parsed.dtypes.get("output_dtype", compute)
    policy = Policy(param, compute, output, ops=from_table(parsed.table, parsed.rules))
    if parsed.modules:
        module_policies = []
        for glob, sub in parsed.modules:
            check_module_key(glob, "get_policy")
            module_policies.append((glob, get_policy(sub)))
        policy = dataclasses.replace(policy, module_policies=tuple(module_policies))
    if parsed.fp8 is not None:
        recipe, modules, exclude = parsed.fp8
        fp8 = Fp8Config.build(recipe, (torch.nn.Linear,) if modules is None else modules, exclude)
        policy = dataclasses.replace(policy, fp8=fp8)
    return policy


def as_policy(policy: Any, api: str) -> Policy:
    """``policy`` as a :class:`Policy` (a spec string is parsed), or a clear error naming ``api``."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return get_policy(policy)
    raise TypeError(
        f"funcamp.{api}: `policy` must be a funcamp.Policy or a policy string such as "
        f"'mixed_bfloat16', got {type(policy).__name__} {policy!r}"
    )
