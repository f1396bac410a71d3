"""A step whose loss cannot be one graph: the loss compiled in pieces, the update one graph.

``Compile(fullgraph="auto")``, the default, compiles a train or eval step as one graph. Some
losses cannot be one: dynamo refuses ``nn.LSTM``/``nn.GRU``/``nn.RNN``, and torch's own code
branches on tensor values (``nn.TransformerEncoder`` checks whether a float mask is causal).
``torch.compile(model)`` trains such a model by compiling the pieces between the breaks and
running the rest eagerly. A train step cannot: dynamo cannot resume a frame inside
``torch.func.grad`` (docs/internals.md). So a step in pieces (:func:`in_pieces`) is two parts:

* the forward and backward, run by Python: the loss is ``torch.compile(fullgraph=False)`` of
  the user's loss under ``amp``, differentiated by ``torch.autograd`` (the pieces' compiled
  backwards), as ``torch.compile(model)`` and ``loss.backward()`` are;
* the update, one graph (``fullgraph=True``): the exchange between ranks, unscale, the
  optimizer, the skip, the scaler's update and the metrics, with no host sync.

:class:`Pieces` decides when: from the start with ``fullgraph=False``; with ``"auto"`` once the
whole step failed to trace for a graph break (:func:`funcamp.train.errors.breaks_graph`),
which it says once, on funcamp's logger (stderr), with where the graph broke and why;
never with ``fullgraph=True``, which raises the failure's paragraph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from funcamp._core.progress import announce_first_call, logger
from funcamp.train.compiling import compile_fn, fresh_code
from funcamp.train.errors import breaks_graph, graph_break_notice

__all__ = ["Halves", "Pieces", "in_pieces"]


class Halves(NamedTuple):
    """A train step's two parts, as the step builder makes them.

    ``run_loss(fp8, params, buffers, batch)`` is the user's loss under ``amp``;
    ``forward(run_loss, state, batch)`` the forward and backward around it, which returns what
    ``update(state, batch)`` takes as ``batch``; ``update`` returns ``(new_state, metrics)``.
    """

    run_loss: Callable[..., Any]
    forward: Callable[..., Any]
    update: Callable[..., Any]


def _loss_piece(run_loss: Callable[..., Any]) -> Callable[..., Any]:
    # the names `state` and `batch`: specialize=True keeps the guards on them
    def loss_piece(state: Any, batch: Any) -> Any:
        fp8, params, buffers = state
        return run_loss(fp8, params, buffers, batch)

    loss_piece.__code__ = fresh_code(loss_piece.__code__)
    return loss_piece


def in_pieces(
    halves: Halves, options: dict[str, Any], device_type: str | None, **compile_kw: Any
) -> Callable[[Any, Any], Any]:
    """``step(state, batch)``: the loss compiled in pieces (``fullgraph=False``) under Python's
    forward and backward, then the update compiled as one graph. ``options`` and
    ``compile_kw`` are :func:`compile_fn`'s, for both parts."""
    piece = _loss_piece(halves.run_loss)
    loss = compile_fn(piece, {**options, "fullgraph": False}, device_type, **compile_kw)
    update = halves.update
    update.__code__ = fresh_code(update.__code__)
    compiled_update = compile_fn(update, {**options, "fullgraph": True}, device_type, **compile_kw)

    def compiled_loss(fp8: Any, params: Any, buffers: Any, batch: Any) -> Any:
        return loss((fp8, params, buffers), batch)

    def step(state: Any, batch: Any) -> Any:
        return compiled_update(state, halves.forward(compiled_loss, state, batch))

    return announce_first_call(step, "train step in pieces")


class Pieces:
    """Whether a step runs in pieces, and the switch of ``fullgraph="auto"`` to them.

    ``fullgraph`` is the step's :class:`funcamp.Compile` field. ``build()`` returns the step in
    pieces; :meth:`switch` calls it once, after a whole-step trace failed for a graph break.
    """

    def __init__(self, api: str, fullgraph: Any, what: str, subject: str = "the loss") -> None:
        self.api = api
        self.fullgraph = fullgraph
        self.what = what
        self.subject = subject
        self.split = fullgraph is False

    def switch(
        self, error: BaseException, build: Callable[[], Callable[..., Any]]
    ) -> Callable[..., Any] | None:
        """The step in pieces if ``error`` is a graph break of an ``"auto"`` step (said once
        on stderr); else None (the caller raises)."""
        if self.fullgraph != "auto" or self.split or not breaks_graph(error):
            return None
        self.split = True
        logger.warning(graph_break_notice(self.api, error, self.what, self.subject))
        return build()
