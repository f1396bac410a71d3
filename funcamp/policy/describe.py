"""A policy as plain data.

:func:`describe_policy` gives a canonical, complete description of a :class:`~funcamp.Policy`:
dtypes, op rules, module rules, FP8. It is made of strings, ints, lists and dicts. So a
checkpoint stores it, and ``torch.load(weights_only=True)`` reads it back.
:func:`policy_difference` names the first place where two descriptions differ.

Op rules are described against the named table they are closest to (``default``,
``autocast_cpu``, ``none``...): the table's name and the rules added, changed or removed on top
of it. Two policies built the same way thus describe the same even if a later funcamp changes
what a named table holds.
"""

from __future__ import annotations

from typing import Any

from funcamp.policy.ops import OPS_BY_NAME, OpKey, OpPolicy, closest_table

__all__ = ["describe_policy", "policy_difference"]

#: The rule stored for an op a table lists but the policy removed.
REMOVED = "<not listed>"


def _op_key(key: OpKey) -> str:
    if isinstance(key, str):
        return key
    module = getattr(key, "__module__", None) or ""
    name = getattr(key, "__qualname__", None) or getattr(key, "__name__", None) or repr(key)
    return f"{module}.{name}" if module else name


def _module_key(key: Any) -> str:
    if isinstance(key, str):
        return f"path {key}"
    return f"class {key.__module__}.{key.__qualname__}"


def _table_rule(table: Any, op: str) -> str:
    """The rule the named table gives ``op`` (``REMOVED`` when it does not list it)."""
    ops = OPS_BY_NAME.get(table, OpPolicy.none()) if isinstance(table, str) else OpPolicy.none()
    rules = {_op_key(k): r.value for k, r in ops.items()}
    return rules.get(op, REMOVED)


def describe_ops(ops: OpPolicy) -> dict[str, Any]:
    """``{"table": name, "rules": {op: rule}}``: the closest named table and the differences.

    A table that casts at entry is described against ``cast_at_entry``, the one named table
    that does."""
    name, changes = closest_table(ops)
    rules = {_op_key(k): REMOVED if r is None else r.value for k, r in changes.items()}
    return {"table": name, "rules": dict(sorted(rules.items()))}


def describe_policy(policy: Any) -> dict[str, Any]:
    """A canonical, complete description of ``policy`` as plain data (see the module docstring).

    Example:
        >>> import funcamp
        >>> from funcamp.policy.describe import describe_policy
        >>> p = funcamp.get_policy("mixed_float16").with_op_rules({"softmax": funcamp.OpRule.COMPUTE})
        >>> d = describe_policy(p)
        >>> d["compute"], d["ops"]
        ('float16', {'table': 'default', 'rules': {'softmax': 'compute'}})
    """
    fp8 = policy.fp8
    return {
        "params": _dtype(policy.param_dtype),
        "compute": _dtype(policy.compute_dtype),
        "output": _dtype(policy.output_dtype),
        "ops": describe_ops(policy.ops),
        "modules": [[_module_key(k), describe_policy(sub)] for k, sub in policy.module_policies],
        "fp8": None
        if fp8 is None
        else {
            "recipe": fp8.recipe.kind,
            "history": fp8.recipe.history,
            "margin": fp8.recipe.margin,
            "modules": [_module_key(k) for k in fp8.modules],
            "exclude": [_module_key(k) for k in fp8.exclude],
        },
    }


def _dtype(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def policy_difference(saved: dict[str, Any], given: dict[str, Any], prefix: str = "") -> str | None:
    """The first difference between two :func:`describe_policy` descriptions, in words.

    It says what differs, and its value in ``saved`` (the checkpoint's) and in ``given``.
    ``None`` when they are equal.

    Example:
        >>> import funcamp
        >>> from funcamp.policy.describe import describe_policy, policy_difference
        >>> p = funcamp.get_policy("mixed_float16")
        >>> q = p.with_op_rules({"layer_norm": funcamp.OpRule.COMPUTE})
        >>> policy_difference(describe_policy(p), describe_policy(q))
        "op rule for 'layer_norm': 'float32' in the checkpoint, 'compute' in `policy`"
    """

    def say(what: str, a: Any, b: Any) -> str:
        return f"{prefix}{what}: {a!r} in the checkpoint, {b!r} in `policy`"

    for key in ("params", "compute", "output"):
        if saved.get(key) != given.get(key):
            return say(f"{key.removesuffix('s')} dtype", saved.get(key), given.get(key))
    ops_a, ops_b = saved.get("ops") or {}, given.get("ops") or {}
    if ops_a.get("table") != ops_b.get("table"):
        return say("op table", ops_a.get("table"), ops_b.get("table"))
    rules_a, rules_b = ops_a.get("rules") or {}, ops_b.get("rules") or {}
    for op in sorted(set(rules_a) | set(rules_b)):
        table = _table_rule(ops_a.get("table"), op)
        a, b = rules_a.get(op, table), rules_b.get(op, table)
        if a != b:
            return say(f"op rule for {op!r}", a, b)
    mods_a, mods_b = saved.get("modules") or [], given.get("modules") or []
    for i in range(max(len(mods_a), len(mods_b))):
        a = mods_a[i] if i < len(mods_a) else None
        b = mods_b[i] if i < len(mods_b) else None
        if a is None or b is None or a[0] != b[0]:
            return say(f"module rule #{i + 1}", a and a[0], b and b[0])
        found = policy_difference(a[1], b[1], f"{prefix}module rule {a[0]!r}: ")
        if found is not None:
            return found
    fp8_a, fp8_b = saved.get("fp8"), given.get("fp8")
    if fp8_a is None or fp8_b is None:
        return None if fp8_a == fp8_b else say("FP8", fp8_a, fp8_b)
    for key in (*fp8_a, *(k for k in fp8_b if k not in fp8_a)):
        if fp8_a.get(key) != fp8_b.get(key):
            return say(f"FP8 {key}", fp8_a.get(key), fp8_b.get(key))
    return None
