"""Data-parallel mixed-precision training with ``make_train_step(..., parallel=DataParallel(pg))``.

    torchrun --nproc-per-node 2 examples/train_ddp.py              # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_ddp.py --policy mixed_bfloat16   # GPUs: nccl
    python examples/train_ddp.py                                    # one process, no torchrun

Every rank builds the same initial params (same seed), draws the same global batch and trains on
its own equal shard of it. The compiled step averages the gradients over the ranks (one packed
all-reduce per step), agrees on skipping an overflowing step, and broadcasts rank 0's buffers, so
every rank holds the same state. The checkpoint is written by all ranks together with
``funcamp.save(..., group=...)`` (``torch.distributed.checkpoint`` underneath: each rank writes a
part, then rank 0 commits it atomically) into ``build/train_ddp/<policy>/`` (``--out``;
``<policy>`` the preset's canonical name: ``bf16-mixed`` and ``mixed_bfloat16`` share one), and
``--resume`` continues from it in any number of processes; ``funcamp.load`` refuses one saved
under another policy. A ``funcamp.ScaleCollapseGuard`` reads the metrics every ``--log-every``
steps and stops the run if the loss scale collapses.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call

import funcamp
import funcamp.distributed as fd

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples' shared setup
from _common import init_distributed, policy_name

#: The presets' canonical names, for file names: one spelling per policy in every example.


def main(argv: list[str] | None = None) -> float:
    """Train an MLP on a synthetic regression task; return the final global loss."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256, help="global batch (all ranks)")
    parser.add_argument("--policy", default="mixed_float16")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-steps per update")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("build/train_ddp"))
    parser.add_argument("--log-every", type=int, default=50, help="read the metrics every N steps")
    parser.add_argument("--patience", type=int, default=100, help="ScaleCollapseGuard patience")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args(argv)

    rank, world, device = init_distributed()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    shard = args.batch // world
    try:
        torch.manual_seed(0)  # the same initial params on every rank
        model = nn.Sequential(
            nn.Linear(32, 128), nn.LayerNorm(128), nn.GELU(), nn.Linear(128, 1)
        ).to(device)
        params, buffers = funcamp.params_and_buffers(model)
        opt = funcamp.adamw(3e-3)
        if args.accumulate > 1:
            opt = funcamp.accumulate(opt, every=args.accumulate)
        state = funcamp.TrainState.create(params, opt, args.policy, buffers=buffers)

        def loss_fn(params, buffers, batch):
            x, y = batch
            pred = functional_call(model, (params, buffers), (x,))
            return nn.functional.mse_loss(pred, y)

        step = funcamp.make_train_step(
            loss_fn,
            opt,
            args.policy,
            parallel=fd.DataParallel(dist.group.WORLD),
            compile=not args.no_compile,
        )

        policy = funcamp.get_policy(args.policy)
        ckpt_path = args.out / policy_name(policy)  # a directory: one per policy
        start = 0
        if args.resume and ckpt_path.exists():
            state = funcamp.load(ckpt_path, state, policy=policy, group=dist.group.WORLD)
            start = funcamp.checkpoint_info(ckpt_path).metadata["step"]
        guard = funcamp.ScaleCollapseGuard(patience=args.patience)

        data = torch.Generator().manual_seed(1)  # the same stream on every rank
        w_true = torch.randn(32, 1, generator=data) / 32**0.5
        losses, recent = [], []
        for i in range(args.steps):
            x = torch.randn(args.batch, 32, generator=data)
            y = torch.sin(x @ w_true) + 0.05 * torch.randn(args.batch, 1, generator=data)
            if i < start:
                continue  # replay the data stream up to the checkpoint
            mine = slice(rank * shard, (rank + 1) * shard)  # this rank's shard
            state, metrics = step(state, (x[mine].to(device), y[mine].to(device)))
            losses.append(metrics["loss"])  # the mean over ranks; no host sync here
            recent.append(metrics)
            if len(recent) == args.log_every or i == args.steps - 1:
                guard.check(state, recent)  # one host read every --log-every steps
                recent = []
        losses = torch.stack(losses).cpu() if losses else torch.zeros(1)
        funcamp.save(ckpt_path, state, policy=policy, group=dist.group.WORLD, step=args.steps)
        if rank == 0:
            print(
                f"{world} rank(s), policy {args.policy}: loss {losses[0].item():.4f} -> "
                f"{losses[-1].item():.4f} over {len(losses)} step(s); skipped "
                f"{int(state.scaler.skipped)}, scale {float(state.scaler.scale):g}"
            )
        return losses[-1].item()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
