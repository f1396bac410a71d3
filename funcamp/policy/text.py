"""A policy as text: the grammar ``get_policy`` reads and ``str(policy)`` writes.

jmp's grammar (comma-separated ``key=value``: ``params``, ``compute``, ``output`` and dtype
names), the presets, and funcamp's parts on top of it, each one a part of the policy:

* ``ops=TABLE``: the named op table (``default`` by omission);
* ``ops.NAME=RULE``: an op rule on top of the table (``compute``, ``float32``, ``promote``,
  ``none``, or ``unlisted`` for an op the table lists and the policy does not);
* ``module:GLOB=(POLICY)``: a module policy keyed by a module-path glob, in order;
* ``fp8=current`` or ``fp8=delayed(history=H,margin=M)``, ``fp8.modules=(GLOB,...)`` (when not
  ``torch.nn.Linear``) and ``fp8.exclude=(GLOB,...)``: the FP8 linears.

A part with no text form (an op given as a callable funcamp knows no name of, a module class, a
glob holding one of ``,=()<>``) prints as a marker in angle brackets, which ``get_policy``
refuses: a policy never prints as one without that part.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, NamedTuple

import torch

from funcamp.policy.fp8 import Fp8Recipe
from funcamp.policy.ops import OPS_BY_NAME, UNLISTED, OpKey, OpRule, closest_table

__all__ = [
    "AUTOCAST",
    "PRESETS",
    "Parsed",
    "parse_dtype",
    "parse_parts",
    "policy_text",
    "unknown_name",
]

DTYPE_NAMES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "float32": torch.float32,
    "full": torch.float32,
    "f16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "f64": torch.float64,
    "float64": torch.float64,
}
CANONICAL_NAME = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}
PRESETS = {
    "mixed_float16": "params=float32,compute=float16,output=float32",
    "16-mixed": "params=float32,compute=float16,output=float32",
    "mixed_bfloat16": "params=float32,compute=bfloat16,output=float32",
    "bf16-mixed": "params=float32,compute=bfloat16,output=float32",
    "bf16-true": "params=bfloat16,compute=bfloat16,output=bfloat16",
    "16-true": "params=float16,compute=float16,output=float16",
    "32-true": "params=float32,compute=float32,output=float32",
    "64-true": "params=float64,compute=float64,output=float64",
    "autocast_cpu": "params=float32,compute=bfloat16,output=float32,ops=autocast_cpu",
    "autocast_cuda": "params=float32,compute=float16,output=float32,ops=autocast_cuda",
    "fsdp_bfloat16": "params=float32,compute=bfloat16,output=float32,ops=cast_at_entry",
    "fsdp_float16": "params=float32,compute=float16,output=float32,ops=cast_at_entry",
}
#: Refused: torch.autocast's defaults depend on the device, which a policy string does not name.
AUTOCAST = "autocast"
_RULES = {rule.value: rule for rule in OpRule}
_NO_TEXT = re.compile(r"[,=()<>]")
_DELAYED = re.compile(r"delayed(?:\(history=(\d+),margin=(\d+)\))?")


# -- writing ------------------------------------------------------------------------------------
def _op_text(op: OpKey) -> str:
    if isinstance(op, str) and op and not _NO_TEXT.search(op) and op == op.strip():
        return op
    module = getattr(op, "__module__", None) or "?"
    name = getattr(op, "__qualname__", None) or getattr(op, "__name__", None) or "?"
    return f"<op {module}.{_NO_TEXT.sub('?', name)}>"


def _module_text(key: Any) -> str:
    if isinstance(key, str):
        if key and not _NO_TEXT.search(key) and key == key.strip():
            return key
        return f"<glob {_NO_TEXT.sub('?', key)}>"
    return f"<class {key.__module__}.{_NO_TEXT.sub('?', key.__qualname__)}>"


def _ops_parts(ops: Any) -> list[str]:
    name, changes = closest_table(ops)
    parts = [] if name == "default" else [f"ops={name}"]
    rules = sorted((_op_text(op), UNLISTED if r is None else r.value) for op, r in changes.items())
    return parts + [f"ops.{op}={rule}" for op, rule in rules]


def _fp8_parts(fp8: Any) -> list[str]:
    recipe = fp8.recipe
    text = (
        "current"
        if recipe.kind == "current"
        else f"delayed(history={recipe.history},margin={recipe.margin})"
    )
    parts = [f"fp8={text}"]
    if fp8.modules != (torch.nn.Linear,):
        parts.append(f"fp8.modules=({','.join(_module_text(k) for k in fp8.modules)})")
    if fp8.exclude:
        parts.append(f"fp8.exclude=({','.join(_module_text(k) for k in fp8.exclude)})")
    return parts


def policy_text(policy: Any) -> str:
    """``str(policy)``: every part of ``policy`` in the grammar of the module docstring."""
    parts = [
        f"params={CANONICAL_NAME[policy.param_dtype]}",
        f"compute={CANONICAL_NAME[policy.compute_dtype]}",
        f"output={CANONICAL_NAME[policy.output_dtype]}",
        *_ops_parts(policy.ops),
    ]
    for key, sub in policy.module_policies:
        parts.append(f"module:{_module_text(key)}=({policy_text(sub)})")
    if policy.fp8 is not None:
        parts.extend(_fp8_parts(policy.fp8))
    return ",".join(parts)


# -- reading ------------------------------------------------------------------------------------
def parse_dtype(name: str, *, api: str = "get_policy") -> torch.dtype:
    """Parse a dtype name (``f32|float32|full``, ``f16|float16|half``, ``bf16|bfloat16``,
    ``f64|float64``).

    Example (every policy string goes through it):
        >>> import funcamp
        >>> funcamp.get_policy("params=f32,compute=bf16,output=f32").compute_dtype
        torch.bfloat16
    """
    key = name.strip().lower()
    if key.startswith("torch."):
        key = key[len("torch.") :]
    try:
        return DTYPE_NAMES[key]
    except KeyError:
        raise ValueError(
            f"funcamp.{api}: unknown dtype name {name!r}; valid names are "
            + ", ".join(sorted(DTYPE_NAMES))
        ) from None


class Parsed(NamedTuple):
    """The parts of a policy string, as plain values (``get_policy`` builds the policy)."""

    dtypes: dict[str, torch.dtype]
    table: str
    rules: dict[str, OpRule | None]  # None: unlisted
    modules: list[tuple[str, str]]  # (glob, the module policy's text)
    fp8: tuple[Fp8Recipe, tuple[str, ...] | None, tuple[str, ...]] | None


def split_parts(spec: str, text: str) -> list[str]:
    """``text`` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
        if depth < 0:
            break
    if depth != 0:
        raise ValueError(spec_help(f"unbalanced parentheses in {spec!r}"))
    return [*parts, text[start:].strip()]


