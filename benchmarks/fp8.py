"""FP8 linears (``Policy.with_fp8``) against bf16: step time on a GPU, accuracy everywhere.

A stack of ``--layers`` Linear(width, width)+ReLU blocks (matmul-bound at width 4096) trained
with ``funcamp.make_train_step`` (compiled, AdamW) under ``mixed_bfloat16`` and under the same
policy with FP8 linears (current and delayed scaling); where ``torchao`` is importable, its
``convert_to_float8_training`` on the same model (bf16 autocast, compiled, ``torch.optim.AdamW``)
too. Prints the median step time of each and the speed-up over bf16 (goal on an H100/H200 for
4096-wide linears: >= 1.3x).

On CPU torch emulates the FP8 matmuls (``torch._scaled_mm`` casts and multiplies in float32), so
CPU times say nothing about FP8 hardware: there the script prints correctness numbers (the
signal-to-quantization-noise ratio of the forward output and of the weight gradient against
float32, for bf16 and each FP8 recipe) and the emulated times only for reference.

Run: ``python benchmarks/fp8.py --device cuda`` (defaults there: width 4096, 4 layers, 8192
tokens) or ``python benchmarks/fp8.py`` (CPU: width 256, 2 layers, 256 rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

import funcamp


def make_model(width: int, layers: int, device: str) -> nn.Module:
    torch.manual_seed(0)
    blocks = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*blocks).to(device)


def loss_of(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (out.float() - y).square().mean()


POLICIES = {
    "bf16": funcamp.get_policy("mixed_bfloat16"),
    "fp8 current": funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.current()),
    "fp8 delayed": funcamp.get_policy("mixed_bfloat16").with_fp8(funcamp.Fp8Recipe.delayed(16)),
}


def funcamp_step(policy: funcamp.Policy, model: nn.Module, compile: bool) -> tuple[Any, Any]:
    def loss_fn(params: Any, buffers: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return loss_of(functional_call(model, (params, buffers), (x,)), y)

    opt = funcamp.adamw(1e-4)
    params, buffers = funcamp.params_and_buffers(model)
    params = {k: v.clone() for k, v in params.items()}
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers, model=model)
    return funcamp.make_train_step(loss_fn, opt, policy, compile=compile), state


def torchao_step(model: nn.Module) -> Any:
    """torchao's float8 training on a copy of ``model``, or None without torchao."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return None
    import copy

    m = convert_to_float8_training(copy.deepcopy(model))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=m[0].weight.is_cuda)
    device = m[0].weight.device.type

    @torch.compile
    def fwd_bwd(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, torch.bfloat16):
            loss = loss_of(m(x), y)
        loss.backward()
        return loss

    def step(batch: Any) -> torch.Tensor:
        loss = fwd_bwd(*batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(run: Any, device: str, steps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        run()
    sync(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's ``compute_error``)."""
    ref, x = ref.double(), x.double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def out_and_grad(policy: funcamp.Policy | None) -> tuple[torch.Tensor, torch.Tensor]:
        fn = lambda p: functional_call(model, p, (x,))  # noqa: E731
        if policy is None:
            run = fn
            fp8 = funcamp.Fp8State()
        else:
            run = funcamp.amp(fn, policy)
            fp8 = funcamp.Fp8State.init(model, policy)
        staged = funcamp.with_fp8_state(run)
        if policy is not None and policy.fp8 is not None and policy.fp8.recipe.stateful:
            # one calibration step: delayed scales from this batch's amaxes
            g = torch.func.grad(lambda s: loss_of(staged(s, params), y))(fp8)
            fp8 = funcamp.fp8_update(fp8, g)
        out = staged(fp8, params)
        grad = torch.func.grad(lambda p: loss_of(staged(fp8, p), y))(params)
        return out, grad["0.weight"]

    ref_out, ref_grad = out_and_grad(None)
    for name, policy in POLICIES.items():
        out, grad = out_and_grad(policy)
        print(
            f"  {name:12s} SQNR vs float32: output {sqnr(ref_out, out):5.1f} dB, "
            f"first-layer weight grad {sqnr(ref_grad, grad):5.1f} dB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None, help="rows per batch")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    width = args.width or (4096 if gpu else 256)
    layers = args.layers or (4 if gpu else 2)
    tokens = args.tokens or (8192 if gpu else 256)
    steps = args.steps or (20 if gpu else 5)
    device = args.device
    name = torch.cuda.get_device_name() if gpu else "CPU (FP8 emulated: times not meaningful)"
    print(f"torch {torch.__version__} on {name}; width {width}, {layers} layers, {tokens} rows")

    model = make_model(width, layers, device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, width, device=device, generator=gen)
    y = torch.randn(tokens, width, device=device, generator=gen)

    print("accuracy (one forward/backward):")
    accuracy(make_model(min(width, 512), 2, device), x[:256, : min(width, 512)], y[:256, :512])

    print(f"median step time over {steps} steps ({'eager' if args.no_compile else 'compiled'}):")
    results: dict[str, float] = {}
    for label, policy in POLICIES.items():
        step, state = funcamp_step(policy, model, not args.no_compile)
        holder = [state]

        def run(step: Any = step, holder: list[Any] = holder) -> None:
            holder[0], _ = step(holder[0], (x, y))

        results[label] = time_steps(run, device, steps)
    ao = torchao_step(model)
    if ao is not None:
        results["torchao float8"] = time_steps(lambda: ao((x, y)), device, steps)
    else:
        print("  (torchao not importable: no torchao row)")
    base = results["bf16"]
    for label, seconds in results.items():
        print(f"  {label:15s} {seconds * 1e3:9.2f} ms   speed-up over bf16 {base / seconds:5.2f}x")


if __name__ == "__main__":
    main()
