"""The default steps train what ``torch.compile(model)`` trains.

A loss that cannot be one graph -- dynamo refuses RNN modules, and torch's own transformer code
branches on a mask's values -- is compiled in pieces with gradients from torch.autograd, the
update as one graph, and the step says once where the graph broke. ``Compile(fullgraph=True)``
refuses such a loss instead. Each model is compared with the eager step (train: params and
losses over a few steps, donated state; eval: the logits) under ``mixed_bfloat16``, so the amp
mode must reach the pieces on both sides of a break.

The models are tiny. The LSTM compiles with ``aot_eager`` (AOT autograd differentiates the
pieces), the others with the ``eager`` backend (dynamo's tracing is the point), and one RNN
step with inductor, the literal default.
"""

from __future__ import annotations

import logging

import pytest
import torch
from exhaustive import exhaustive
from test_host_sync import no_host_reads
from torch import nn

import funcamp

VOCAB, WIDTH, SEQ, STEPS = 11, 8, 5, 4
POLICY = "mixed_bfloat16"
NOTICE = "cannot be one graph"


class Model(nn.Module):
    """Embedding, the module under test, a linear head; ``x`` is ``(seq, batch)``."""

    def __init__(self, kind: str, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, WIDTH)
        if kind in ("lstm", "gru", "rnn"):
            self.body = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](WIDTH, WIDTH)
        elif kind == "transformer":
            self.body = nn.Transformer(WIDTH, 2, 1, 1, 16, dropout=0.0)
        else:
            layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.0)
            self.body = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[0])
        if self.kind == "encoder_bool_mask":
            mask = mask.isinf()
        if self.kind in ("lstm", "gru", "rnn"):
            h = self.body(h)[0]
        elif self.kind == "transformer":
            h = self.body(h, h, src_mask=mask, tgt_mask=mask)
        else:
            h = self.body(h, mask=mask)
        return self.out(self.drop(h))


def _logits(model):
    def logits(params, buffers, x):
        return torch.func.functional_call(model, (params, buffers), (x,))

    return logits


def _loss_fn(model):
    logits = _logits(model)

    def loss_fn(params, buffers, batch):
        x, y = batch
        return nn.functional.cross_entropy(
            logits(params, buffers, x).reshape(-1, VOCAB), y.reshape(-1)
        )

    return loss_fn


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, VOCAB, (SEQ, 3), generator=g),
            torch.randint(0, VOCAB, (SEQ, 3), generator=g),
        )
        for _ in range(STEPS)
    ]


def _train(model, compile):
    params, buffers = funcamp.params_and_buffers(model)
    params = {k: v.detach().clone() for k, v in params.items()}
    opt = funcamp.adamw(1e-2)
    state = funcamp.TrainState.create(params, opt, POLICY, buffers=buffers)
    step = funcamp.make_train_step(_loss_fn(model), opt, POLICY, compile=compile)
    losses = []
    torch.manual_seed(2)  # dropout's masks
    for batch in _batches():
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return (state.params, torch.stack(losses)), (step, state)


def _notices(caplog):
    return [r.getMessage() for r in caplog.records if NOTICE in r.getMessage()]


def _check(kind, backend, caplog):
    """The default train and eval steps (backend aside) against the eager ones."""
    model = Model(kind)
    eager, _ = _train(model, False)
    compile = funcamp.Compile(backend=backend)
    with caplog.at_level(logging.WARNING, logger="funcamp"):
        compiled, (step, state) = _train(model, compile)
    (notice,) = _notices(caplog)  # said once, for the first call
    assert notice.startswith("funcamp.make_train_step: the loss cannot be one graph: ")
    assert __file__ in notice  # where: the user's frame
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    x = _batches()[0][0]
    evaluate = funcamp.make_eval_step(_logits(model), POLICY, compile=compile)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="funcamp"):
        out = evaluate(state, x)
        evaluate(state, x)
    (notice,) = _notices(caplog)
    assert notice.startswith("funcamp.make_eval_step: `fn` cannot be one graph: ")
    torch.testing.assert_close(
        out, funcamp.make_eval_step(_logits(model), POLICY, compile=False)(state, x)
    )
    return step, state


def test_the_default_steps_train_an_lstm(caplog):
    step, state = _check("lstm", "aot_eager", caplog)
    batch = _batches()[1]  # the step in pieces reads no tensor's value back to Python
    with no_host_reads():
        step(state, batch)


@pytest.mark.parametrize(
    "kind",
    [
        "encoder_float_mask",
        "encoder_bool_mask",
        "gru",
        "rnn",
        pytest.param("transformer", marks=exhaustive),  # the encoder's check, and the decoder's
    ],
)
def test_every_recurrent_and_masked_module_trains_in_pieces(kind, caplog):
    _check(kind, "eager", caplog)


@pytest.mark.parametrize("kind", ["lstm", "encoder_float_mask"])
def test_fullgraph_true_refuses_with_the_reason(kind):
    model = Model(kind)
    strict = funcamp.Compile(backend="eager", fullgraph=True)
    params, buffers = funcamp.params_and_buffers(model)
    state = funcamp.TrainState.create(params, funcamp.sgd(0.1), POLICY, buffers=buffers)
    step = funcamp.make_train_step(_loss_fn(model), funcamp.sgd(0.1), POLICY, compile=strict)
    what = "LSTM" if kind == "lstm" else "data-dependent"
    pattern = rf"make_train_step: the step cannot be compiled as one graph\. What: .*{what}"
    with pytest.raises(RuntimeError, match=pattern):
        step(state, _batches()[0])
    evaluate = funcamp.make_eval_step(_logits(model), POLICY, compile=strict)
    with pytest.raises(RuntimeError, match=r"make_eval_step: the step cannot be compiled as one"):
        evaluate(state, _batches()[0][0])


def test_inductor_in_pieces_with_eager_dropout_masks(caplog):
    """``compile=True``'s inductor, in pieces, with ``fallback_random``: the same dropout masks
    as the eager step, so the runs agree within float rounding."""
    model = Model("rnn", dropout=0.3)
    eager, _ = _train(model, False)
    masks = funcamp.Compile(options={"fallback_random": True})
    with caplog.at_level(logging.WARNING, logger="funcamp"):
        compiled, _ = _train(model, masks)
    assert len(_notices(caplog)) == 1
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_fullgraph_false_compiles_in_pieces_without_a_notice(caplog):
    model = Model("gru")
    eager, _ = _train(model, False)
    with caplog.at_level(logging.WARNING, logger="funcamp"):
        compiled, _ = _train(model, funcamp.Compile(backend="eager", fullgraph=False))
    assert _notices(caplog) == []
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
