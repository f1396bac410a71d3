"""Tiny Hugging Face ``transformers`` models built from configs (no download) for the tests.

Each builder returns ``(model, batch)``: a model in train mode with dropout off (compiled and
eager dropout draw different random numbers) and a batch of keyword inputs with labels, so
``model(**batch).loss`` is the training loss. Sizes are the smallest that keep every block.
``layers`` sets the depth (the number of stages for ResNet, Swin and the CNN, of encoder and of
decoder layers for T5); the default 2 also covers what passes from one layer to the next.

Besides the transformers models, ``cnn`` is a small classifier written here (transformers has no
image classifier with a labels loss whose pooler is ``nn.AdaptiveAvgPool2d(1)``: an int output
size, which ``F.adaptive_avg_pool2d`` turns into a size list in Python).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

transformers = __import__("pytest").importorskip("transformers")

VOCAB = 97


def _tokens(g: torch.Generator, *shape: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, shape, generator=g)


def gpt2(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.GPT2Config(
        n_layer=layers, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    # Without it PreTrainedModel.loss_function calls logger.warning_once: a graph break.
    model.loss_type = "ForCausalLM"
    ids = _tokens(g, 2, 16)
    return model, {"input_ids": ids, "labels": ids}


def llama(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    ids = _tokens(g, 2, 16)
    return model, {"input_ids": ids, "labels": ids}


def bert(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config)  # builds CrossEntropyLoss() in forward
    ids = _tokens(g, 2, 16)
    return model, {"input_ids": ids, "labels": ids}


def t5(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.T5Config(
        num_layers=layers, num_decoder_layers=layers, d_model=32, d_ff=64, d_kv=16, num_heads=2,
        vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    return model, {"input_ids": _tokens(g, 2, 16, low=1), "labels": _tokens(g, 2, 8, low=1)}


def vit(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=layers,
        num_attention_heads=2, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.ViTForImageClassification(config)
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 5, (2,), generator=g)}


def resnet(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16, 32][:layers], depths=[1] * layers,
        layer_type="basic", num_labels=5,
    )  # fmt: skip
    model = transformers.ResNetForImageClassification(config)  # BatchNorm: buffers
    pixels = torch.randn(4, 3, 32, 32, generator=g)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 5, (4,), generator=g)}


def swin(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    # The first stage's two blocks are a plain and a shifted window (torch.roll, attention mask);
    # a second stage adds the patch merging between them (cat: a CPU-promote op, LayerNorm). The
    # classifier pools with nn.AdaptiveAvgPool1d(1).
    config = transformers.SwinConfig(
        image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[2] + [1] * (layers - 1),
        num_heads=[1, 2, 4, 8][:layers], window_size=2, mlp_ratio=2.0, drop_path_rate=0.0,
        num_labels=5,
    )  # fmt: skip
    model = transformers.SwinForImageClassification(config)
    pixels = torch.randn(2, 3, 16, 16, generator=g)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 5, (2,), generator=g)}


def mixtral(g: torch.Generator, layers: int = 1) -> tuple[torch.nn.Module, dict[str, Any]]:
    # 4 experts, top-2, with the router's load-balancing loss added to the loss. Eagerly on the
    # CPU transformers runs the experts with torch's grouped_mm; compiled with float32 weights,
    # with its custom op transformers::grouped_mm_fallback (a registered autograd formula that
    # torch.func refuses: make_train_step then takes its gradients from torch.autograd).
    config = transformers.MixtralConfig(
        num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=32, bos_token_id=0, eos_token_id=0, output_router_logits=True,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    model.loss_type = "ForCausalLM"
    ids = _tokens(g, 2, 16)
    return model, {"input_ids": ids, "labels": ids}


class PooledCNN(nn.Module):
    """Conv-BatchNorm-ReLU stages (the later ones with stride 2), ``nn.AdaptiveAvgPool2d(1)`` and
    a linear head; ``forward(pixel_values, labels)`` returns transformers' classifier output."""

    def __init__(self, layers: int = 2, num_labels: int = 5) -> None:
        super().__init__()
        chans = [3, 8, 16, 32, 64][: layers + 1]
        self.stages = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(a, b, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                    nn.BatchNorm2d(b),
                    nn.ReLU(),
                )
                for i, (a, b) in enumerate(pairwise(chans))
            )
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(chans[-1], num_labels)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.pool(self.stages(pixel_values)).flatten(1))
        return transformers.modeling_outputs.ImageClassifierOutputWithNoAttention(
            loss=F.cross_entropy(logits, labels), logits=logits
        )


def cnn(g: torch.Generator, layers: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    model = PooledCNN(layers)  # BatchNorm: buffers
    pixels = torch.randn(4, 3, 16, 16, generator=g)
    return model, {"pixel_values": pixels, "labels": torch.randint(0, 5, (4,), generator=g)}


MODELS: dict[str, Callable[[torch.Generator, int], tuple[torch.nn.Module, dict[str, Any]]]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "t5": t5,
    "vit": vit,
    "resnet": resnet,
    "swin": swin,
    "mixtral": mixtral,
    "cnn": cnn,
}


def build(
    name: str, seed: int = 0, layers: int | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """``MODELS[name]`` seeded; ``layers=None`` is the builder's default (2; Mixtral's 1)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model, batch = MODELS[name](g) if layers is None else MODELS[name](g, layers)
    return model.train(), batch
