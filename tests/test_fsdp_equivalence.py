"""``ops=cast_at_entry`` (``fsdp_bfloat16``, ``fsdp_float16``) against FSDP2's
``MixedPrecisionPolicy(param_dtype, reduce_dtype=torch.float32)``, bit for bit, on gloo ranks.

Each rank runs the same small transformer twice: as FSDP2 runs it (``fully_shard`` on each block
and the root, ``torch.optim.AdamW(fused=True)``, a ``torch.amp.GradScaler`` for float16) and as a
funcamp train step (``funcamp.adamw(fused=True)``; one rank: the plain step, two ranks:
``parallel=Sharded(mesh)``), eager and compiled (aot_eager: the traced graph run by torch's own
kernels), and on two ranks ``parallel=DataParallel(group)`` too. Every step's loss, every step's gradients (FSDP2's reduced ``.grad`` against
``torch.func.grad`` of ``funcamp.amp(loss_fn, policy)`` averaged over the ranks) and every step's
params must have the same bits. The model keeps a float32 buffer that FSDP2 leaves in float32
(the logits are scaled by it in float32): a cast of the buffers would change the loss.
"""

from __future__ import annotations

import math
import time
import warnings

import optree
import pytest
import ranks
import torch
import torch.distributed as dist
import torch.nn.functional as F
from bitwise import assert_bitwise
from torch import nn

import funcamp
import funcamp.distributed as fd
from funcamp.testing import assert_trees_equal

pytestmark = pytest.mark.distributed

STEPS = 30
COMPILED_STEPS = 12
BATCH, T, D, CLASSES = 8, 6, 16, 5
LR = 3e-3
TIMEOUT_S = 400
BAD_STEP = 4  # float16 runs: an inf in the last rank's batch at this step (a skipped step)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.mlp(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, CLASSES)
        self.register_buffer("pos", torch.randn(T, D) / 4)  # cast by hand, as rotary tables are
        self.register_buffer("temperature", torch.linspace(0.9, 1.1, CLASSES))  # stays float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos.to(x.dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _loss(logits: torch.Tensor, temperature: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The logits times the float32 buffer (so float32 from there on), then cross-entropy."""
    return F.cross_entropy((logits * temperature).flatten(0, 1), y.flatten())


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(bad: bool):
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS):
        x = torch.randn(BATCH, T, 8, generator=gen)
        y = torch.randint(0, CLASSES, (BATCH, T), generator=gen)
        if bad and i == BAD_STEP:
            x[-1, 0, 0] = math.inf
        out.append((x, y))
    return out


def _shard(batch, rank: int, world: int):
    n = BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def _mean(t: torch.Tensor, world: int) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / world


def _full(tree):
    from torch.distributed.tensor import DTensor

    return optree.tree_map(
        lambda x: x.full_tensor() if isinstance(x, DTensor) else x.detach().clone(),
        tree,
        namespace="funcamp",
    )


# ------------------------------------------------------------------------------- FSDP2's run


