"""Cast at entry (``ops=cast_at_entry``; presets ``fsdp_bfloat16``, ``fsdp_float16``) in one
process: what ``amp``, ``trace``, the train step and the eval step cast, and that it is jmp's and
haiku's recipe written out in torch. FSDP2 itself: tests/test_fsdp_equivalence.py.

Also the choice it stands beside: ``mixed_bfloat16`` equals ``torch.autocast("cpu")`` only on
models whose ops CPU's and CUDA's lists treat alike; ``autocast_cpu`` equals it on any.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from bitwise import assert_bitwise
from torch import nn
from torch.func import functional_call

import funcamp
from funcamp import OpRule

BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
POLICY = funcamp.get_policy("fsdp_bfloat16")


class Attention(nn.Module):
    """A transformer block with a float32 buffer (the logits are scaled by it)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 4)
        self.register_buffer("temperature", torch.linspace(0.9, 1.1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        a = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        return self.out(F.gelu(a)) * self.temperature


def _case(seed: int = 0):
    torch.manual_seed(seed)
    model = Attention()
    params, buffers = funcamp.params_and_buffers(model)
    x, y = torch.randn(3, 5, 16), torch.randint(0, 4, (3, 5))

    def loss_fn(params, buffers, batch):
        x, y = batch
        logits = functional_call(model, (params, buffers), (x,))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    return model, params, buffers, (x, y), loss_fn


def _jmp(loss_fn, policy):
    """jmp's recipe (and haiku's ``set_policy`` on the whole model), written out: params and
    inputs cast to the compute dtype, the function run as it is, its output cast."""

    def run(*args):
        return policy.cast_to_output(loss_fn(*policy.cast_to_compute(args)))

    return run


def test_amp_casts_params_and_inputs_once_and_runs_every_op_as_it_comes() -> None:
    _, params, buffers, batch, loss_fn = _case()
    t = funcamp.trace(loss_fn, POLICY)(params, buffers, batch)
    assert t.output.dtype == F32 and {r.rule for r in t.records} == {OpRule.NONE}
    # the float32 buffer, passed as an argument to amp, is cast too; only the step keeps it
    for r in t.records:
        assert set(r.input_dtypes) <= {BF16, torch.int64}, r
    grads = torch.func.grad(funcamp.amp(loss_fn, POLICY))(params, buffers, batch)
    assert {g.dtype for g in grads.values()} == {F32}  # the cast is inside the gradient


def test_cast_at_entry_is_jmps_recipe() -> None:
    """Loss and float32 gradients of ``amp(f, "fsdp_bfloat16")`` are those of jmp's recipe
    (``cast_to_compute((params, batch))``, then ``cast_to_output``), bit for bit."""
    _, params, buffers, batch, loss_fn = _case()
    ours = torch.func.grad_and_value(funcamp.amp(loss_fn, POLICY))(params, buffers, batch)
    theirs = torch.func.grad_and_value(_jmp(loss_fn, POLICY))(params, buffers, batch)
    assert_bitwise(ours, theirs)


def test_float64_integers_and_non_tensors_pass_entry_untouched() -> None:
    seen = {}

    def f(a, b, *, c, n):
        seen.update(a=a.dtype, b=b.dtype, c=c.dtype, n=n)
        return a.sum()

    out = funcamp.amp(f, POLICY)(
        torch.ones(2, dtype=F64), torch.ones(2, dtype=torch.int32), c=torch.ones(2), n=3
    )
    assert seen == {"a": F64, "b": torch.int32, "c": BF16, "n": 3} and out.dtype == F64
    assert (
        funcamp.amp(f, "params=float64,ops=cast_at_entry")(
            torch.ones(2, dtype=BF16), torch.ones(2), c=torch.ones(2), n=0
        ).dtype
        == F64
    )


def test_op_rules_apply_on_top_of_the_entry_cast() -> None:
    """A loss in float32 on bfloat16 logits. (An upcast that feeds a bfloat16 matmul fails, as
    it does under FSDP2: under cast at entry each op runs in the dtypes it gets.)"""
    _, params, buffers, batch, loss_fn = _case()
    policy = POLICY.with_op_rules({"cross_entropy": OpRule.FLOAT32})
    t = funcamp.trace(loss_fn, policy)(params, buffers, batch)
    (loss,) = [r for r in t.records if r.op == "cross_entropy"]
    assert loss.rule is OpRule.FLOAT32 and loss.input_dtypes[0] == F32
    assert loss.output_dtypes == (F32,)


def test_train_step_casts_params_and_batch_but_not_buffers() -> None:
    """The step's params and batch are cast at entry; its buffers stay as FSDP2 leaves them
    (float32 here: the logits are scaled in float32). Equal to jmp's recipe written into
    ``loss_fn`` under ``ops=none``, bit for bit, over a few steps. (Compiled, one and two
    ranks: tests/test_fsdp_equivalence.py.)"""
    _, params, buffers, batch, loss_fn = _case()
    opt = funcamp.adamw(1e-2, fused=True)
    runs = []
    for fn, policy in (
        (loss_fn, POLICY),
        (_jmp(lambda p, b, x: loss_fn(p, buffers, x), POLICY), "c=bf16,o=f32,ops=none"),
    ):
        step = funcamp.make_train_step(fn, opt, policy, compile=False, donate_state=False)
        state = funcamp.TrainState.create(params, opt, policy, buffers=buffers)
        losses = []
        for _ in range(4):
            state, metrics = step(state, batch)
            losses.append(metrics["loss"])
        runs.append((losses, state.params))
    assert_bitwise(runs[0], runs[1])
    assert runs[0][1]["qkv.weight"].dtype == F32


def test_eval_step_keeps_the_buffers() -> None:
    _, params, buffers, batch, loss_fn = _case()
    evaluate = funcamp.make_eval_step(loss_fn, POLICY, compile=False)
    expected = _jmp(lambda p, b, x: loss_fn(p, buffers, x), POLICY)(params, buffers, batch)
    assert_bitwise(evaluate((params, buffers), batch), expected)


def _mlp(norm_inside: bool):
    """``norm -> linear -> gelu -> linear``: the LayerNorm sees the float32 input; with
    ``norm_inside`` it sees the first linear's output instead (bfloat16 under autocast), as a
    q/k LayerNorm does."""
    torch.manual_seed(0)
    if norm_inside:
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    else:
        model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    params, _ = funcamp.params_and_buffers(model)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

    def loss_fn(params, x, y):
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    return loss_fn, (params, x, y)


@pytest.mark.parametrize("norm_inside", [False, True], ids=["norm on the input", "norm inside"])
def test_mixed_bfloat16_equals_autocast_cpu_only_on_some_models(norm_inside: bool) -> None:
    """``mixed_bfloat16`` casts with CUDA's lists, ``torch.autocast("cpu")`` with CPU's: with
    the LayerNorm on the float32 input they agree bit for bit; on a bfloat16 activation it runs
    in float32 under CUDA's lists and in bfloat16 under CPU's. ``autocast_cpu`` equals
    torch.autocast("cpu") on both."""
    loss_fn, args = _mlp(norm_inside)
    with torch.autocast("cpu", BF16):
        reference = torch.func.grad_and_value(loss_fn)(*args)
    mixed = torch.func.grad_and_value(funcamp.amp(loss_fn, "mixed_bfloat16"))(*args)
    assert_bitwise(
        torch.func.grad_and_value(funcamp.amp(loss_fn, "autocast_cpu"))(*args), reference
    )
    if norm_inside:
        assert not torch.equal(mixed[1], reference[1])
    else:
        assert_bitwise(mixed, reference)
