"""Train a small Hugging Face GPT-2 from a config, character by character, on Python's own source.

    python examples/train_gpt2_chars.py                       # bf16-mixed, compiled, 300 steps
    python examples/train_gpt2_chars.py --steps 50 --no-compile
    python examples/train_gpt2_chars.py --policy mixed_float16
    python examples/train_gpt2_chars.py --fp8 delayed         # Conv1D and lm_head in FP8

The text is the standard library's own ``.py`` files (they ship with every Python: no download);
the model is ``transformers.GPT2LMHeadModel`` built from a ``GPT2Config`` (no weights fetched).
The step is ``funcamp.make_train_step`` over ``functional_call`` of the model: ``amp``, loss
scaling, gradient clipping, AdamW with a warmup-cosine schedule, one compiled graph.

``--fp8 current|delayed`` adds ``Policy.with_fp8(recipe, modules=(Conv1D, nn.Linear))``: GPT-2's
``transformers.pytorch_utils.Conv1D`` layers (attention and MLP projections, which compute
``torch.addmm(bias, x, weight)``) and its ``lm_head`` (an ``nn.Linear``) run as scaled FP8
matmuls, with current (per-call) or delayed (TransformerEngine-style) scaling; the delayed amax
histories, one per layer, live in ``state.fp8``. On CPU torch emulates the FP8 matmuls.

Writes ``build/train_gpt2_chars/<policy>[-fp8-<recipe>].png`` (loss curve, train and held-out;
``<policy>`` is the preset's canonical name, as in the other examples: ``--policy bf16-mixed``
writes ``mixed_bfloat16.png``) and prints the results and a sample (``--quiet`` hides only the
progress bar). Needs the ``transformers`` and ``examples`` extras.
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch.func import functional_call

import funcamp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the examples' shared setup
from _common import policy_name

#: The presets' canonical names, for file names: one spelling per policy in every example.


def load_text(max_chars: int) -> str:
    """The standard library's ``.py`` files, concatenated in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def char_data(max_chars: int) -> tuple[list[str], dict[str, int], torch.Tensor]:
    """The text as character ids: ``(vocab, char -> id, ids)``."""
    text = load_text(max_chars)
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return vocab, index, torch.tensor([index[c] for c in text], dtype=torch.long)