def _fsdp_run(mesh, rank: int, world: int, dtype: torch.dtype, output_float32: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    if output_float32:  # on the root only: output_dtype casts every fully_shard-ed module's output
        mp = MixedPrecisionPolicy(dtype, torch.float32, output_dtype=torch.float32)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    out = {"loss": [], "grads": [], "params": [], "scale": []}
    for batch in _batches(dtype == torch.float16):
        x, y = _shard(batch, rank, world)
        out["scale"].append(scaler.get_scale() if scaler.is_enabled() else 1.0)
        loss = _loss(model(x), model.temperature, y)
        out["loss"].append(_mean(loss.float(), world))
        scaler.scale(loss).backward()
        out["grads"].append({n: p.grad.full_tensor().clone() for n, p in model.named_parameters()})
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["params"].append({n: p.full_tensor().clone() for n, p in model.named_parameters()})
    return out


# ----------------------------------------------------------------------------- funcamp's run


def _funcamp_run(mesh, rank: int, world: int, policy: str, compile, output_float32: bool):
    model = _model()
    params, buffers = funcamp.params_and_buffers(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        logits = torch.func.functional_call(model, (params, buffers), (x,))
        return _loss(logits.float() if output_float32 else logits, buffers["temperature"], y)

    opt = funcamp.adamw(LR, fused=True)
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
    parallel = None
    if compile == "data_parallel":  # every rank holds everything: DDP's layout, FSDP2's numbers
        parallel, compile = fd.DataParallel(dist.group.WORLD), False
    elif world > 1:
        state, parallel = fd.shard(state, mesh), fd.Sharded(mesh)
    step = funcamp.make_train_step(loss_fn, opt, policy, parallel=parallel, compile=compile)
    forward = funcamp.amp(lambda p, b: loss_fn(p, buffers, b), policy)
    out = {"loss": [], "grads": [], "params": [], "scale": []}
    float16 = funcamp.get_policy(policy).compute_dtype == torch.float16
    batches = _batches(float16)
    steps = STEPS if compile is False else COMPILED_STEPS
    for batch in batches[:steps]:
        local = _shard(batch, rank, world)
        if compile is False:  # the amp transform's gradients of the scaled loss, at these params
            grads, _ = funcamp.scaled_grad_and_value(forward, state.scaler)(
                _full(state.params), local
            )
            out["grads"].append({k: _mean(g, world) for k, g in grads.items()})
        scale = state.scaler.scale.item()
        state, metrics = step(state, local)
        out["loss"].append(metrics["loss"])
        out["params"].append(_full(state.params))
        out["scale"].append(scale)
    return out


# ---------------------------------------------------------------------------------- workers


def _worker(rank: int, world: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    ranks.init_rank(rank, world, out_dir, TIMEOUT_S)
    # the model's output is a view (a 3-d linear): nothing here writes into it in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (world,))
    res: dict = {"seconds": {}}
    clock = time.monotonic()
    aot = funcamp.Compile(backend="aot_eager")
    bf16 = [("eager", False), ("compiled", aot)]
    if world == 2:
        bf16.append(("data_parallel", "data_parallel"))
    runs = [
        ("bf16", torch.bfloat16, "fsdp_bfloat16", bf16, False),
        ("f16", torch.float16, "fsdp_float16", [("eager", False)], False),
    ]
    if world == 1:  # FSDP2's output_dtype=float32: cast the model's output in loss_fn
        runs.append(("bf16_out32", torch.bfloat16, "fsdp_bfloat16", [("eager", False)], True))
    for name, dtype, policy, variants, out32 in runs:
        res[f"{name}/fsdp"] = _fsdp_run(mesh, rank, world, dtype, out32)
        for variant, compile in variants:
            res[f"{name}/{variant}"] = _funcamp_run(mesh, rank, world, policy, compile, out32)
            now = time.monotonic()
            res["seconds"][f"{name}/{variant}"] = now - clock
            clock = now
    ranks.save_results(res, out_dir, rank)
    ranks.leave()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    preload = ["torch", "torch.distributed.fsdp", "funcamp", __name__]
    started = {}
    for world in (1, 2):  # both at once: the 1-rank run fills the cores while 2 ranks wait
        out_dir = tmp_path_factory.mktemp(f"fsdp{world}")
        args = [(r, world, str(out_dir)) for r in range(world)]
        started[world] = ranks.start(_worker, args, out_dir, preload=preload, timeout_s=TIMEOUT_S)
    return {world: run.results() for world, run in started.items()}


def _same_run(ours: dict, theirs: dict) -> None:
    steps = len(ours["loss"])
    assert steps in (STEPS, COMPILED_STEPS)
    for i in range(steps):
        assert_bitwise(ours["loss"][i], theirs["loss"][i].reshape(()))
        assert_bitwise(ours["params"][i], theirs["params"][i])
        assert ours["scale"][i] == theirs["scale"][i], i
        if ours["grads"] and ours["loss"][i].isfinite():
            assert_bitwise(ours["grads"][i], theirs["grads"][i])
        elif ours["grads"]:  # the skipped step: NaN where FSDP2 has NaN (their signs may differ:
            # FSDP2 halves each rank's gradient before the sum, funcamp halves the sum)
            assert_trees_equal(ours["grads"][i], theirs["grads"][i])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "run"),
    [(w, r) for w in (1, 2) for r in ("bf16/eager", "bf16/compiled", "f16/eager")]
    + [(1, "bf16_out32/eager"), (2, "bf16/data_parallel")],
)
def test_cast_at_entry_is_fsdp2_mixed_precision(runs, world: int, run: str) -> None:
    """Losses, gradients and params at every step, and (float16) the scale sequence with a
    skipped step: the same bits as FSDP2 with ``MixedPrecisionPolicy(param_dtype,
    reduce_dtype=torch.float32)`` on every rank."""
    results = runs[world]
    name = run.split("/")[0]
    for res in results:
        _same_run(res[run], res[f"{name}/fsdp"])
    if name == "f16":  # the injected inf was skipped: the scale backed off
        scales = results[0][run]["scale"]
        assert scales[BAD_STEP + 1] == scales[BAD_STEP] / 2


def test_ranks_agree(runs) -> None:
    """Both ranks of the 2-rank runs hold the same params (funcamp's, gathered)."""
    a, b = runs[2]
    assert_bitwise(a["bf16/eager"]["params"][-1], b["bf16/eager"]["params"][-1])