def _no_text_form(spec: str, part: str) -> ValueError:
    kind = part.split("<", 1)[1].split(" ", 1)[0]
    fix = {
        "op": "Policy.with_op_rules({fn: OpRule...}) (an op given as a callable funcamp knows "
        "no name of)",
        "class": "Policy.with_module_policies({ModuleClass: ...}) or with_fp8(..., "
        "modules=(ModuleClass,)) (a module class)",
        "glob": "a module-path glob without , = ( ) < > (module names as named_modules() gives "
        "them never hold one)",
    }.get(kind, "the Python API")
    return ValueError(
        f"funcamp.get_policy: the part {part!r} of {spec!r} has no text form: str(policy) "
        f"marks it so, and a string cannot rebuild it; build that part in Python with {fix}"
    )


def _parenthesized(spec: str, part: str, value: str) -> str:
    if not (value.startswith("(") and value.endswith(")")):
        raise ValueError(spec_help(f"bad part {part!r} in {spec!r}: the value must be in (...)"))
    return value[1:-1].strip()


def _globs(spec: str, part: str, value: str) -> tuple[str, ...]:
    inner = _parenthesized(spec, part, value)
    return tuple(g.strip() for g in inner.split(",")) if inner else ()


def _recipe(spec: str, part: str, value: str) -> Fp8Recipe:
    if value == "current":
        return Fp8Recipe.current()
    found = _DELAYED.fullmatch(value)
    if found is None:
        raise ValueError(
            f"funcamp.get_policy: bad FP8 recipe in {part!r} of {spec!r}; valid: fp8=current, "
            "fp8=delayed, fp8=delayed(history=16,margin=0)"
        )
    if found.group(1) is None:
        return Fp8Recipe.delayed()
    return Fp8Recipe.delayed(int(found.group(1)), int(found.group(2)))


def _op_rule(spec: str, part: str, value: str) -> OpRule | None:
    if value == UNLISTED:
        return None
    if value not in _RULES:
        raise ValueError(
            f"funcamp.get_policy: unknown op rule {value!r} in {part!r} of {spec!r}; valid: "
            + ", ".join([*_RULES, UNLISTED])
        )
    return _RULES[value]


