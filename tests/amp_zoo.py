"""Small models shared by the amp tests: each takes ``(x, y)`` and returns a scalar loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny models on 2 shared cores: one intra-op thread is ~10x faster than two."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3)
        self.fc = nn.Linear(8 * 2 * 2, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.conv1(x))), 2)
        h = F.relu(self.conv2(h))
        return F.cross_entropy(self.fc(h.flatten(1)), y)


class Block(nn.Module):
    """A pre-norm transformer block: sdpa, layer_norm, gelu, softmax, cross_entropy."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        logits = self.head(x)
        confidence = torch.softmax(logits, dim=-1).amax(dim=-1).mean()
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()) + 0.01 * confidence


class MHA(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 7)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, w = self.mha(x, x, x)
        h = self.ln(x + F.gelu(a))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten()) + w.mean()


class LSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return F.cross_entropy(self.head(out[:, -1]), y)


ZOO: dict[str, type[nn.Module]] = {
    "mlp": MLP,
    "cnn": CNN,
    "block": Block,
    "mha": MHA,
    "lstm": LSTM,
}


def make_data(name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    if name == "mlp":
        return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    if name == "cnn":
        return torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    if name in ("block", "mha"):
        return torch.randn(2, 5, 16, generator=g), torch.randint(0, 7, (2, 5), generator=g)
    if name == "lstm":
        return torch.randn(4, 6, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    raise KeyError(name)


def make_case(
    name: str, seed: int
) -> tuple[nn.Module, dict[str, torch.Tensor], Callable[..., Any], tuple[torch.Tensor, ...]]:
    """A model, its params, ``loss(params, x, y)`` through functional_call, and data."""
    torch.manual_seed(seed)
    model = ZOO[name]()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fresh = {k: v.clone() for k, v in buffers.items()}  # batch_norm updates them in place
        return functional_call(model, (p, fresh), (x, y))

    return model, params, loss, make_data(name, seed)
