"""Peak memory of a training step: funcamp's steps against torch.amp's, each in a fresh process.

    python benchmarks/memory.py                              # CPU: every model and variant
    python benchmarks/memory.py --models gpt256,gpt512 --variants torch_eager,funcamp
    python benchmarks/memory.py --device cuda                # torch.cuda.max_memory_allocated

Variants (Adam, lr 1e-4, bfloat16 compute, dynamic loss scaling on both sides):

    torch_eager            torch.autocast + GradScaler + torch.optim.Adam(foreach=True)
    torch_compiled         the same with torch.compile(model) (inductor)
    funcamp                funcamp.make_train_step(donate_state=False): compiled (inductor), pure
    funcamp_donated        make_train_step's default: compiled, the input state donated
    funcamp_eager          make_train_step(compile=False, donate_state=False)
    funcamp_eager_donated  make_train_step(compile=False): eager, donated (the default)
    funcamp_meta_module    (not run by default) funcamp, with the module's own parameters
                           released after params_and_buffers (model.to("meta")): what the
                           pure step costs when nothing else holds the first state

Models: ``mlp`` (MLP 512x3, batch 256), ``gpt256`` and ``gpt512`` (the GPT of
benchmarks/train_step.py with 4 layers, vocab 2048, d=256 or 512, batch 4x64: two sizes for the
linear-growth check) and ``gpt2hf`` (Hugging Face GPT-2 from a config: 4 layers, d=256, vocab
8192, tied head, batch 4x64; needs ``transformers``).

Every (model, variant) cell runs in a fresh process (this script with ``--cell``), so nothing one
variant allocated or cached can hide in another's numbers. In the cell, after the imports, the
process's memory high-water mark is reset (``/proc/self/clear_refs``) and its RSS taken as the
baseline; then the model is built and ``--steps`` steps run. On the CPU two processes per cell
measure two things:

    rss      peak RSS minus the baseline (``VmHWM``): over all steps, the first call's compile
             included (``rss_peak``), and over the steps after ``--warmup`` with the high-water
             mark reset once more (``rss_steady``); ``rss_step``: that steady high-water mark
             above the RSS at the start of the steady window (what a step adds to what is
             already resident: the compiler's residue of the first call, which differs between
             variants, is left out); ``rss_end``: the RSS after the last step.
             This is what the machine sees, glibc's heap included.
    tensors  the bytes of live tensors from torch's CPU allocator as its profiler reports
             them (``torch.profiler.profile(profile_memory=True)`` from before the model is
             built): ``tensor_steady``, the peak over the steps after the warm-up, and
             ``tensor_end``, what is live after the last step and a ``gc.collect()`` (the
             state at the step boundary). No Python heap, no compiler, no allocator slack: the memory the
             design is responsible for (frees the profiler misses are accounted for: see
             :func:`tensor_numbers`). Nothing calls ``gc.collect()`` (unless asked, below):
             what Python's cyclic garbage keeps alive between the steps is counted, as a
             training loop would see it.

With ``--device cuda`` one process per cell reads ``torch.cuda.max_memory_allocated`` (reset
after the imports and again after the warm-up) and ``memory_allocated`` at the end.

The table gives MiB, each variant's ratio to torch_eager, and its excess over torch_eager in
units of P, the model's float32 parameter bytes. The GPT pair gives the bytes per parameter each
variant's steady peak grows by from d=256 to d=512 (the "linear growth" check: funcamp's should
equal torch.amp's). ``--gc-after-first`` runs ``gc.collect()`` once after the first step of
every cell: a compiled step's first call leaves its inputs referenced from dynamo's tracing
garbage, which only Python's cyclic collector frees. Compiled cells take their compile time (a
minute or more each on a small CPU); ``TORCHINDUCTOR_CACHE_DIR`` defaults to
``build/inductor-cache``. Memory does not depend on the machine's load; the times this script
does not report would. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.func import functional_call

import funcamp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _machine  # noqa: E402
from train_step import GPT, MLP  # noqa: E402

VARIANTS = (
    "torch_eager",
    "torch_compiled",
    "funcamp",
    "funcamp_donated",
    "funcamp_eager",
    "funcamp_eager_donated",
)
#: Activation checkpointing per block (``--models gptlong``): ``_ckpt`` wraps each block in
#: ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, ``_remat`` in
#: ``funcamp.remat`` (policy "nothing"), ``_remat_matmuls`` in ``funcamp.remat(..., "matmuls")``.
CKPT_VARIANTS = (
    "torch_eager_ckpt",
    "torch_compiled_ckpt",
    "funcamp_donated_ckpt",
    "funcamp_donated_remat",
    "funcamp_donated_remat_matmuls",
    "funcamp_eager_donated_ckpt",
)
EXTRA_VARIANTS = ("funcamp_meta_module", *CKPT_VARIANTS)
MODELS = ("mlp", "gpt256", "gpt512", "gpt2hf")
EXTRA_MODELS = ("gptlong",)
MiB = 2**20


# ---------------------------------------------------------------------------- the cell (child)


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def _reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def build_model(name: str, device: str) -> tuple[Any, Any, Callable[[Any, Any], Any]]:
    """``(model, batch, forward_loss)``, seeded; ``forward_loss(call, batch)`` is the loss of
    the model called as ``call`` (the module itself, a compiled module or a functional call)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "mlp":
        model: Any = MLP()
        batch: Any = (torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g))

        def forward_loss(call: Any, batch: Any) -> Any:
            return F.mse_loss(call(batch[0]), batch[1])

    elif name in ("gpt256", "gpt512"):
        d = int(name[3:])
        model = GPT(vocab=2048, d=d, layers=4, heads=d // 64)
        idx = torch.randint(0, 2048, (4, 65), generator=g)
        batch = (idx[:, :-1], idx[:, 1:])

        def forward_loss(call: Any, batch: Any) -> Any:
            logits = call(batch[0])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    elif name == "gptlong":  # activation-heavy: long sequence, small width
        model = GPT(vocab=512, d=128, layers=4, heads=2)
        idx = torch.randint(0, 512, (8, 513), generator=g)
        batch = (idx[:, :-1], idx[:, 1:])

        def forward_loss(call: Any, batch: Any) -> Any:
            logits = call(batch[0])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))

    elif name == "gpt2hf":
        import transformers

        config = transformers.GPT2Config(
            n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=256,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
        model.loss_type = "ForCausalLM"  # else a logger call: a graph break
        ids = torch.randint(0, 8192, (4, 64), generator=g)
        batch = {"input_ids": ids, "labels": ids}

        def forward_loss(call: Any, batch: Any) -> Any:
            return call(**batch).loss

    else:
        raise SystemExit(
            f"memory.py: `--models` must name models of {MODELS + EXTRA_MODELS}, got {name!r}"
        )
    model = model.to(device).train()
    if isinstance(batch, dict):
        batch = {k: v.to(device) for k, v in batch.items()}
    else:
        batch = tuple(v.to(device) for v in batch)
    return model, batch, forward_loss


def torch_step(
    model: Any, batch: Any, forward_loss: Any, device: str, compiled: bool
) -> Callable[[], None]:
    """torch.amp's recipe: autocast(bf16) + GradScaler + Adam(foreach=True), updated in place."""

    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    scaler = torch.amp.GradScaler(device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward_loss(fwd, batch)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def funcamp_step(
    model: Any, batch: Any, forward_loss: Any, device: str, meta_module: bool, **options: Any
) -> Callable[[], None]:
    """funcamp's step as its README writes it; ``options`` go to make_train_step."""
    policy = funcamp.get_policy("mixed_bfloat16")
    opt = funcamp.adam(1e-4)

    def loss_fn(params: Any, buffers: Any, batch: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            return functional_call(model, (params, buffers), args, kwargs)

        return forward_loss(call, batch)

    params, buffers = funcamp.params_and_buffers(model)
    scaler = funcamp.ScalerState.dynamic(device=device)  # the same work as GradScaler's
    box = [funcamp.TrainState.create(params, opt, policy, buffers=buffers, scaler=scaler)]
    del params, buffers
    if meta_module:  # the state alone holds the first params: nothing keeps them later
        model.to("meta")
    step_fn = funcamp.make_train_step(loss_fn, opt, policy, **options)

    def step() -> None:
        box[0], _ = step_fn(box[0], batch)

    return step


class Checkpointed(torch.nn.Module):
    """A block whose activations are recomputed in the backward pass."""

    def __init__(self, block: torch.nn.Module, how: str) -> None:
        super().__init__()
        self.block = block
        self.how = how

    def forward(self, x: Any) -> Any:
        if self.how == "ckpt":
            return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)
        policy = "matmuls" if self.how == "remat_matmuls" else "nothing"
        return funcamp.remat(self.block, policy)(x)


def make_step(variant: str, model: Any, batch: Any, forward_loss: Any, device: str) -> Any:
    for how in ("remat_matmuls", "remat", "ckpt"):
        if variant.endswith("_" + how):
            if not hasattr(model, "blocks"):
                raise SystemExit(f"memory.py: {variant} needs a model with blocks (gpt*)")
            model.blocks = torch.nn.Sequential(*(Checkpointed(b, how) for b in model.blocks))
            variant = variant[: -len(how) - 1]
            break
    if variant.startswith("torch_"):
        return torch_step(model, batch, forward_loss, device, variant == "torch_compiled")
    options: dict[str, Any] = {}
    if "eager" in variant:
        options["compile"] = False
    options["donate_state"] = "donated" in variant  # make_train_step's default is donated
    return funcamp_step(
        model, batch, forward_loss, device, variant == "funcamp_meta_module", **options
    )


def param_bytes(model: Any) -> int:
    """Bytes of the model's parameters (each tensor once: a tied weight counts once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


#: The size of the marker allocation that splits the allocator's record at the warm-up's end.
_MARK_BYTES = 4093


def _allocations(prof: Any) -> list[tuple[int, int, int, int]]:
    """``(time ns, size, live bytes after it, address)`` of every allocation (size > 0) and free
    (size < 0) of torch's CPU allocator that the profiler saw, in order."""
    kind = torch._C._profiler._ExtraFields_Allocation
    out = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        f = event.extra_fields
        if isinstance(f, kind):
            out.append((event.start_time_ns, f.alloc_size, f.total_allocated, f.ptr))
        stack.extend(event.children)
    out.sort()
    return out


def _live_addresses() -> set[int]:
    """The data addresses of every CPU tensor Python can reach now."""
    gc.collect()
    out = set()
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                out.add(obj.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                continue
    return out


def tensor_numbers(events: list[tuple[int, int, int, int]], live: set[int]) -> dict[str, int]:
    """The live tensor bytes: the peak after the warm-up (after the marker's free) and at the
    end, corrected for frees the profiler did not see.

    The profiler records an allocator's free only on a thread it profiles (measured: a tensor
    freed by another thread stays allocated in its record). An allocation made before the
    steady window that the record never frees, and that no tensor reachable at the end holds
    (or whose address is given out again), is counted as freed before the window
    (``untracked_frees``: their bytes; 0 in every cell measured so far)."""
    marker = next(
        (i for i, (_, size, _, _) in enumerate(events) if size == -_MARK_BYTES), len(events)
    )
    held: dict[int, int] = {}
    for _, size, _, ptr in events[:marker]:
        if size > 0:
            held[ptr] = size
        else:
            held.pop(ptr, None)
    lost = 0
    for _, size, _, ptr in events[marker:]:
        if ptr in held:  # freed (seen), or its address given out again (the free unseen)
            n = held.pop(ptr)
            lost += n if size > 0 else 0
    lost += sum(n for ptr, n in held.items() if ptr not in live)
    totals = [t for _, _, t, _ in events[marker + 1 :]]
    return {
        "tensor_steady": max(totals, default=lost) - lost,
        "tensor_end": (totals[-1] if totals else lost) - lost,
        "untracked_frees": lost,
    }


class _Meter:
    """The cell's measurements: RSS always, CUDA's allocator on a GPU, the CPU allocator's
    record with ``tensors``."""

    def __init__(self, device: str, tensors: bool) -> None:
        self.cuda = device == "cuda"
        gc.collect()
        _reset_peak_rss()
        self.base_kib = _status_kib("VmRSS")
        self.window_kib = self.base_kib
        self.out: dict[str, int] = {}
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base_cuda = torch.cuda.memory_allocated()
        self.prof = None
        if tensors:
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self.prof.__enter__()

    def warm(self) -> None:
        """End of the warm-up: keep its peaks, reset the high-water marks."""
        self.out["rss_warmup"] = (_status_kib("VmHWM") - self.base_kib) * 1024
        _reset_peak_rss()
        self.window_kib = _status_kib("VmRSS")
        if self.cuda:
            torch.cuda.synchronize()
            self.out["cuda_warmup"] = torch.cuda.max_memory_allocated() - self.base_cuda
            torch.cuda.reset_peak_memory_stats()
        if self.prof is not None:
            marker = torch.empty(_MARK_BYTES, dtype=torch.uint8)  # allocated and freed
            del marker

    def finish(self) -> dict[str, int]:
        out = self.out
        out["rss_steady"] = (_status_kib("VmHWM") - self.base_kib) * 1024
        out["rss_step"] = (_status_kib("VmHWM") - self.window_kib) * 1024
        out["rss_peak"] = max(out["rss_steady"], out.pop("rss_warmup", 0))
        out["rss_end"] = (_status_kib("VmRSS") - self.base_kib) * 1024
        if self.cuda:
            torch.cuda.synchronize()
            out["cuda_steady"] = torch.cuda.max_memory_allocated() - self.base_cuda
            out["cuda_peak"] = max(out["cuda_steady"], out.pop("cuda_warmup", 0))
            out["cuda_end"] = torch.cuda.memory_allocated() - self.base_cuda
        if self.prof is not None:
            live = _live_addresses()
            self.prof.__exit__(None, None, None)
            out = {k: v for k, v in out.items() if not k.startswith("rss")}  # profiler's heap
            out.update(tensor_numbers(_allocations(self.prof), live))
        return out


def run_cell(args: argparse.Namespace) -> dict[str, Any]:
    """One (model, variant) cell, in this fresh process."""
    if args.cell[0] == "gpt2hf":
        import transformers  # noqa: F401
    model_name, variant = args.cell
    meter = _Meter(args.device, args.account == "tensors")
    model, batch, forward_loss = build_model(model_name, args.device)
    p_bytes = param_bytes(model)
    step = make_step(variant, model, batch, forward_loss, args.device)
    del model
    for i in range(args.steps):
        if i == args.warmup:
            meter.warm()
        step()
        if i == 0 and args.gc_after_first:
            gc.collect()
    out: dict[str, Any] = {"param_bytes": p_bytes, **meter.finish()}
    out["torch"] = torch.__version__
    return out


# ---------------------------------------------------------------------------- the parent


def run_child(model: str, variant: str, account: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one cell in a fresh process; its result, or ``{"error": ...}``."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--cell", model, variant]
    cmd += ["--device", args.device, "--account", account]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--gc-after-first"] if args.gc_after_first else []
    env = {**os.environ, "FUNCAMP_QUIET": "1", "PYTHONPATH": str(ROOT)}
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / "build" / "inductor-cache"))
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=args.cell_timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.cell_timeout} s"}
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def measure(args: argparse.Namespace) -> dict[str, dict[str, dict[str, Any]]]:
    accounts = ["cuda"] if args.device == "cuda" else ["rss", "tensors"]
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    for model in args.models:
        cells[model] = {}
        for variant in args.variants:
            row: dict[str, Any] = {}
            for account in accounts:
                result = run_child(model, variant, account, args)
                if "error" in result:
                    row.setdefault("errors", []).append(f"{account}: {result.pop('error')}")
                row.update(result)
            cells[model][variant] = row
            print(f"  {model}/{variant}: {_short(row)}", flush=True)
    return cells