def parse_parts(spec: str, text: str) -> Parsed:
    """The ``key=value`` parts of ``text`` (``spec`` with its preset resolved), checked."""
    out = Parsed({}, "default", {}, [], None)
    seen: set[str] = set()
    fp8: dict[str, Any] = {}
    for part in split_parts(spec, text):
        if "<" in part:
            raise _no_text_form(spec, part)
        key, eq, value = part.partition("=")
        if not eq:
            raise ValueError(spec_help(f"bad part {part!r} in {spec!r}: expected key=value"))
        key, value = key.strip(), value.strip()
        low = key.lower()
        name = low if low in KEYS or low in ("ops", "fp8", "fp8.modules", "fp8.exclude") else key
        if low.startswith("ops."):
            name = "ops." + key[4:].strip()
        elif low.startswith("module:"):
            name = "module:" + key[7:].strip()
        field = KEYS.get(name, name)
        if field in seen:
            raise ValueError(spec_help(f"duplicate key {key!r} in {spec!r}"))
        seen.add(field)
        if name in KEYS:
            out.dtypes[field] = parse_dtype(value)
        elif name == "ops":
            if value.lower() not in OPS_BY_NAME:
                raise ValueError(
                    f"funcamp.get_policy: unknown op table {value!r} in {spec!r}; valid: "
                    + ", ".join(f"ops={table}" for table in OPS_BY_NAME)
                )
            out = out._replace(table=value.lower())
        elif name.startswith("ops.") and len(name) > 4:
            out.rules[name[4:]] = _op_rule(spec, part, value.lower())
        elif name.startswith("module:") and len(name) > 7:
            out.modules.append((name[7:], _parenthesized(spec, part, value)))
        elif name == "fp8":
            fp8["recipe"] = _recipe(spec, part, value.lower())
        elif name in ("fp8.modules", "fp8.exclude"):
            fp8[name[4:]] = _globs(spec, part, value)
        else:
            raise ValueError(spec_help(f"unknown key {key!r} in {spec!r}"))
    if fp8 and "recipe" not in fp8:
        raise ValueError(spec_help(f"fp8.modules or fp8.exclude without fp8=... in {spec!r}"))
    if fp8:
        out = out._replace(fp8=(fp8["recipe"], fp8.get("modules"), fp8.get("exclude", ())))
    return out


def unknown_name(spec: str, text: str) -> str:
    """A bare word that is neither a preset nor a dtype name: list both, suggest the closest."""
    presets = sorted({*PRESETS, "float32"})
    close = difflib.get_close_matches(text, [*presets, *DTYPE_NAMES], n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    half = "bfloat16" if "bf" in text else "float16" if "16" in text else None
    if half is not None and (  # "fp16", "float16-mixed": most mean the mixed preset
        not close or close[0] in DTYPE_NAMES or ("bf" in close[0]) != (half == "bfloat16")
    ):
        short = "bf16" if half == "bfloat16" else "f16"
        hint = (
            f"did you mean 'mixed_{half}' (params float32, compute {half}: mixed precision) or "
            f"{short!r} (params, compute and output all {half})? "
        )
    return (
        f"funcamp.get_policy: unknown policy {spec!r}; {hint}presets: {', '.join(presets)}; "
        f"dtype names (one dtype for params, compute and output): "
        f"{', '.join(sorted(DTYPE_NAMES))}; or key=value parts such as "
        "'params=float32,compute=bfloat16'"
    )


def autocast_refused(spec: str) -> str:
    return (
        f"funcamp.get_policy: {spec!r} names no device, and torch.autocast's defaults differ "
        "by device; say 'autocast_cpu' (torch.autocast('cpu'): bfloat16 with CPU's op lists) or "
        "'autocast_cuda' (torch.autocast('cuda'): float16 with CUDA's op lists)"
    )


def spec_help(problem: str) -> str:
    return (
        f"funcamp.get_policy: {problem}. Valid: comma-separated key=value with keys "
        "p|params, c|compute, o|output (dtypes f32|float32|full, f16|float16|half, "
        "bf16|bfloat16, f64|float64), ops (" + "|".join(OPS_BY_NAME) + "), ops.NAME "
        "(compute|float32|promote|none|unlisted), module:GLOB=(policy), fp8, fp8.modules, "
        "fp8.exclude; a bare dtype; or a preset (" + ", ".join(sorted({*PRESETS, "float32"})) + ")"
    )
