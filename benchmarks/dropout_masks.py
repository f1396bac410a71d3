"""What compiled dropout with eager code's masks costs (issue 58, inductor's ``fallback_random``).

    python benchmarks/dropout_masks.py                # wall clock, torch's threads
    python benchmarks/dropout_masks.py --cpu-time     # one thread, CPU time (a loaded machine)

Inductor generates a compiled step's dropout masks itself unless ``fallback_random`` is on; with
it (``funcamp.Compile(options={"fallback_random": True})``) the compiled code calls torch's eager
kernels and draws eager code's masks (docs/differences.md#dropout-masks). This times both ways,
in interleaved rounds in one process: a GPT-like train step (2 layers of width 128, sequence 64,
batch 16, float32, three dropouts a layer counting attention's), and dropout of a 16x64x512
tensor alone. ``--cpu-time`` runs one thread and counts this thread's CPU time, which other
processes on the machine disturb less than the wall clock. Prints the median and minimum of each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import _machine
import torch
import torch.nn.functional as F
from torch import nn

import funcamp

WIDTH, HEADS, LAYERS, SEQ, BATCH, VOCAB, P = 128, 4, 2, 64, 16, 256, 0.1
VARIANTS = {"inductor's random": {}, "fallback_random": {"fallback_random": True}}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x)).view(BATCH, SEQ, 3, HEADS, WIDTH // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(BATCH, SEQ, WIDTH)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def _steps() -> dict[str, Callable[[], Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH), *[Block() for _ in range(LAYERS)], nn.Linear(WIDTH, VOCAB)
    )
    params = funcamp.params_and_buffers(model)[0]

    def loss_fn(p: Any, b: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = torch.func.functional_call(model, (p, b), (x,))
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    gen = torch.Generator().manual_seed(1)
    batch = tuple(torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2))
    calls = {}
    for name, options in VARIANTS.items():
        opt = funcamp.adamw(1e-3)
        compile = funcamp.Compile(options=options)
        step = funcamp.make_train_step(loss_fn, opt, "float32", compile=compile)
        run = [funcamp.TrainState.create({k: v.clone() for k, v in params.items()}, opt, "float32")]

        def call(step: Any = step, run: list[Any] = run) -> None:
            run[0], _ = step(run[0], batch)

        calls[f"train step, {name}"] = call
    return calls


def _dropouts() -> dict[str, Callable[[], Any]]:
    x = torch.randn(BATCH, SEQ, 4 * WIDTH)
    calls = {}
    for name, options in VARIANTS.items():
        fn = torch.compile(lambda x: F.dropout(x, P, training=True) * 2 + 1, options=options)
        calls[f"dropout alone, {name}"] = lambda fn=fn: fn(x)
    return calls


def _time(calls: dict[str, Callable[[], Any]], rounds: int, iters: int, clock: Any) -> None:
    for call in calls.values():  # compile, and warm up
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(calls)[::-1]
        for name in order:
            start = clock()
            for _ in range(iters):
                calls[name]()
            times[name].append((clock() - start) / iters * 1e3)
    for name, ms in times.items():
        print(f"{name}: median {statistics.median(ms):.2f} ms, min {min(ms):.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--iters", type=int, default=10, help="calls per timed round")
    p.add_argument("--cpu-time", action="store_true", help="one thread, this thread's CPU time")
    p.add_argument("--require-quiet", action="store_true")
    args = p.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    print(f"threads: {torch.get_num_threads()}, clock: {'CPU time' if args.cpu_time else 'wall'}")
    steps, dropouts = _steps(), _dropouts()
    _machine.check(args.require_quiet)  # after building: before timing
    _time(steps, args.rounds, args.iters, clock)
    _time(dropouts, args.rounds, args.iters * 4, clock)


if __name__ == "__main__":
    main()
