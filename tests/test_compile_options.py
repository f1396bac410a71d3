"""The inductor options funcamp gives a train step it compiles for the CPU.

A step compiled for the CPU turns off inductor's loop ordering after fusion (measured: the same
output code on all nine models of the real-model suite, and up to 2.6 s less of a 26-97 s first call;
docs/benchmarks.md). The option is chosen on the first call, from the state's device; an
option the caller gives wins, and other backends get none.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch.func import functional_call

import funcamp
from funcamp.train.compiling import (
    CPU_STEP_OPTIONS,
    EAGER_CASTS_OPTIONS,
    FP8_STEP_OPTIONS,
    compile_fn,
    fresh_code,
    rounds_casts,
    step_options_for,
)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace torch.compile by a recorder that returns the function itself (eager)."""
    calls: list[dict[str, Any]] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def _run_step(**compile_options: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.sgd(0.1)

    def loss_fn(p: Any, b: Any, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, (p, b), (x,)).float().square().mean()

    state = funcamp.TrainState.create(params, opt, "float32", buffers=buffers)
    step = funcamp.make_train_step(
        loss_fn, opt, "float32", compile=funcamp.Compile(**compile_options)
    )
    state, metrics = step(state, torch.randn(3, 4))
    assert torch.isfinite(metrics["loss"])


def test_a_cpu_step_is_compiled_without_loop_ordering_after_fusion(monkeypatch):
    calls = _spy(monkeypatch)
    _run_step()
    assert len(calls) == 1
    options = calls[0]["options"]
    assert options["loop_ordering_after_fusion"] is False
    assert "guard_filter_fn" not in options  # every guard kept (specialize=False)
    assert calls[0]["fullgraph"] is True


def test_the_callers_inductor_option_wins(monkeypatch):
    calls = _spy(monkeypatch)
    _run_step(options={"loop_ordering_after_fusion": True})
    assert calls[0]["options"]["loop_ordering_after_fusion"] is True


def test_a_mode_keeps_its_own_options_and_gets_the_cpu_default(monkeypatch):
    calls = _spy(monkeypatch)
    _run_step(mode="max-autotune-no-cudagraphs")
    options = calls[0]["options"]
    assert options["max_autotune"] is True  # the mode, spelled out as options
    assert options["loop_ordering_after_fusion"] is False
    assert calls[0]["mode"] is None


def test_another_backend_gets_no_inductor_options(monkeypatch):
    calls = _spy(monkeypatch)
    _run_step(backend="aot_eager")
    assert "loop_ordering_after_fusion" not in (calls[0]["options"] or {})


def test_only_the_cpu_gets_them():
    assert step_options_for("cpu", "inductor") == CPU_STEP_OPTIONS
    assert step_options_for("cuda", "inductor") == {}
    assert step_options_for("cpu", "aot_eager") == {}


def test_a_low_precision_step_rounds_every_cast_on_every_device(monkeypatch):
    """A step whose policy computes, stores or returns float16/bfloat16 values or runs FP8
    linears, or whose state carries a loss scaler, compiles with inductor rounding every cast
    as eager code does (EAGER_CASTS_OPTIONS, under the caller's options); a float32 step does
    not (tests/test_compiled_scaling.py: what it changes)."""
    assert EAGER_CASTS_OPTIONS == FP8_STEP_OPTIONS == {"emulate_precision_casts": True}
    assert step_options_for("cuda", "inductor", eager_casts=True) == EAGER_CASTS_OPTIONS
    assert step_options_for("cpu", "inductor", eager_casts=True) == {
        **CPU_STEP_OPTIONS,
        **EAGER_CASTS_OPTIONS,
    }
    assert step_options_for("cpu", "aot_eager", eager_casts=True) == {}
    f32 = funcamp.get_policy("float32")
    assert not rounds_casts(f32)
    assert rounds_casts(f32.with_module_policies({torch.nn.Linear: "bf16-true"}))
    calls = _spy(monkeypatch)
    fp8 = funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.current())
    dynamic = funcamp.ScalerState.dynamic
    exact = funcamp.Compile(options={"emulate_precision_casts": False})
    for policy, options, scaler in [(fp8, {}, None), ("mixed_bfloat16", {}, None),
                                    ("16-true", {}, None), ("float32", {}, None),
                                    ("float32", {}, dynamic()),
                                    (fp8, {"compile": exact}, None)]:  # fmt: skip
        state = funcamp.TrainState.create(
            {"w": torch.ones(2)}, funcamp.sgd(0.1), policy, scaler=scaler
        )
        step = funcamp.make_train_step(
            lambda p, b, x: (x.to(p["w"].dtype) @ p["w"]).sum(), funcamp.sgd(0.1), policy,
            **options,
        )  # fmt: skip
        step(state, torch.ones(3, 2))
    rounded = [(kw["options"] or {}).get("emulate_precision_casts") for kw in calls]
    assert rounded == [True, True, True, None, True, False]  # the caller's own setting wins


def _double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_inductor_compiles_with_the_option_in_force():
    """torch itself applies the option while it compiles (read inside a post-grad pass)."""
    seen: list[bool] = []

    def record(graph: Any) -> None:
        seen.append(torch._inductor.config.loop_ordering_after_fusion)

    for device_type in ("cpu", "cuda"):  # "cuda": the torch default, whatever the device
        # a function of its own each time (dynamo keeps its compiled code per code object)
        fn = compile_fn(
            types.FunctionType(fresh_code(_double_plus_one.__code__), globals()),
            {"options": {"post_grad_custom_post_pass": record}, "dynamic": False},
            device_type,
        )
        x = torch.arange(5.0)
        torch.testing.assert_close(fn(x), x * 2 + 1)
    assert seen == [False, torch._inductor.config.loop_ordering_after_fusion]