def gpt2(vocab_size: int, context: int, width: int, layers: int) -> tuple[Any, Any]:
    """``(model, loss_fn)``: a ``GPT2LMHeadModel`` built from a config (no weights fetched,
    dropout off, train mode) and ``loss_fn(params, buffers, batch)``, its loss through
    ``functional_call`` with ``batch`` its keyword arguments (``input_ids``, ``labels``)."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(config).train()
    model.loss_type = "ForCausalLM"  # unset, transformers warns inside forward: a graph break

    def loss_fn(params, buffers, batch):
        return functional_call(model, (params, buffers), args=(), kwargs=batch).loss

    return model, loss_fn


def adamw_warmup_cosine(lr: float, steps: int) -> funcamp.Optimizer:
    """Global-norm clipping at 1, then AdamW (weight decay 0.01) with a linear warmup over the
    first tenth of ``steps`` and a cosine decay."""
    return funcamp.chain(
        funcamp.clip_by_global_norm(1.0),
        funcamp.adamw(
            funcamp.linear_warmup_cosine_decay(lr, max(1, steps // 10), steps), weight_decay=0.01
        ),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="bf16-mixed", help="a funcamp policy (default bf16-mixed)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64, help="characters per sequence")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--chars", type=int, default=400_000, help="characters of text to use")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fp8",
        default="none",
        choices=("none", "current", "delayed"),
        help="run the Conv1D layers and lm_head in FP8 with this scaling recipe (default none)",
    )
    p.add_argument("--fp8-history", type=int, default=16, help="amax history of --fp8 delayed")
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--quiet", action="store_true", help="no progress bar (results still print)")
    p.add_argument("--out", type=Path, default=Path("build/train_gpt2_chars"))
    return p.parse_args(argv)


def fp8_policy(policy: funcamp.Policy, fp8: str, history: int = 16) -> funcamp.Policy:
    """``policy`` with GPT-2's Conv1D layers and lm_head in FP8 (``fp8`` "none": unchanged)."""
    from transformers.pytorch_utils import Conv1D

    if fp8 == "none":
        return policy
    recipe = funcamp.Fp8Recipe.current() if fp8 == "current" else funcamp.Fp8Recipe.delayed(history)
    return policy.with_fp8(recipe, modules=(Conv1D, torch.nn.Linear))


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train; return the first and last train loss, the held-out loss and the FP8 site count."""
    from tqdm import tqdm

    args = parse_args(argv)
    torch.manual_seed(args.seed)
    vocab, index, data = char_data(args.chars)
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]

    model, loss_fn = gpt2(len(vocab), args.context, args.width, args.layers)
    params, buffers = funcamp.params_and_buffers(model)
    opt = adamw_warmup_cosine(args.lr, args.steps)
    base = funcamp.get_policy(args.policy)
    policy = fp8_policy(base, args.fp8, args.fp8_history)
    # model= builds the delayed-FP8 state (state.fp8, one entry per FP8 layer); else ignored.
    state = funcamp.TrainState.create(params, opt, policy, buffers=buffers, model=model)
    step = funcamp.make_train_step(loss_fn, opt, policy, compile=not args.no_compile)
    # with_fp8_state: delayed FP8 scaling reads its scales from state.fp8 (a no-op otherwise).
    eval_loss = funcamp.with_fp8_state(funcamp.amp(loss_fn, policy))

    g = torch.Generator().manual_seed(args.seed)

    def batch_from(source: torch.Tensor) -> dict[str, torch.Tensor]:
        start = torch.randint(0, len(source) - args.context, (args.batch,), generator=g)
        ids = torch.stack([source[s : s + args.context] for s in start.tolist()])
        return {"input_ids": ids, "labels": ids}

    losses: list[torch.Tensor] = []
    held: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    with tqdm(total=args.steps, disable=args.quiet, unit="step") as bar:
        if not args.no_compile:
            bar.set_description("compiling the train step (first call)")
        for i in range(args.steps):
            state, metrics = step(state, batch_from(train))
            losses.append(metrics["loss"])
            if i == 0:
                bar.set_description("training")
            if (i + 1) % 50 == 0 or i + 1 == args.steps:
                with torch.no_grad():
                    value = eval_loss(state.fp8, state.params, state.buffers, batch_from(held_out))
                held.append((i, float(value)))
                bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", held_out=f"{held[-1][1]:.3f}")
            bar.update()
    elapsed = time.perf_counter() - t0
    curve = [float(x) for x in losses]
    fp8 = "" if args.fp8 == "none" else f" | fp8 {args.fp8}"
    print(
        f"policy {policy}{fp8} | {args.steps} steps in {elapsed:.1f}s | loss {curve[0]:.3f} "
        f"-> {curve[-1]:.3f} (uniform guess {math.log(len(vocab)):.3f}) | held-out "
        f"{held[-1][1]:.3f}"
    )
    print("sample:", repr(_sample(model, state, vocab, index, policy, 80)))
    args.out.mkdir(parents=True, exist_ok=True)
    name = policy_name(base) + ("" if args.fp8 == "none" else f"-fp8-{args.fp8}")
    plot = args.out / f"{name}.png"
    _plot(curve, held, plot, f"{policy}{fp8}")
    print(f"plot: {plot}")
    return {
        "first": curve[0],
        "last": curve[-1],
        "held_out": held[-1][1],
        "fp8_sites": len(state.fp8.scale),  # delayed FP8: one state entry per FP8 layer
    }


def _sample(model, state, vocab, index, policy, n: int) -> str:
    ids = torch.tensor([[index.get("d", 0)]])

    def logits(params, buffers, ids):
        return functional_call(model, (params, buffers), (ids,)).logits

    run = funcamp.with_fp8_state(funcamp.amp(logits, policy))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(n):
            out = run(state.fp8, state.params, state.buffers, ids)
            probs = torch.softmax(out[0, -1].float(), -1)
            nxt = torch.multinomial(probs, 1, generator=g)
            ids = torch.cat([ids, nxt[None]], dim=1)[:, -model.config.n_positions :]
    return "".join(vocab[i] for i in ids[0].tolist())


def _plot(curve: list[float], held: list[tuple[int, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(curve, lw=0.8, label="train (per step)")
    ax.plot([i for i, _ in held], [v for _, v in held], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
