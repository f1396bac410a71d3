"""Real models for ``train_step.py --models gpt2,llama,...``: Hugging Face ``transformers`` models
built from small configs (no download; a little larger than the tests' in ``tests/hf_models.py``)
and the train steps whose first calls are compared.

Each builder returns ``(model, batch)``: the model in train mode with dropout off and a batch of
keyword inputs with labels, so ``model(**batch).loss`` is the loss. The step makers take the same
model and batch and return ``step() -> loss``; every variant does the same work per step: a bf16
autocast forward, the backward of the loss scaled by a dynamic loss scale (init 2**16, as
``torch.amp.GradScaler``), unscale and inf check, AdamW(1e-4, weight decay 0.01), scale update.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from _revision import step_options
from torch import nn
from torch.func import functional_call

import funcamp

VOCAB = 512
LR, WEIGHT_DECAY = 1e-4, 0.01
LOWP = torch.bfloat16


def _tokens(g: torch.Generator, *shape: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, VOCAB, shape, generator=g)


def _causal_lm(model: nn.Module, g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    # Without it PreTrainedModel.loss_function calls logger.warning_once: a graph break.
    model.loss_type = "ForCausalLM"
    ids = _tokens(g, 4, 32)
    return model, {"input_ids": ids, "labels": ids}


def gpt2(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return _causal_lm(transformers.GPT2LMHeadModel(config), g)


def llama(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return _causal_lm(transformers.LlamaForCausalLM(config), g)


def mixtral(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.MixtralConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, output_router_logits=True,
    )  # fmt: skip
    return _causal_lm(transformers.MixtralForCausalLM(config), g)


def bert(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    ids = _tokens(g, 4, 32)
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "labels": ids}


def t5(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, d_kv=32, num_heads=2,
        vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    return model, {"input_ids": _tokens(g, 4, 32, low=1), "labels": _tokens(g, 4, 16, low=1)}


def _images(g: torch.Generator, batch: int = 8) -> dict[str, Any]:
    pixels = torch.randn(batch, 3, 32, 32, generator=g)
    return {"pixel_values": pixels, "labels": torch.randint(0, 10, (batch,), generator=g)}


def vit(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.ViTConfig(
        image_size=32, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.ViTForImageClassification(config), _images(g)


def resnet(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64], depths=[1, 1, 1], layer_type="basic",
        num_labels=10,
    )  # fmt: skip
    return transformers.ResNetForImageClassification(config), _images(g)


def swin(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    config = transformers.SwinConfig(
        image_size=32, patch_size=2, num_channels=3, embed_dim=32, depths=[2, 2],
        num_heads=[2, 4], window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, num_labels=10,
    )  # fmt: skip
    return transformers.SwinForImageClassification(config), _images(g)


class PooledCNN(nn.Module):
    """Conv-BatchNorm-ReLU stages, ``nn.AdaptiveAvgPool2d(1)`` (an int output size) and a linear
    head, returning transformers' classifier output (as ``tests/hf_models.py``'s)."""

    def __init__(self, channels: tuple[int, ...] = (3, 16, 32, 64), num_labels: int = 10) -> None:
        super().__init__()
        self.stages = nn.Sequential(
            *(
                nn.Sequential(
                    nn.Conv2d(a, b, 3, stride=1 if i == 0 else 2, padding=1, bias=False),
                    nn.BatchNorm2d(b),
                    nn.ReLU(),
                )
                for i, (a, b) in enumerate(pairwise(channels))
            )
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels[-1], num_labels)

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.pool(self.stages(pixel_values)).flatten(1))
        return transformers.modeling_outputs.ImageClassifierOutputWithNoAttention(
            loss=F.cross_entropy(logits, labels), logits=logits
        )


def cnn(g: torch.Generator) -> tuple[nn.Module, dict[str, Any]]:
    return PooledCNN(), _images(g)


MODELS: dict[str, Callable[[torch.Generator], tuple[nn.Module, dict[str, Any]]]] = {
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


def build(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """The model (seeded, train mode) and its batch, after one eager forward without grad.

    The eager call is not timed and every variant gets it: transformers installs the hooks that
    record outputs (Mixtral's router logits) on a model's first call, under a lock that
    ``torch.compile(fullgraph=True)`` cannot trace.
    """
    torch.manual_seed(0)
    model, batch = MODELS[name](torch.Generator().manual_seed(1))
    model.train()
    with torch.no_grad():
        model(**copy.deepcopy(batch))
    return model, batch


def funcamp_step(
    model: nn.Module,
    batch: dict[str, Any],
    fused: bool = False,
    fc: Any = funcamp,
    **options: Any,
) -> Callable[[], Any]:
    """``funcamp.make_train_step`` (compiled; default options unless ``options``, e.g.
    ``cache_dir=`` or ``backend=``), with ``funcamp.adamw(..., fused=fused)``; ``fc``: the
    funcamp module to use (another revision's, ``train_step.py --against``).
    ``step.skipped()``: whether the last step was skipped."""
    funcamp = fc
    policy = funcamp.get_policy("mixed_bfloat16")
    opt = funcamp.adamw(LR, weight_decay=WEIGHT_DECAY, fused=fused)

    def loss_fn(params: Any, buffers: Any, batch: dict[str, Any]) -> torch.Tensor:
        return functional_call(model, (params, buffers), args=(), kwargs=batch).loss

    params, buffers = funcamp.params_and_buffers(model)
    scaler = funcamp.ScalerState.dynamic()  # the same work as GradScaler
    box = [funcamp.TrainState.create(params, opt, policy, buffers=buffers, scaler=scaler)]
    step_fn = funcamp.make_train_step(loss_fn, opt, policy, **step_options(fc, options))
    last: dict[str, Any] = {}

    def step() -> Any:
        box[0], metrics = step_fn(box[0], batch)
        last.update(metrics)
        return metrics["loss"]

    step.skipped = lambda: bool(last["found_inf"])  # type: ignore[attr-defined]  (a host sync)
    return step


def torch_step(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    compile_optimizer: bool,
    fused: bool = False,
    backend: str = "inductor",
) -> Callable[[], Any]:
    """``torch.compile(model)`` + autocast(bf16) + GradScaler + AdamW(foreach=True); with
    ``compile_optimizer``, ``optimizer.step`` compiled too (torch's "compile the optimizer"
    recipe: ``GradScaler.step`` unscales and checks eagerly, then calls the compiled step); with
    ``fused``, AdamW(fused=True) (GradScaler hands it the scale and the overflow flag).
    ``step.skipped()``: whether GradScaler skipped the last step (the optimizer did not run)."""
    forward = torch.compile(model, backend=backend)
    kind = {"fused": True} if fused else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, **kind)
    if compile_optimizer:
        opt.step = torch.compile(opt.step, backend=backend)  # type: ignore[method-assign]
    scaler = torch.amp.GradScaler("cpu")
    scales = [scaler.get_scale()] * 2

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=LOWP):
            loss = forward(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales[:] = [scales[1], scaler.get_scale()]
        return loss.detach()

    step.skipped = lambda: scales[1] < scales[0]  # type: ignore[attr-defined]
    return step


#: The variants of a first-call row (``options``: ``backend=``, and ``cache_dir=`` for
#: ``funcamp_cache``).
VARIANTS: dict[str, Callable[..., Callable[[], Any]]] = {
    "funcamp": funcamp_step,
    "funcamp_cache": funcamp_step,
    "torch_model_opt": lambda model, batch, **options: torch_step(
        model, batch, compile_optimizer=True, **options
    ),
    "torch_model": lambda model, batch, **options: torch_step(
        model, batch, compile_optimizer=False, **options
    ),
    "funcamp_fused": lambda model, batch, **options: funcamp_step(
        model, batch, fused=True, **options
    ),
    "funcamp_unpatched": lambda model, batch, **options: funcamp_step(
        model, batch, compiler_patches=False, **options
    ),
    "torch_model_fused": lambda model, batch, **options: torch_step(
        model, batch, compile_optimizer=False, fused=True, **options
    ),
}
DESCRIPTIONS = {
    "funcamp": "funcamp.make_train_step (default options)",
    "funcamp_cache": "the same with cache_dir= (warm: the compiled step is loaded)",
    "torch_model_opt": "torch.compile(model) + compiled optimizer.step + autocast + GradScaler",
    "torch_model": "torch.compile(model) + autocast + GradScaler, eager AdamW(foreach)",
    "funcamp_fused": "funcamp.make_train_step with funcamp.adamw(..., fused=True)",
    "funcamp_unpatched": "funcamp.make_train_step(..., compile=funcamp.Compile(compiler_patches=False)): torch's compiler",
    "torch_model_fused": "torch.compile(model) + autocast + GradScaler + AdamW(fused=True)",
}
