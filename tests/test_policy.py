"""Policy and get_policy: grammar, canonical strings, casting, immutability, errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import funcamp
from funcamp import OpPolicy, OpRule, Policy, get_policy
from funcamp.policy.ops import OPS_BY_NAME
from funcamp.policy.text import PRESETS

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
FLOATS = st.sampled_from([F16, BF16, F32, F64])


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("float32", (F32, F32, F32)),
        ("bf16", (BF16, BF16, BF16)),
        ("half", (F16, F16, F16)),
        ("p=f32,c=bf16", (F32, BF16, BF16)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("c=bf16,o=full", (F32, BF16, F32)),
        ("p=bf16", (BF16, BF16, BF16)),
        (" P = F64 ", (F64, F64, F64)),
        ("mixed_float16", (F32, F16, F32)),
        ("16-mixed", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("bf16-mixed", (F32, BF16, F32)),
        ("bf16-true", (BF16, BF16, BF16)),
        ("32-true", (F32, F32, F32)),
        ("torch.bfloat16", (BF16, BF16, BF16)),
    ],
)
def test_get_policy_grammar(spec: str, expected: tuple[torch.dtype, ...]) -> None:
    p = get_policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == expected
    assert p.ops == OpPolicy.default() and p.module_policies == ()


def test_str_is_canonical_and_shows_every_override() -> None:
    p = get_policy("c=bf16,o=f32")
    assert str(p) == "params=float32,compute=bfloat16,output=float32"
    assert repr(p) == "Policy('params=float32,compute=bfloat16,output=float32')"
    q = p.with_op_rules({"softmax": OpRule.COMPUTE}).with_module_policies({"enc.*": "f32"})
    assert str(q) == (
        "params=float32,compute=bfloat16,output=float32,ops.softmax=compute,"
        "module:enc.*=(params=float32,compute=float32,output=float32)"
    )
    assert repr(q) == f"Policy({str(q)!r})" and get_policy(str(q)) == q


@settings(max_examples=50, deadline=None)
@given(param=FLOATS, compute=FLOATS, output=FLOATS)
def test_str_round_trips(param: torch.dtype, compute: torch.dtype, output: torch.dtype) -> None:
    p = Policy(param, compute, output)
    assert get_policy(str(p)) == p
    assert hash(get_policy(str(p))) == hash(p)


@pytest.mark.parametrize(
    ("spec", "dtypes", "ops", "text"),
    [
        (
            "autocast_cpu",
            (F32, BF16, F32),
            "cpu",
            "compute=bfloat16,output=float32,ops=autocast_cpu",
        ),
        ("autocast_cuda", (F32, F16, F32), "cuda", "compute=float16,output=float32"),
        ("c=bf16,ops=autocast_cpu", (F32, BF16, BF16), "cpu", "output=bfloat16,ops=autocast_cpu"),
        ("c=bf16,ops=none", (F32, BF16, BF16), "none", "output=bfloat16,ops=none"),
        ("c=bf16,ops=default", (F32, BF16, BF16), "default", "output=bfloat16"),
    ],
)
def test_op_tables_by_name_round_trip(
    spec: str, dtypes: tuple[torch.dtype, ...], ops: str, text: str
) -> None:
    """An ``ops=`` part names torch's tables; str names them back (the default by omission), so
    str round-trips these policies, and repr, which starts with str, shows the table once."""
    tables = {
        "cpu": OpPolicy.autocast("cpu"),
        "cuda": OpPolicy.autocast("cuda"),
        "none": OpPolicy.none(),
        "default": OpPolicy.default(),
    }
    p = get_policy(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == dtypes and p.ops == tables[ops]
    assert str(p).endswith(text) and get_policy(str(p)) == p
    assert repr(p) == f"Policy({str(p)!r})"
    # A table with overrides prints as the table and the override.
    q = p.with_op_rules({"softmax": OpRule.COMPUTE})
    assert str(q).endswith(",ops.softmax=compute") and get_policy(str(q)) == q


def test_autocast_without_a_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.autocast's defaults depend on the device: ``"autocast"`` names none, so it is
    refused on every machine, naming the two presets that pin one."""
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        with pytest.raises(ValueError, match=r"'autocast' names no device.*'autocast_cpu'.*"):
            get_policy("autocast")
    assert get_policy("autocast_cuda") == get_policy("mixed_float16")


