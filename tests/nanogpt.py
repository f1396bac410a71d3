"""A tiny nanoGPT (Karpathy's model.py, shrunk: same module names, so the same
``named_parameters()`` order) and its training loop as nanoGPT's train.py writes it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

V, T, D, L, H = 32, 8, 16, 2, 2


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(D, 3 * D)
        self.c_proj = nn.Linear(D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(D, dim=2)
        q, k, v = (z.view(b, t, H, d // H).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(D, 4 * D)
        self.c_proj = nn.Linear(4 * D, D)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = Attn()
        self.ln_2 = nn.LayerNorm(D)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(V, D),
                wpe=nn.Embedding(T, D),
                h=nn.ModuleList([Block() for _ in range(L)]),
                ln_f=nn.LayerNorm(D),
            )
        )
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def model():
    torch.manual_seed(0)
    return GPT()


def batches(n):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, V, (4, T), generator=g), torch.randint(0, V, (4, T), generator=g))
        for _ in range(n)
    ]


# CLIP: below the tiny model's grad norm, so the clip is active at every step
LR, MIN_LR, WARMUP, DECAY, WD, CLIP = 6e-3, 6e-4, 5, 25, 0.1, 0.25


def get_lr(it):  # nanoGPT's train.py
    if it < WARMUP:
        return LR * (it + 1) / (WARMUP + 1)
    if it > DECAY:
        return MIN_LR
    decay_ratio = (it - WARMUP) / (DECAY - WARMUP)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return MIN_LR + coeff * (LR - MIN_LR)


def torch_groups(m):
    params = [p for p in m.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def torch_optimizer(m):
    """nanoGPT's configure_optimizers: decay for the matrices, none for the rest."""
    return torch.optim.AdamW(torch_groups(m), lr=LR, betas=(0.9, 0.95), fused=True)


def torch_run(m, data, opt, sched=None, manual_lr=True):
    """nanoGPT's loop: bf16 autocast, clip_grad_norm_, the optimizer, the scheduler; returns
    the grad norms clip_grad_norm_ returned."""
    norms = []
    for it, (x, y) in enumerate(data):
        if manual_lr:
            for g in opt.param_groups:
                g["lr"] = get_lr(it)
        with torch.autocast("cpu", torch.bfloat16):
            loss = m(x, y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if sched is not None:
            sched.step()
    return norms
