"""Sharded training of a Hugging Face GPT-2 with ``make_train_step(..., parallel=fd.Sharded(mesh))``.

    torchrun --nproc-per-node 2 examples/train_sharded.py            # CPU: gloo, compiled
    torchrun --nproc-per-node 2 examples/train_sharded.py --no-compile --steps 50
    torchrun --nproc-per-node 8 examples/train_sharded.py            # GPUs: nccl
    python examples/train_sharded.py --no-compile                    # one process, no torchrun

The model and data are those of ``train_gpt2_chars.py`` (``GPT2LMHeadModel`` from a config,
character-level on the standard library's sources). ``funcamp.distributed.shard`` turns the
state into DTensors on a 1-D device mesh: every large leaf of the params and of the AdamW state
is split along dim 0, so each rank holds about 1/N of them (printed at the start). Every rank
draws the same global batch and trains on its own equal shard of it; the step all-gathers the
params for the forward, reduce-scatters the gradients, and updates its own shards. At the end
all ranks save the sharded state together (``funcamp.save(..., group=...)``, through
``torch.distributed.checkpoint``) into ``build/train_sharded/`` (``--out``); it loads on any
number of ranks, or in one process. Needs the ``transformers`` extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import funcamp
import funcamp.distributed as fd

# The model, data and optimizer of train_gpt2_chars.py, beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import init_distributed
from train_gpt2_chars import adamw_warmup_cosine, char_data, gpt2


def local_bytes(tree) -> int:
    """Bytes of the tensors of ``tree`` this rank holds (its shards of the DTensors)."""
    import optree
    from torch.distributed.tensor import DTensor

    total = 0
    for x in optree.tree_leaves(tree, namespace="funcamp"):
        if isinstance(x, torch.Tensor):
            t = x.to_local() if isinstance(x, DTensor) else x
            total += t.numel() * t.element_size()
    return total


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return the first and last global train loss."""

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="bf16-mixed")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="global batch (all ranks)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chars", type=int, default=400_000)
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--out", type=Path, default=Path("build/train_sharded"))
    args = p.parse_args(argv)

    rank, world, device = init_distributed()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must be divisible by the {world} ranks")
    try:
        mesh = init_device_mesh(device.type, (world,))
        vocab, _, data = char_data(args.chars)
        torch.manual_seed(0)
        model, loss_fn = gpt2(len(vocab), args.context, args.width, args.layers)
        model.to(device)
        params, buffers = funcamp.params_and_buffers(model)
        opt = adamw_warmup_cosine(args.lr, args.steps)
        policy = funcamp.get_policy(args.policy)
        full = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
        full_bytes = local_bytes((full.params, full.opt_state))
        state = fd.shard(full, mesh)  # rank 0's values, split along dim 0
        del full, params
        mine = local_bytes((state.params, state.opt_state))
        print(
            f"rank {rank}: params + AdamW state {mine / 2**20:.2f} MiB of "
            f"{full_bytes / 2**20:.2f} MiB ({mine / full_bytes:.1%}; 1/{world} = {1 / world:.1%})",
            flush=True,
        )
        step = funcamp.make_train_step(
            loss_fn, opt, policy, parallel=fd.Sharded(mesh), compile=not args.no_compile
        )

        g = torch.Generator().manual_seed(1)  # the same global batches on every rank
        shard = args.batch // world
        losses = []
        for i in range(args.steps):
            start = torch.randint(0, len(data) - args.context, (args.batch,), generator=g)
            ids = torch.stack([data[s : s + args.context] for s in start.tolist()])
            ids = ids[rank * shard : (rank + 1) * shard].to(device)  # this rank's shard
            state, metrics = step(state, {"input_ids": ids, "labels": ids})
            losses.append(metrics["loss"])  # global: the mean over ranks
            if rank == 0 and ((i + 1) % args.log_every == 0 or i + 1 == args.steps):
                print(f"step {i + 1}: loss {float(metrics['loss']):.3f}", flush=True)
        funcamp.save(args.out, state, policy=policy, group=dist.group.WORLD, step=args.steps)
        curve = [float(x) for x in losses]
        if rank == 0:
            print(
                f"{world} rank(s), policy {policy}: loss {curve[0]:.3f} -> {curve[-1]:.3f}; "
                f"skipped {int(state.scaler.skipped)}; checkpoint {args.out}"
            )
        return {"first": curve[0], "last": curve[-1], "fraction": mine / full_bytes}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