def test_unknown_op_table_lists_the_names() -> None:
    with pytest.raises(ValueError, match=r"unknown op table 'cpu'.*ops=autocast_cpu"):
        get_policy("c=bf16,ops=cpu")
    with pytest.raises(ValueError, match="duplicate key 'ops'"):
        get_policy("ops=none,ops=default")


def test_policies_are_immutable_values() -> None:
    p = get_policy("mixed_bfloat16")
    q = p.with_op_rules({"softmax": OpRule.COMPUTE})
    r = p.with_module_policies({"enc.*": "float32"})
    assert p.ops["softmax"] is OpRule.FLOAT32 and q.ops["softmax"] is OpRule.COMPUTE
    assert p.module_policies == () and r.module_policies == (("enc.*", get_policy("float32")),)
    assert p == get_policy("mixed_bfloat16") and p != q and p != r
    assert len({p, q, r, get_policy("bf16-mixed")}) == 3
    with pytest.raises(AttributeError):
        p.compute_dtype = F32  # type: ignore[misc]
    # Same key again replaces, and keeps one entry.
    r2 = r.with_module_policies({"enc.*": "bf16"})
    assert r2.module_policies == (("enc.*", get_policy("bf16")),)


# -- casting ----------------------------------------------------------------------------------
def _leaf() -> Any:
    return st.one_of(
        st.sampled_from([F16, BF16, F32, F64]).map(lambda d: torch.ones(2, dtype=d)),
        st.sampled_from([torch.int32, torch.int64, torch.bool, torch.uint8]).map(
            lambda d: torch.zeros(2, dtype=d)
        ),
        st.sampled_from([None, 1, 2.5, "s", F32]),
    )


TREES = st.recursive(
    _leaf(),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.sampled_from("abc"), children, max_size=3),
    ),
    max_leaves=8,
)


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    import optree

    return optree.tree_flatten(tree, none_is_leaf=True)


@settings(max_examples=50, deadline=None)
@given(tree=TREES, policy=st.builds(Policy, FLOATS, FLOATS, FLOATS))
def test_cast_functions_preserve_structure_and_non_floating_leaves(
    tree: Any, policy: Policy
) -> None:
    before, spec = _flatten(tree)
    casts = [
        (policy.cast_to_param, policy.param_dtype, True),
        (policy.cast_to_compute, policy.compute_dtype, True),
        (policy.cast_to_output, policy.output_dtype, True),
        (lambda t: funcamp.tree_cast(t, policy.compute_dtype), policy.compute_dtype, False),
    ]
    for cast, dtype, keeps_float64 in casts:
        after, spec_after = _flatten(cast(tree))
        assert spec_after == spec
        for old, new in zip(before, after):
            if not (isinstance(old, torch.Tensor) and old.is_floating_point()):
                assert new is old
            elif old.dtype == F64 and dtype != F64 and keeps_float64:
                assert new is old  # float64 is left alone unless asked for
            else:
                assert new.dtype == dtype
                if old.dtype == dtype:
                    assert new is old


# -- errors -------------------------------------------------------------------------------------
def test_unknown_dtype_name() -> None:
    with pytest.raises(ValueError, match=r"funcamp.get_policy: unknown dtype name 'f8'; valid"):
        get_policy("c=f8")
    with pytest.raises(ValueError, match=r"unknown policy 'int8'.*bfloat16"):
        get_policy("int8")


@pytest.mark.parametrize(
    "typo, suggestion",
    [
        ("mixed_bfloat", "mixed_bfloat16"),
        ("bf16_mixed", "bf16-mixed"),
        ("mixed-float16", "mixed_float16"),
        ("bf16true", "bf16-true"),
        ("flaot32", "float32"),
    ],
)
def test_preset_typo_lists_the_presets_and_suggests_one(typo, suggestion) -> None:
    with pytest.raises(ValueError) as info:
        get_policy(typo)
    msg = str(info.value)
    assert msg.startswith(f"funcamp.get_policy: unknown policy {typo!r}; ")
    assert f"did you mean {suggestion!r}?" in msg
    assert "dtype name" not in msg.split(";")[0]  # not reported as a bad dtype name
    for preset in ("mixed_float16", "16-mixed", "mixed_bfloat16", "bf16-mixed", "bf16-true"):
        assert preset in msg
    assert get_policy(suggestion) is not None  # the suggestion is valid