def _short(row: dict[str, Any]) -> str:
    if "errors" in row:
        return "FAILED " + "; ".join(e.splitlines()[-1][:300] for e in row["errors"])
    keys = [k for k in COLUMNS if k in row]
    return ", ".join(f"{k} {row[k] / MiB:.1f} MiB" for k in keys)


#: The columns of the table, in order: the key and its heading.
COLUMNS = {
    "rss_peak": "RSS peak",
    "rss_steady": "RSS steady",
    "rss_step": "RSS step",
    "tensor_steady": "tensors steady",
    "tensor_end": "tensors at boundary",
    "cuda_peak": "CUDA peak",
    "cuda_steady": "CUDA steady",
    "cuda_end": "CUDA at boundary",
}
BASE = "torch_eager"


def summarize(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per model and variant: the ratio of each column to torch_eager's and the excess over it
    in units of P (the model's float32 parameter bytes)."""
    summary: dict[str, Any] = {}
    for model, rows in cells.items():
        base = rows.get(BASE, {})
        for variant, row in rows.items():
            p = row.get("param_bytes")
            for key in COLUMNS:
                if key in row and key in base and base[key] and p:
                    summary.setdefault(model, {}).setdefault(variant, {})[key] = {
                        "ratio": row[key] / base[key],
                        "excess_P": (row[key] - base[key]) / p,
                    }
    return summary


def linear_check(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Bytes per parameter each variant's steady peak grows by from gpt256 to gpt512."""
    small, large = cells.get("gpt256", {}), cells.get("gpt512", {})
    out: dict[str, Any] = {}
    for variant in small:
        a, b = small[variant], large.get(variant, {})
        if not a.get("param_bytes") or not b.get("param_bytes"):
            continue
        params = (b["param_bytes"] - a["param_bytes"]) / 4
        for key in ("rss_steady", "tensor_steady", "cuda_steady"):
            if key in a and key in b:
                out.setdefault(variant, {})[key] = (b[key] - a[key]) / params
    return out


def print_tables(results: dict[str, Any]) -> None:
    cells, summary = results["cells"], results["summary"]
    for model, rows in cells.items():
        p = next((r["param_bytes"] for r in rows.values() if "param_bytes" in r), 0)
        keys = [k for k in COLUMNS if any(k in r for r in rows.values())]
        print(f"\n{model}: P = {p / MiB:.1f} MiB of float32 params ({p // 4:,} params)")
        print(f"  {'variant':24s}" + "".join(f" {COLUMNS[k]:>22s}" for k in keys))
        for variant, row in rows.items():
            cols = []
            for k in keys:
                if k not in row:
                    cols.append(f" {'-':>22s}")
                    continue
                s = summary.get(model, {}).get(variant, {}).get(k)
                rel = f" {s['ratio']:.2f}x {s['excess_P']:+.1f}P" if s else ""
                cols.append(f" {row[k] / MiB:8.1f}{rel:>14s}")
            print(f"  {variant:24s}" + "".join(cols))
            for error in row.get("errors", []):
                print(f"    failed: {error.splitlines()[-1][:200]}")
    if results["linear"]:
        print("\nlinear growth, gpt256 -> gpt512: bytes per added parameter (steady peaks)")
        for variant, slopes in results["linear"].items():
            print(f"  {variant:24s} " + "  ".join(f"{k} {v:.1f}" for k, v in slopes.items()))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated: {MODELS + EXTRA_MODELS}"
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated: {VARIANTS + EXTRA_VARIANTS}",
    )
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="steps before the steady window")
    p.add_argument(
        "--gc-after-first",
        action="store_true",
        help="gc.collect() once after the first step (frees what dynamo's garbage still holds)",
    )
    p.add_argument("--cell-timeout", type=int, default=1200, help="seconds per process")
    p.add_argument("--out", type=Path, default=ROOT / "build" / "bench" / "memory.json")
    p.add_argument("--cell", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--account", default="rss", choices=["rss", "tensors", "cuda"],
                   help=argparse.SUPPRESS)  # fmt: skip
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    if not 0 < args.warmup < args.steps:
        p.error(f"`--warmup` must be in [1, --steps), got {args.warmup}")
    if args.cell:
        print("RESULT " + json.dumps(run_cell(args)), flush=True)
        return {}
    args.models = args.models.split(",")
    args.variants = args.variants.split(",")
    for v in args.variants:
        if v not in VARIANTS + EXTRA_VARIANTS:
            p.error(f"`--variants` must name variants of {VARIANTS + EXTRA_VARIANTS}, got {v!r}")
    if BASE not in args.variants:
        args.variants.insert(0, BASE)  # the ratios' reference
    machine = _machine.report(seconds=0.5)
    print(_machine.describe(machine) + " (memory does not depend on the load)", flush=True)
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
        print(f"GPU: {machine['gpu']}")
    cells = measure(args)
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "device": args.device,
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "cells": cells,
        "summary": summarize(cells),
        "linear": linear_check(cells),
    }
    print_tables(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    done = main()
    failed = any(
        "errors" in row for rows in done.get("cells", {}).values() for row in rows.values()
    )
    sys.exit(1 if failed else 0)
