"""Inductor lowering a step that writes its state in place (``funcamp/compiler/dead_stores.py``).

Before lowering a write into a buffer, inductor stores every value lowered so far that reads
the buffer, the dead ones too (values whose readers have all been lowered, and compute them
inline): each becomes a scheduler node that the scheduler then drops. While
:func:`skip_dead_stores` is active only the live ones are stored. The kernels, and so the
results, stay the same; the dead nodes are never built.
"""

from __future__ import annotations

import pytest
import torch
from fresh_compile import fresh_inductor
from tiny_step import batches, model_step
from torch._inductor import scheduler

import funcamp
from funcamp.compiler import dead_stores as mutations
from funcamp.compiler import switch
from funcamp.compiler.dead_stores import skip_dead_stores
from funcamp.testing import assert_trees_equal

pytestmark = pytest.mark.skipif(not mutations.supported(), reason="another inductor lowering")


@pytest.fixture
def node_counts(monkeypatch):
    """``[(scheduler nodes built, nodes left after dead-node elimination), ...]`` per graph."""
    counts: list[tuple[int, int]] = []
    original = scheduler.Scheduler.dead_node_elimination

    def counting(self):
        before = len(self.nodes)
        original(self)
        counts.append((before, len(self.nodes)))

    monkeypatch.setattr(scheduler.Scheduler, "dead_node_elimination", counting)
    return counts


def _adam_like(p, m, g, found):
    """An update written into its inputs: every intermediate reads ``p`` or ``m``."""
    m_new = m.lerp(g, 0.1)
    denom = (m_new * m_new).sqrt() + 1e-8
    p_new = p * 0.99 - 0.01 * m_new / denom
    m.copy_(torch.where(found, m, m_new))
    p.copy_(torch.where(found, p, p_new))
    return p_new.sum()


def _run(fn, enabled, inputs):
    torch._dynamo.reset()
    args = [x.clone() for x in inputs]
    with fresh_inductor(), skip_dead_stores(enabled):
        out = torch.compile(fn, fullgraph=True)(*args)
    return out, args


@pytest.mark.parametrize("found", [False, True])
def test_dead_values_are_not_stored_and_results_are_the_same(node_counts, found):
    torch.manual_seed(0)
    inputs = [torch.randn(37, 5), torch.randn(37, 5), torch.randn(37, 5), torch.tensor(found)]
    want = [x.clone() for x in inputs]
    want_out = _adam_like(*want)  # eager
    out_on, on = _run(_adam_like, True, inputs)
    built_on, left_on = node_counts[-1]
    out_off, off = _run(_adam_like, False, inputs)  # inductor's own lowering, for comparison
    built_off, left_off = node_counts[-1]
    assert built_on == left_on  # nothing dead was built
    assert built_on <= built_off  # never more nodes than inductor's own lowering
    assert left_on == left_off  # the same kernels are left
    for a, b in zip(on, off):
        assert torch.equal(a, b)
    assert torch.equal(out_on, out_off)
    torch.testing.assert_close(on, want)
    torch.testing.assert_close(out_on, want_out)


def test_inert_outside_the_block(node_counts):
    """Installed once by an earlier block, the patch leaves other compiles to inductor: its
    own code path does not run for them."""
    with skip_dead_stores(True):
        pass
    inputs = [torch.randn(8), torch.randn(8), torch.randn(8), torch.tensor(False)]
    torch._dynamo.reset()
    switch.ACTED.clear()
    with fresh_inductor():
        torch.compile(_adam_like, fullgraph=True)(*[x.clone() for x in inputs])
    assert node_counts and not any(name == "dead_stores" for name, _ in switch.ACTED)


@pytest.mark.parametrize("name", ["FUNCAMP_DEAD_STORES", "FUNCAMP_LIVE_READS"])
def test_environment_switch(monkeypatch, name):
    """``FUNCAMP_DEAD_STORES=0`` turns it off, and so does its old name."""
    monkeypatch.delenv("FUNCAMP_DEAD_STORES", raising=False)
    monkeypatch.delenv("FUNCAMP_LIVE_READS", raising=False)
    monkeypatch.setenv(name, "0")
    with skip_dead_stores():
        assert not mutations._ACTIVE.get()
    monkeypatch.delenv(name)
    with skip_dead_stores():
        assert mutations._ACTIVE.get()
    assert not mutations._ACTIVE.get()


def test_new_environment_name_wins(monkeypatch):
    monkeypatch.setenv("FUNCAMP_DEAD_STORES", "1")
    monkeypatch.setenv("FUNCAMP_LIVE_READS", "0")
    with skip_dead_stores():
        assert mutations._ACTIVE.get()


def test_train_step_builds_no_dead_nodes_and_keeps_its_bits(node_counts, monkeypatch):
    """make_train_step's donated AdamW step (the patches chosen: on whatever the allowlist),
    with a skipped step among four: the same params, optimizer state, scaler and metrics with
    and without, and no dead node built with."""
    runs = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("FUNCAMP_DEAD_STORES", setting)
        torch._dynamo.reset()
        node_counts.clear()
        step, state = model_step(
            funcamp.adamw(1e-2, weight_decay=0.1), compile=funcamp.Compile(compiler_patches=True)
        )
        metrics = []
        data = batches()
        data[2] = (torch.full((4, 6), float("inf")), data[2][1])  # NaN grads: skipped
        with fresh_inductor():
            for batch in data:
                state, m = step(state, batch)
                metrics.append(m)
        runs[setting] = (state, metrics, list(node_counts))
    (off, off_metrics, off_counts), (on, on_metrics, on_counts) = runs["0"], runs["1"]
    assert [int(m["skipped"]) for m in on_metrics] == [0, 0, 1, 1]  # steps skipped so far
    assert_trees_equal(on.params, off.params)
    assert_trees_equal(on.opt_state, off.opt_state)
    assert_trees_equal(on.scaler, off.scaler)
    for a, b in zip(on_metrics, off_metrics):
        assert_trees_equal(a, b)
    assert on_counts and all(built == left for built, left in on_counts)
    assert all(on[0] <= off[0] for on, off in zip(on_counts, off_counts))
    assert [left for _, left in on_counts] == [left for _, left in off_counts]