@pytest.mark.parametrize(
    "typo, mixed, pure",
    [
        ("fp16", "mixed_float16", "f16"),
        ("float16-mixed", "mixed_float16", "f16"),  # not difflib's 'bf16-mixed'
        ("bfp16", "mixed_bfloat16", "bf16"),
    ],
)
def test_half_typos_suggest_the_mixed_preset_first(typo, mixed, pure) -> None:
    """'fp16' is not in jmp's grammar; its closest name, 'f16', puts the params in float16 too.
    Most who write it mean mixed precision: that comes first, the pure dtype second."""
    with pytest.raises(ValueError) as info:
        get_policy(typo)
    msg = str(info.value)
    assert f"did you mean {mixed!r} (params float32, " in msg
    assert msg.index(repr(mixed)) < msg.index(f"or {pure!r} (params, compute and output all")
    assert get_policy(mixed).param_dtype == torch.float32
    assert get_policy(pure).param_dtype != torch.float32


def test_unknown_word_without_close_match_has_no_suggestion() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'xyzzy'; presets: ") as info:
        get_policy("xyzzy")
    assert "did you mean" not in str(info.value)


def test_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"unknown key 'x' in 'x=f32'.*p\|params"):
        get_policy("x=f32")


def test_duplicate_key() -> None:
    with pytest.raises(ValueError, match=r"duplicate key 'compute' in 'c=bf16,compute=f16'"):
        get_policy("c=bf16,compute=f16")


def test_bad_parts_and_types() -> None:
    with pytest.raises(ValueError, match=r"bad part 'bf16' in 'p=f32,bf16'"):
        get_policy("p=f32,bf16")
    with pytest.raises(ValueError, match=r"empty policy spec"):
        get_policy("  ")
    with pytest.raises(TypeError, match=r"`spec` must be a str"):
        get_policy(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["bf16", torch.int32, 16, None])
def test_non_dtype_policy_field(value: Any) -> None:
    with pytest.raises(TypeError, match=r"funcamp.Policy: `compute_dtype` must be a floating"):
        Policy(compute_dtype=value)


def test_rule_that_is_not_an_oprule() -> None:
    p = get_policy("mixed_bfloat16")
    with pytest.raises(TypeError, match=r"the rule for 'softmax' must be an OpRule.*got str"):
        p.with_op_rules({"softmax": "compute"})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match=r"funcamp.OpPolicy: the rule for 'linear' must be"):
        OpPolicy({"linear": 1})  # type: ignore[dict-item]


@pytest.mark.parametrize("key", [3, nn.Linear(2, 2), int, None])
def test_module_key_neither_module_class_nor_string(key: Any) -> None:
    with pytest.raises(TypeError, match=r"module keys must be torch.nn.Module subclasses"):
        get_policy("mixed_bfloat16").with_module_policies({key: "float32"})


