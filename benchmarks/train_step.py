"""Train-step speed: funcamp's compiled step against torch.amp recipes, side by side.

    python benchmarks/train_step.py                      # CPU, both models
    python benchmarks/train_step.py --models mlp --rounds 15
    python benchmarks/train_step.py --device cuda        # adds (d) with mode="reduce-overhead"

In one process, with the same model, data and seed, it times the median ms/step (after warm-up)
of:

    (a) eager float32 + torch.optim.Adam
    (b) eager torch.autocast(bf16) + GradScaler + Adam(foreach=True)
    (c) torch.compile(model) + autocast(bf16) + GradScaler + Adam(foreach=True)
    (d) funcamp.make_train_step (compiled, mixed_bfloat16, dynamic loss scaling), the pure step
        (donate_state=False)
    (d, donated) the same with donate_state=True, make_train_step's default (results written
        into the old state's tensors)
    (d, donated, specialize) the same with specialize=True: only the guards on the inputs
        (the ratio of the two is what the guards on closures, globals and modules cost a call)
    (e) the same pure funcamp step, eager
    floor: the step's matmuls alone (recorded from one autocast forward/backward and replayed
        on ready-made tensors) plus one fused Adam pass over the params

Before timing each model it samples the machine for a second and prints whether it is quiet
(other processes' CPU use; ``--require-quiet`` stops instead of timing on a busy machine), with
the CPU model and the vector ISA torch uses: on a CPU without AVX512-BF16 every bfloat16
matmul is emulated and dominates all variants alike. Variants are timed in interleaved rounds (a, b, c, ... a, b, c, ...), so background load hits
them alike; the spread across rounds is reported next to the median. With ``--against REV``,
funcamp's (d) and (e) steps at git revision REV are timed too, in the same rounds (A/B for
"no regression" claims). Models: an MLP 512x3 at
batch 256, a small GPT (4 layers, d=256, 4 heads, seq 128, batch 8) and, with ``--models gpt12``,
a deeper one (12 layers, d=512, 8 heads). Each compiled variant's first call is split into where
its compile time went (torch's own timers: dynamo tracing, AOT autograd, inductor and, inside it,
scheduling/fusion, code generation and the C++ compiler). A cold compile needs an empty
``TORCHINDUCTOR_CACHE_DIR``; a warm start is a second process on the same cache directory.
Writes JSON to --out.

Real models (``--models gpt2,llama,bert,t5,vit,resnet,swin,mixtral``, and ``cnn``: small
Hugging Face configs from ``_real_models.py``) get first-call rows instead: each variant's first
call (the cold compile) in a fresh process on an empty ``TORCHINDUCTOR_CACHE_DIR`` of its own,
then a warm start (a second process on the same directory), the variants interleaved and their
order reversed every other round (``--cold-rounds``):

    funcamp          funcamp.make_train_step with its default options (inductor, fullgraph)
    funcamp_cache    the same with cache_dir= (warm: the compiled step is loaded, not traced)
    torch_model_opt  torch.compile(model) + compiled optimizer.step + autocast + GradScaler
                     (torch's "compile the optimizer" recipe: the same work as funcamp's step)
    torch_model      torch.compile(model) + autocast + GradScaler, eager AdamW(foreach=True)
    funcamp_fused    funcamp's step with funcamp.adamw(..., fused=True): torch's fused kernel,
                     called by the compiled step (opt-in: --variants ...,funcamp_fused)
    funcamp_unpatched  funcamp's step with compiler_patches=False: torch's compiler as it is
                     (opt-in: --variants ...,funcamp_unpatched)
    torch_model_fused  torch.compile(model) + autocast + GradScaler + AdamW(fused=True) (torch
                     does not compile a fused optimizer: the same work as funcamp_fused)

    python benchmarks/train_step.py --models gpt2,llama,bert,t5,vit,resnet,swin,mixtral
    python benchmarks/train_step.py --models gpt2 --cold-rounds 1 --variants funcamp,torch_model

It prints, per model, the median first call, the step itself (the median of the next three
calls) and where the compile went, and the ratios funcamp / torch_model_opt (the same work) and
funcamp / torch_model, cold and warm (funcamp_cache's warm start against the torch variants'
warm starts).
``--backend`` compiles every variant with another backend (``eager``: a quick check that the
script runs, no compile times).

``--optimizer adamw`` runs the step-time rows (mlp, gpt, gpt12) with AdamW on both sides
(``torch.optim.AdamW``, ``funcamp.adamw``; lr 1e-4, weight decay 0.01) instead of Adam;
``--compute float32`` runs them without bfloat16 (no autocast, funcamp's ``"float32"``
policy, the loss scaler kept on both sides): on a CPU without AVX512-BF16 every bfloat16
matmul is emulated and hides the rest of the step. The real models always use AdamW.

"No regression" for AdamW against a revision ``REV`` (e.g. the previous main), each next to
its A/A run (the working tree against its own ``HEAD``: the spread to read the A/B by; run it
on a clean tree):

    # steady step: funcamp's compiled steps, pure and donated, this tree and REV in the same
    # interleaved rounds ("this tree / REV" lines; < 1 is faster)
    python benchmarks/train_step.py --models mlp,gpt --optimizer adamw --compute float32 \
        --only d --against REV --rounds 15 --require-quiet
    python benchmarks/train_step.py --models mlp,gpt --optimizer adamw --compute float32 \
        --only d --against HEAD --rounds 15 --require-quiet
    # first call: cold compiles in fresh processes on empty caches, REV's step interleaved
    # with this tree's ("cold funcamp / funcamp@REV", "warm funcamp / funcamp@REV")
    python benchmarks/train_step.py --models gpt2,llama --variants funcamp --against REV \
        --cold-rounds 3 --require-quiet
    python benchmarks/train_step.py --models gpt2,llama --variants funcamp --against HEAD \
        --cold-rounds 3 --require-quiet

(The step-time rows' own "compile s" column is no A/B between revisions: the later of two
compiles in one process can reuse the kernels the earlier one built.) Leave out
``--compute float32`` on a CPU with AVX512-BF16 to time the mixed-precision recipe itself.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import compilation_time_metrics, counters
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

import funcamp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _machine
from _revision import import_revision, step_options

try:
    import _real_models
except ImportError:  # transformers is not installed: the real-model rows are not available
    _real_models = None  # type: ignore[assignment]

LOWP = torch.bfloat16
#: --optimizer: torch.optim's class for the torch variants and the floor, funcamp's factory name.
TORCH_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
#: --compute: the autocast dtype of the torch variants and the floor, funcamp's policy.
COMPUTE = {"bfloat16": (torch.bfloat16, "mixed_bfloat16"), "float32": (torch.float32, "float32")}


# ---------------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, width: int = 512, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(1024, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(layers)))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(pos))))


def build(name: str, device: str) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Any]:
    """(model, batch, criterion(output, target)) for a model name, seeded."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt12":  # the deeper row: 12 layers, d=512, 8 heads (seq 128, batch 8)
        model = GPT(d=512, layers=12, heads=8)
        idx = torch.randint(0, 512, (8, 129), generator=g)
        return model.to(device), (idx[:, :-1].to(device), idx[:, 1:].to(device)), _next_token
    if name == "mlp":
        model = MLP()
        x, y = torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)
        return model.to(device), (x.to(device), y.to(device)), F.mse_loss
    model = GPT()
    idx = torch.randint(0, 512, (8, 129), generator=g)
    return model.to(device), (idx[:, :-1].to(device), idx[:, 1:].to(device)), _next_token