def test_module_policy_value_and_empty_glob() -> None:
    p = get_policy("mixed_bfloat16")
    with pytest.raises(TypeError, match=r"the policy for 'enc' must be a Policy or a policy"):
        p.with_module_policies({"enc": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"module path glob must not be empty"):
        p.with_module_policies({"": "f32"})


# -- str(policy) says what runs: get_policy(str(p)) == p ------------------------------------------
PRESET_NAMES = [*sorted(PRESETS), "float32", "bf16", "f16", "f64"]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_round_trips(name: str) -> None:
    p = get_policy(name)
    assert get_policy(str(p)) == p and hash(get_policy(str(p))) == hash(p)
    assert "<" not in str(p)


def test_fsdp_presets_cast_at_entry() -> None:
    for name, dtype in (("fsdp_bfloat16", BF16), ("fsdp_float16", F16)):
        p = get_policy(name)
        assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (F32, dtype, F32)
        assert p.ops == OpPolicy.cast_at_entry() and p.ops.casts_at_entry and len(p.ops) == 0
        assert str(p).endswith(",ops=cast_at_entry")
    # no rules, like ops=none, but a different table: the entry cast is part of it
    assert OpPolicy.cast_at_entry() != OpPolicy.none()
    assert hash(OpPolicy.cast_at_entry()) != hash(OpPolicy.none())
    q = get_policy("fsdp_bfloat16").with_op_rules({"softmax": OpRule.FLOAT32})
    assert q.ops.casts_at_entry and q.ops["softmax"] is OpRule.FLOAT32
    assert (
        str(q)
        == "params=float32,compute=bfloat16,output=float32,ops=cast_at_entry,ops.softmax=float32"
    )


_NAMED_OPS = sorted({k for table in OPS_BY_NAME.values() for k in table if isinstance(k, str)})
_RULES = st.sampled_from(list(OpRule))
_TABLES = st.sampled_from(list(OPS_BY_NAME))
_GLOBS = st.sampled_from(["enc.*", "layers.[01].attn", "Head", "*.norm", "mlp.?", "a.b.c"])


@st.composite
def _named_policies(draw: Any, depth: int = 1) -> Policy:
    """Policies every part of which has a name: any dtypes and named table, op rules by name
    (removals included), module policies by glob (nested), FP8 by globs."""
    name = draw(_TABLES if depth else _TABLES.filter(lambda t: t != "cast_at_entry"))
    table = OPS_BY_NAME[name]  # (a module policy cannot cast at entry)
    changes = draw(st.dictionaries(st.sampled_from(_NAMED_OPS), st.none() | _RULES, max_size=4))
    removed = {op for op, rule in changes.items() if rule is None}
    items = {k: r for k, r in table.items() if k not in removed}
    items.update({op: rule for op, rule in changes.items() if rule is not None})
    ops = OpPolicy(items, _entry=table.casts_at_entry)
    p = Policy(draw(FLOATS), draw(FLOATS), draw(FLOATS), ops=ops)
    if depth:
        subs = draw(st.dictionaries(_GLOBS, _named_policies(depth - 1), max_size=2))
        p = p.with_module_policies(subs)
    if draw(st.booleans()):
        recipe = draw(
            st.sampled_from([funcamp.Fp8Recipe.current()])
            | st.builds(funcamp.Fp8Recipe.delayed, st.integers(1, 64), st.integers(0, 4))
        )
        modules = draw(st.just((nn.Linear,)) | st.lists(_GLOBS, max_size=2).map(tuple))
        p = p.with_fp8(recipe, modules=modules, exclude=tuple(draw(st.lists(_GLOBS, max_size=2))))
    return p


@settings(max_examples=200, deadline=None)
@given(policy=_named_policies())
def test_str_round_trips_every_named_part(policy: Policy) -> None:
    """Op rules by name (on any table, removals included), module policies by glob (nested, in
    order) and FP8 by globs: ``get_policy(str(p)) == p``, and the text has no marker."""
    text = str(policy)
    assert "<" not in text
    again = get_policy(text)
    assert again == policy and hash(again) == hash(policy) and str(again) == text
    assert repr(policy) == f"Policy({text!r})"


def _user_op(x: torch.Tensor) -> torch.Tensor:
    return x


@pytest.mark.parametrize(
    ("policy", "marker", "fix"),
    [
        (
            get_policy("mixed_bfloat16").with_module_policies({nn.LayerNorm: "float32"}),
            "module:<class torch.nn.modules.normalization.LayerNorm>=(params=float32,",
            "with_module_policies",
        ),
        (
            get_policy("mixed_bfloat16").with_op_rules({_user_op: OpRule.FLOAT32}),
            "ops.<op test_policy._user_op>=float32",
            "with_op_rules",
        ),
        (
            get_policy("mixed_bfloat16").with_module_policies({"a,b": "float32"}),
            "module:<glob a?b>=(",
            "glob without",
        ),
        (
            get_policy("mixed_bfloat16").with_fp8(
                funcamp.Fp8Recipe.current(), modules=(nn.Conv1d,)
            ),
            "fp8=current,fp8.modules=(<class torch.nn.modules.conv.Conv1d>)",
            "with_fp8",
        ),
        (  # nested: a class key inside a glob's module policy
            get_policy("float32").with_module_policies(
                {"enc": get_policy("bf16").with_module_policies({nn.GELU: "f32"})}
            ),
            "module:enc=(params=bfloat16,compute=bfloat16,output=bfloat16,module:<class ",
            "with_module_policies",
        ),
    ],
    ids=["module-class", "callable-op", "odd-glob", "fp8-class", "nested"],
)
def test_parts_without_text_form_are_marked_and_refused(
    policy: Policy, marker: str, fix: str
) -> None:
    """A part with no text form prints as a marker (so ``str`` never reads as the policy
    without it), and ``get_policy`` refuses the marker, saying how to build that part."""
    text = str(policy)
    assert marker in text
    with pytest.raises(ValueError, match=r"has no text form") as info:
        get_policy(text)
    assert fix in str(info.value)


def test_module_overrides_are_visible_in_str() -> None:
    """Module overrides print in their order (later globs win), with their own overrides."""
    p = get_policy("mixed_float16").with_module_policies(
        {"head": "float32", "*.norm": get_policy("bf16").with_op_rules({"gelu": OpRule.FLOAT32})}
    )
    assert str(p) == (
        "params=float32,compute=float16,output=float32,"
        "module:head=(params=float32,compute=float32,output=float32),"
        "module:*.norm=(params=bfloat16,compute=bfloat16,output=bfloat16,ops.gelu=float32)"
    )
    assert get_policy(str(p)).module_policies == p.module_policies


def test_grammar_accepts_what_str_writes_loosely() -> None:
    """Keys and words in any case; op names and globs as written; fp8's shorthand."""
    p = get_policy(" C=BF16 , OPS=Autocast_CPU , ops.softmax=COMPUTE , module:Enc.*=( f32 ) ")
    assert p.ops == OpPolicy.autocast("cpu").with_rules({"softmax": OpRule.COMPUTE})
    assert p.module_policies == (("Enc.*", get_policy("f32")),)
    q = get_policy("c=bf16,o=f32,fp8=delayed")
    assert q.fp8.recipe == funcamp.Fp8Recipe.delayed() and q.fp8.modules == (nn.Linear,)
    assert get_policy("p=f32,ops.linear=unlisted").ops == OpPolicy(
        {k: r for k, r in OpPolicy.default().items() if k != "linear"}
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("c=bf16,ops.softmax=fast", r"unknown op rule 'fast' in 'ops.softmax=fast'.*unlisted"),
        ("c=bf16,ops.no_such_op=compute", r"unknown op name 'no_such_op'"),
        ("c=bf16,ops.softmax=compute,ops.softmax=none", r"duplicate key 'ops.softmax'"),
        ("c=bf16,module:enc=(f32", r"unbalanced parentheses"),
        ("c=bf16,module:enc=f32", r"the value must be in \(...\)"),
        ("c=bf16,module:enc=(f32),module:enc=(bf16)", r"duplicate key 'module:enc'"),
        ("c=bf16,module:enc=(c=f8)", r"unknown dtype name 'f8'"),
        ("c=bf16,fp8=later", r"bad FP8 recipe.*fp8=delayed\(history=16,margin=0\)"),
        ("c=bf16,fp8.exclude=(head)", r"fp8.modules or fp8.exclude without fp8="),
        ("c=bf16,fp8=delayed(history=0,margin=0)", r"`history` must be an int >= 1"),
        ("c=bf16,color=red", r"unknown key 'color'.*ops.NAME"),
    ],
)
def test_bad_parts_name_the_part(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        get_policy(spec)


def test_a_module_policy_cannot_cast_at_entry() -> None:
    """Params are cast where the whole function is entered: a module policy that casts at entry
    would cast the module's inputs and not its params (a bfloat16 input, a float32 weight)."""
    for outer in ("mixed_bfloat16", "fsdp_bfloat16"):
        with pytest.raises(ValueError, match=r"the module policy for 'head' casts at entry"):
            get_policy(outer).with_module_policies({"head": "fsdp_float16"})
    with pytest.raises(ValueError, match=r"casts at entry"):
        get_policy("c=bf16,module:head=(c=f32,ops=cast_at_entry)")
    # a table of rules under cast at entry is fine: the head's ops upcast the rounded params
    p = get_policy("fsdp_bfloat16").with_module_policies({"head": "float32"})
    assert get_policy(str(p)) == p