def _next_token(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


# ---------------------------------------------------------------------------------- variants


def torch_variant(
    model: nn.Module,
    batch: Any,
    criterion: Any,
    device: str,
    *,
    amp: bool,
    compiled: bool,
    optimizer: str = "adam",
    lowp: torch.dtype = LOWP,
    backend: str = "inductor",
) -> Callable[[], Any]:
    """``amp``: autocast to ``lowp`` (none for float32: the GradScaler stays) and foreach."""
    model = copy.deepcopy(model)
    fwd = torch.compile(model, backend=backend) if compiled else model
    opt = TORCH_OPTIMIZERS[optimizer](model.parameters(), lr=1e-4, foreach=True if amp else None)
    scaler = torch.amp.GradScaler(device, enabled=amp)
    autocast = amp and lowp != torch.float32
    x, y = batch

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=lowp, enabled=autocast):
            loss = criterion(fwd(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return step


def funcamp_variant(
    model: nn.Module,
    batch: Any,
    criterion: Any,
    device: str,
    fc: Any = funcamp,
    *,
    optimizer: str = "adam",
    policy: str = "mixed_bfloat16",
    **compile_kw: Any,
) -> Callable[[], Any]:
    """funcamp's step; ``fc`` is the funcamp module to use (another revision with --against);
    ``optimizer`` is ``fc.adam`` or ``fc.adamw`` (lr 1e-4, their defaults otherwise)."""
    funcamp = fc
    model = copy.deepcopy(model)
    policy = funcamp.get_policy(policy)
    opt = getattr(funcamp, optimizer)(1e-4)

    def loss_fn(params: Any, buffers: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return criterion(functional_call(model, (params, buffers), (x,)), y)

    params, buffers = funcamp.params_and_buffers(model)
    scaler = funcamp.ScalerState.dynamic(device=device)  # the same work as GradScaler
    box = [funcamp.TrainState.create(params, opt, policy, buffers=buffers, scaler=scaler)]
    step_fn = funcamp.make_train_step(loss_fn, opt, policy, **step_options(fc, compile_kw))

    def step() -> Any:
        box[0], metrics = step_fn(box[0], batch)
        return metrics["loss"]

    return step


_MATMULS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}


class _RecordMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _MATMULS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def floor_variant(
    model: nn.Module,
    batch: Any,
    criterion: Any,
    device: str,
    optimizer: str = "adam",
    lowp: torch.dtype = LOWP,
) -> Callable[[], Any]:
    """The matmuls of one autocast forward/backward, replayed on fresh tensors of the same
    shapes and dtypes, plus one fused (else foreach) Adam (AdamW) pass over float32 params."""
    model = copy.deepcopy(model)
    x, y = batch
    rec = _RecordMatmuls()
    with rec, torch.autocast(device, dtype=lowp, enabled=lowp != torch.float32):
        loss = criterion(model(x), y)
    with rec:
        loss.backward()

    def fresh(a: Any) -> Any:
        return torch.randn_like(a) if isinstance(a, torch.Tensor) else a

    calls = [
        (f, tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kw.items()})
        for f, args, kw in rec.calls
    ]
    params = [p.detach().clone() for p in model.parameters()]
    for p, q in zip(params, model.parameters()):
        p.grad = q.grad.detach().clone()
    try:
        opt = TORCH_OPTIMIZERS[optimizer](params, lr=1e-4, fused=True)
        opt.step()
        fused = True
    except (RuntimeError, TypeError):
        opt = TORCH_OPTIMIZERS[optimizer](params, lr=1e-4, foreach=True)
        fused = False
    floor_variant.info = {"matmuls": len(calls), "fused_adam": fused}  # type: ignore[attr-defined]

    def step() -> Any:
        for f, args, kw in calls:
            f(*args, **kw)
        opt.step()

    return step


# ---------------------------------------------------------------------------------- timing


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


#: Where a first call's compile time goes: torch's own compile timers (seconds; nested, so the
#: phases overlap: inductor includes scheduling, codegen and C++).
PHASES = {
    "dynamo": "bytecode_tracing",
    "aot": "create_aot_dispatcher_function",
    "inductor": "compile_fx_inner",
    "scheduling": "Scheduler.__init__",
    "codegen": "Scheduler.codegen",
    "c++": "async_compile.wait",
}


def _phase_totals() -> dict[str, float]:
    return {k: sum(compilation_time_metrics.get(v, ())) for k, v in PHASES.items()}


def first_calls(step: Callable[[], Any], device: str, warmup: int) -> dict[str, Any]:
    """Run the first call (compile) and the warm-up; count graphs and breaks on the way, and
    where the first call's compile time went."""
    counters.clear()
    before = _phase_totals()
    t0 = time.perf_counter()
    step()
    sync(device)
    first = time.perf_counter() - t0
    after = _phase_totals()
    phases = {k: after[k] - before[k] for k in PHASES}
    for _ in range(warmup):
        step()
    sync(device)
    return {
        "first_call_s": first,
        "compile_phases_s": phases,
        "graphs": int(counters["stats"]["unique_graphs"]),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        # inductor's "skipping cudagraphs due to ..." (mode="reduce-overhead" on a GPU)
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


def time_rounds(
    steps: dict[str, Callable[[], Any]], device: str, iters: int, rounds: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            sync(device)
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            sync(device)
            times[name].append((time.perf_counter() - t0) / iters * 1e3)
    return times


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    device = args.device
    model, batch, criterion = build(name, device)
    lowp, policy = COMPUTE[args.compute]
    opt_kw = {"optimizer": args.optimizer}
    torch_kw = {**opt_kw, "lowp": lowp}
    fc_kw = {**opt_kw, "policy": policy}
    # --backend: the compiled variants' (eager/aot_eager: a quick check that the script runs)
    comp_kw = {} if args.backend == "inductor" else {"backend": args.backend}
    makers: dict[str, Callable[[], Callable[[], Any]]] = {
        "a_eager_fp32_adam": lambda: torch_variant(
            model, batch, criterion, device, amp=False, compiled=False, **torch_kw
        ),
        "b_eager_autocast_gradscaler": lambda: torch_variant(
            model, batch, criterion, device, amp=True, compiled=False, **torch_kw
        ),
        "c_compiled_model_autocast_gradscaler": lambda: torch_variant(
            model, batch, criterion, device, amp=True, compiled=True, **torch_kw, **comp_kw
        ),
        "d_funcamp_compiled": lambda: funcamp_variant(
            model, batch, criterion, device, donate_state=False, **fc_kw, **comp_kw
        ),
        "d_funcamp_compiled_donated": lambda: funcamp_variant(
            model, batch, criterion, device, donate_state=True, **fc_kw, **comp_kw
        ),
        "d_funcamp_compiled_donated_specialize": lambda: funcamp_variant(
            model, batch, criterion, device, donate_state=True, specialize=True, **fc_kw, **comp_kw
        ),
        "e_funcamp_eager": lambda: funcamp_variant(
            model, batch, criterion, device, compile=False, donate_state=False, **fc_kw
        ),
        "floor": lambda: floor_variant(model, batch, criterion, device, **torch_kw),
    }
    if args.against:
        old = import_revision(args.against)
        tag = f"@{args.against}"
        makers[f"d_funcamp_compiled{tag}"] = lambda: funcamp_variant(
            model, batch, criterion, device, old, donate_state=False, **fc_kw, **comp_kw
        )
        makers[f"d_funcamp_compiled_donated{tag}"] = lambda: funcamp_variant(
            model, batch, criterion, device, old, donate_state=True, **fc_kw, **comp_kw
        )
        makers[f"e_funcamp_eager{tag}"] = lambda: funcamp_variant(
            model, batch, criterion, device, old, compile=False, donate_state=False, **fc_kw
        )
    if device == "cuda":
        makers["d_funcamp_compiled_reduce_overhead"] = lambda: funcamp_variant(
            model, batch, criterion, device, mode="reduce-overhead", **fc_kw
        )
    steps, info = {}, {}
    for key, make in makers.items():
        if args.only and key[0] not in args.only and key != "floor":
            continue
        steps[key] = make()
        info[key] = first_calls(steps[key], device, args.warmup)
        phases = info[key]["compile_phases_s"]
        where = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if v >= 0.05)
        print(
            f"  {name}/{key}: first call {info[key]['first_call_s']:.1f}s"
            + (f" ({where})" if where else ""),
            flush=True,
        )
    info["floor"].update(getattr(floor_variant, "info", {}))
    machine = _machine.check(args.require_quiet)  # after compiling: before timing
    counters.clear()
    times = time_rounds(steps, device, args.iters, args.rounds)
    recompiles_while_timing = int(counters["stats"]["unique_graphs"])  # should stay 0
    rows = {}
    for key, ts in times.items():
        rows[key] = {
            "median_ms": statistics.median(ts),
            "min_ms": min(ts),
            "max_ms": max(ts),
            "rounds_ms": ts,
            **info[key],
        }
    d = rows.get("d_funcamp_compiled", {}).get("median_ms", math.nan)
    ratio = lambda k: rows[k]["median_ms"] / d if k in rows else math.nan  # noqa: E731
    dd = rows.get("d_funcamp_compiled_donated", {}).get("median_ms", math.nan)
    summary = {
        "speedup_d_over_b": ratio("b_eager_autocast_gradscaler"),
        "speedup_d_over_c": ratio("c_compiled_model_autocast_gradscaler"),
        "d_over_floor": d / rows["floor"]["median_ms"] if "floor" in rows else math.nan,
        "speedup_donated_over_b": ratio("b_eager_autocast_gradscaler") * d / dd,
        "speedup_donated_over_c": ratio("c_compiled_model_autocast_gradscaler") * d / dd,
        "donated_over_floor": dd / rows["floor"]["median_ms"] if "floor" in rows else math.nan,
        "graphs_compiled_while_timing": recompiles_while_timing,
        # every guard (the default) against only the inputs' (specialize=True): > 1 is the
        # per-call cost of the guards on closures, globals and module attributes
        "guards_default_over_specialize": dd
        / rows.get("d_funcamp_compiled_donated_specialize", {}).get("median_ms", math.nan),
    }
    if args.against:
        for key in list(rows):
            if key.endswith(f"@{args.against}"):
                new = key[: -len(args.against) - 1]
                if new in rows:
                    summary[f"{new}: this tree / {args.against}"] = (
                        rows[new]["median_ms"] / rows[key]["median_ms"]
                    )
    return {"rows": rows, "summary": summary, "machine": machine}


def print_table(name: str, result: dict[str, Any]) -> None:
    print(f"\n{name}")
    print(f"  {'variant':40s} {'median ms':>10s} {'min':>8s} {'max':>8s} {'compile s':>10s} "
          f"{'graphs':>6s} {'breaks':>6s}")  # fmt: skip
    for key, r in result["rows"].items():
        print(
            f"  {key:40s} {r['median_ms']:10.3f} {r['min_ms']:8.3f} {r['max_ms']:8.3f} "
            f"{r['first_call_s']:10.2f} {r['graphs']:6d} {r['graph_breaks']:6d}"
        )
    s = result["summary"]
    print(
        f"  (d) vs (b): {s['speedup_d_over_b']:.2f}x   (d) vs (c): {s['speedup_d_over_c']:.2f}x   "
        f"(d)/floor: {s['d_over_floor']:.2f}   graphs compiled while timing: "
        f"{s['graphs_compiled_while_timing']}"
    )
    print(
        f"  donated (d) vs (b): {s['speedup_donated_over_b']:.2f}x   vs (c): "
        f"{s['speedup_donated_over_c']:.2f}x   /floor: {s['donated_over_floor']:.2f}   "
        f"every guard / specialize=True: {s['guards_default_over_specialize']:.3f}"
    )
    skips = {k: r["cudagraph_skips"] for k, r in result["rows"].items() if r.get("cudagraph_skips")}
    if skips:
        print(f"  CUDA graphs skipped (see inductor's warnings above): {skips}")
    for key, value in s.items():
        if "this tree /" in key:
            print(f"  {key}: {value:.3f} (time ratio, < 1 is faster)")


# ---------------------------------------------------------------------- real models: first calls


def first_call_child(args: argparse.Namespace) -> dict[str, Any]:
    """One fresh process, one variant (``--first-call-child``): the first call, and the step
    itself (the median of the next three calls; ``compile_s`` is the difference)."""
    model, batch = _real_models.build(args.model)
    options: dict[str, Any] = {}
    if args.first_call_child == "funcamp_cache":
        options["cache_dir"] = str(Path(args.dir) / "steps")
    if args.backend != "inductor":
        options["backend"] = args.backend
    variant, _, rev = args.first_call_child.partition("@")
    if rev:  # funcamp@REV (--against REV): funcamp's default step as of git revision REV
        options["fc"] = import_revision(rev)
    step = _real_models.VARIANTS[variant](model, batch, **options)
    counters.clear()
    before = _phase_totals()
    t0 = time.perf_counter()
    loss = step()
    first = time.perf_counter() - t0
    after = _phase_totals()
    graphs = int(counters["stats"]["unique_graphs"])
    breaks = int(sum(counters["graph_break"].values()))
    skipped = bool(step.skipped())  # type: ignore[attr-defined]
    later = []
    for _ in range(3):
        t0 = time.perf_counter()
        step()
        later.append(time.perf_counter() - t0)
    second = statistics.median(later)  # the step itself
    result = {
        "first_s": first,
        "step_s": second,
        "compile_s": first - second,
        "phases_s": {k: after[k] - before[k] for k in PHASES},
        "graphs": graphs,
        "graph_breaks": breaks,
        "loss": float(loss),
        "first_step_skipped": skipped,  # then a compiled optimizer compiled on the second call
    }
    print("RESULT " + json.dumps(result), flush=True)
    return result


def run_first_call(
    variant: str, model: str, directory: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """``variant``'s first call in a fresh process whose compile caches live in ``directory``."""
    cmd = [sys.executable, __file__, "--first-call-child", variant, "--model", model]
    cmd += ["--dir", str(directory), "--backend", args.backend]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(directory / "inductor")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(lines[-1][len("RESULT ") :])


def _median(runs: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in runs if "error" not in r]
    return statistics.median(values) if values and len(values) == len(runs) else math.nan


def first_call_summary(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, float]:
    """Ratios of median first calls: funcamp against the same work and against the model alone,
    cold, warm, and funcamp's warm start from ``cache_dir``."""
    med = {(v, kind): _median(r[kind], "first_s") for v, r in runs.items() for kind in r}

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float:
        return med.get(a, math.nan) / med.get(b, math.nan)

    # --against REV: this tree's funcamp step against REV's, cold and warm (A/B; A/A: REV=HEAD)
    against = {
        f"{kind} funcamp / {v}": ratio(("funcamp", kind), (v, kind))
        for v in runs
        if v.startswith("funcamp@")
        for kind in ("cold", "warm")
    }
    return against | {
        "cold funcamp / torch_model_opt": ratio(("funcamp", "cold"), ("torch_model_opt", "cold")),
        "cold funcamp / torch_model": ratio(("funcamp", "cold"), ("torch_model", "cold")),
        "warm funcamp / torch_model_opt": ratio(("funcamp", "warm"), ("torch_model_opt", "warm")),
        "warm funcamp / torch_model": ratio(("funcamp", "warm"), ("torch_model", "warm")),
        "warm funcamp_cache / torch_model_opt": ratio(
            ("funcamp_cache", "warm"), ("torch_model_opt", "warm")
        ),
        "warm funcamp_cache / torch_model": ratio(
            ("funcamp_cache", "warm"), ("torch_model", "warm")
        ),
        "cold funcamp_fused / torch_model_opt": ratio(
            ("funcamp_fused", "cold"), ("torch_model_opt", "cold")
        ),
        "cold funcamp_fused / torch_model_fused": ratio(
            ("funcamp_fused", "cold"), ("torch_model_fused", "cold")
        ),
        "cold funcamp_unpatched / torch_model_opt": ratio(
            ("funcamp_unpatched", "cold"), ("torch_model_opt", "cold")
        ),
        "cold funcamp / funcamp_unpatched": ratio(
            ("funcamp", "cold"), ("funcamp_unpatched", "cold")
        ),
    }


_WARM_HEADER = """
import torch
torch.compile(lambda x: (x * 2).sin() + 1)(torch.randn(8))
"""
_HEADER_WARMED: list[bool] = []


def warm_shared_header(args: argparse.Namespace) -> None:
    """Build inductor's precompiled C++ header once, before any timed first call. torch keeps it
    outside ``TORCHINDUCTOR_CACHE_DIR`` (in the temp dir's ``torchinductor_<user>``, shared by
    every cache directory); without this the first variant timed on a machine would pay its
    build (~20 s on a 2-core AMD EPYC) and the others not."""
    if _HEADER_WARMED or args.backend != "inductor":
        return
    _HEADER_WARMED.append(True)
    directory = tempfile.mkdtemp(prefix="funcamp-warm-header-")
    try:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": directory}
        subprocess.run([sys.executable, "-c", _WARM_HEADER], env=env, capture_output=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def bench_first_calls(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """``--cold-rounds`` rounds of every variant's cold (and warm) first call, interleaved."""
    variants = [v for v in args.variants.split(",") if v]
    warm_shared_header(args)
    kinds = ("cold", "warm") if args.warm else ("cold",)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {v: {k: [] for k in kinds} for v in variants}
    machine = _machine.check(args.require_quiet)
    for r in range(args.cold_rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            directory = Path(tempfile.mkdtemp(prefix=f"funcamp-first-call-{name}-"))
            try:
                for kind in kinds:
                    res = run_first_call(v, name, directory, args)
                    runs[v][kind].append(res)
                    said = res.get("error") or f"first call {res['first_s']:.1f} s"
                    print(f"  {name} round {r + 1} {v} {kind}: {said}", flush=True)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    return {
        "kind": "first_call",
        "runs": runs,
        "summary": first_call_summary(runs),
        "machine": machine,
    }


def print_first_calls(name: str, result: dict[str, Any]) -> None:
    runs = result["runs"]
    n = max(len(k) for r in runs.values() for k in r.values())
    print(f"\n{name}: first call in s, median of {n} processes (cold: an empty compile cache each)")
    for v in runs:
        base, _, rev = v.partition("@")
        said = f"{_real_models.DESCRIPTIONS[base]}, as of git revision {rev}" if rev else ""
        print(f"  {v}: {said or _real_models.DESCRIPTIONS[v]}")
    print("| variant | cold first call (each) | compile | step | dynamo | graphs | breaks | warm |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for v, r in runs.items():
        failed = [x["error"] for x in r["cold"] + r.get("warm", []) if "error" in x]
        if failed:
            print(f"| {v} | failed: {failed[0]} |")
            continue
        cold = r["cold"]
        each = ", ".join(f"{x['first_s']:.1f}" for x in cold)
        dyn = statistics.median(x["phases_s"]["dynamo"] for x in cold)
        warm = f"{_median(r['warm'], 'first_s'):.1f}" if "warm" in r else "-"
        print(
            f"| {v} | {_median(cold, 'first_s'):.1f} ({each}) | {_median(cold, 'compile_s'):.1f} | "
            f"{_median(cold, 'step_s'):.2f} | {dyn:.1f} | {cold[0]['graphs']} | "
            f"{cold[0]['graph_breaks']} | {warm} |"
        )
    loaded = runs.get("funcamp_cache", {}).get("warm")
    if loaded and all("error" not in x for x in loaded):
        print(
            f"  funcamp_cache warm starts traced nothing: {all(x['graphs'] == 0 for x in loaded)}"
        )
    for key, value in result["summary"].items():
        if not math.isnan(value):
            print(f"  {key}: {value:.2f}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description="funcamp train-step benchmark")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--models",
        default="mlp,gpt",
        help="comma-separated: mlp, gpt, gpt12 (step time); gpt2, llama, bert, t5, vit, resnet, "
        "swin, mixtral, cnn (first calls)",
    )
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=20, help="steps per timed round")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--only", default="", help="variant letters to run, e.g. 'bcd' (+floor)")
    p.add_argument(
        "--against",
        default="",
        help="also time funcamp's (d) and (e) steps at this git revision, in the same process "
        "(real models: a funcamp@REV first-call variant, in fresh processes like the others)",
    )
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=sorted(TORCH_OPTIMIZERS),
        help="mlp/gpt/gpt12: every variant's optimizer (real models always use AdamW)",
    )
    p.add_argument(
        "--compute",
        default="bfloat16",
        choices=sorted(COMPUTE),
        help="mlp/gpt/gpt12: autocast dtype and funcamp policy (float32: no autocast, policy "
        "'float32', loss scaling kept; for CPUs that emulate bfloat16)",
    )
    p.add_argument(
        "--require-quiet",
        action="store_true",
        help="stop (exit 3) instead of timing when other processes keep the machine busy",
    )
    p.add_argument(
        "--cold-rounds", type=int, default=2, help="real models: fresh processes per variant"
    )
    p.add_argument(
        "--variants",
        default="funcamp,funcamp_cache,torch_model_opt,torch_model",
        help="real models: the first-call variants",
    )
    p.add_argument(
        "--no-warm",
        dest="warm",
        action="store_false",
        help="real models: no warm start after each cold process",
    )
    p.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile backend of every compiled variant (eager: a quick check that it runs)",
    )
    p.add_argument("--out", type=Path, default=Path("build/bench/train_step.json"))
    p.add_argument("--first-call-child", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.first_call_child:
        return first_call_child(args)
    if args.against:
        known = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{args.against}^{{commit}}"],
            cwd=Path(__file__).resolve().parent, capture_output=True,
        )  # fmt: skip
        if known.returncode != 0:
            p.error(f"--against: {args.against!r} is not a git revision of this repository")
    real = [m for m in args.models.split(",") if m not in ("mlp", "gpt", "gpt12")]
    if real and _real_models is None:
        p.error(f"--models {','.join(real)}: needs transformers (pip install transformers)")
    if real:
        unknown = [m for m in real if m not in _real_models.MODELS]
        if unknown:
            p.error(f"--models: unknown {unknown}; real models are {sorted(_real_models.MODELS)}")
        bad = [v for v in args.variants.split(",") if v and v not in _real_models.VARIANTS]
        if bad:
            p.error(f"--variants: unknown {bad}; choose from {sorted(_real_models.VARIANTS)}")
        if args.against:
            args.variants += f",funcamp@{args.against}"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "models": {},
    }
    for name in args.models.split(","):
        if name in real:
            print(f"{name}: first calls, each in a fresh process", flush=True)
            results["models"][name] = bench_first_calls(name, args)
            print_first_calls(name, results["models"][name])
            continue
        print(f"{name}: compiling and warming up", flush=True)
        results["models"][name] = bench_model(name, args)
        print_table(name, results["models"][name])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")
    return results


if __name__ == "__main__":
    main()
