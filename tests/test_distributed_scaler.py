"""funcamp.distributed: found_inf consensus and gradient averaging on 2 gloo processes (CPU)."""

from __future__ import annotations

import math

import pytest
import ranks
import torch
import torch.distributed as dist

import funcamp
import funcamp.distributed as fdist

pytestmark = pytest.mark.distributed

WORLD_SIZE = 2
STEPS = 4
BAD_STEP = 2  # rank 1 alone sees an inf at this step
TIMEOUT_S = 120


def _loss(params, x, y):
    return ((x @ params["w"] + params["b"] - y) ** 2).mean()


def _step(params, opt_state, scaler, x, y, poison, opt):
    grads = torch.func.grad(lambda p: funcamp.scale(scaler, _loss(p, x, y)))(params)
    grads = fdist.all_reduce_grads(grads)
    grads = {**grads, "w": grads["w"] + poison}  # poison: 0 everywhere but one rank and step
    params, opt_state, info = funcamp.unscale_and_step(
        scaler, opt, grads, opt_state, params, group=dist.group.WORLD
    )
    return params, opt_state, funcamp.update(scaler, info.found_inf), info


def _run(step, rank):
    torch.manual_seed(0)  # identical initial params on every rank
    params = {"w": torch.randn(3, 2), "b": torch.zeros(2)}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data shard
    opt = funcamp.sgd(0.1)
    opt_state, scaler = opt.init(params), funcamp.ScalerState.dynamic(2.0**8, growth_interval=2)
    found = []
    for i in range(STEPS):
        x, y = torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)
        poison = torch.tensor(math.inf if (rank == 1 and i == BAD_STEP) else 0.0)
        params, opt_state, scaler, info = step(params, opt_state, scaler, x, y, poison, opt)
        found.append(bool(info.found_inf))
    return params, scaler, found


def _worker(rank: int, out_dir: str) -> None:
    ranks.init_rank(rank, WORLD_SIZE, out_dir, TIMEOUT_S)
    params, scaler, found = _run(_step, rank)
    averaged = fdist.all_reduce_grads({"g": torch.tensor([float(rank), 2.0])})["g"]
    res = {
        "params": params,
        "scaler": funcamp.state_dict(scaler),
        "found": found,
        "averaged": averaged,
        "any_false": bool(fdist.any_across(torch.tensor(False))),
        "any_rank1": bool(fdist.any_across(torch.tensor(rank == 1))),
    }
    ranks.save_results(res, out_dir, rank)
    ranks.leave()


@pytest.mark.slow
def test_two_ranks_skip_together_and_stay_identical(tmp_path):
    args = [(rank, str(tmp_path)) for rank in range(WORLD_SIZE)]
    run = ranks.start(_worker, args, tmp_path, preload=[__name__], timeout_s=TIMEOUT_S)
    results = run.results()
    expected_found = [i == BAD_STEP for i in range(STEPS)]
    for res in results:
        assert res["found"] == expected_found
        assert res["scaler"]["skipped"].item() == 1
        assert res["any_false"] is False and res["any_rank1"] is True
        assert torch.equal(res["averaged"], torch.tensor([0.5, 2.0]))
    r0, r1 = results
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), name
    for name in ("scale", "growth_tracker", "hysteresis_tracker", "skipped"):
        assert torch.equal(r0["scaler"][name], r1["scaler"][name]), name
    # scale trace: 256 -> clean, grow(512) -> skip, backoff (256) -> clean
    assert r0["scaler"]["scale"].item() == 256.0


@pytest.mark.slow
def test_step_with_collectives_compiles_to_one_graph(single_rank_group):
    """The collectives trace: one graph, no breaks, all-reduces in it, same result as eager.

    (One rank keeps this in-process and fast; the 2-rank test above checks the semantics.)
    """
    explain = torch._dynamo.explain(_run_once)(torch.tensor(0.0))
    assert explain.graph_count == 1 and explain.graph_break_count == 0
    code = "\n".join(g.code for g in explain.graphs)
    assert code.count("all_reduce") >= 2  # the packed gradients and the found_inf consensus
    compiled = torch.compile(_run_once, backend="aot_eager", fullgraph=True)
    for poison in (0.0, math.inf):
        want, got = _run_once(torch.tensor(poison)), compiled(torch.tensor(poison))
        assert bool(got[3].found_inf) == (poison == math.inf)
        for a, b in zip(want[0].values(), got[0].values()):
            assert torch.equal(a, b)
        assert torch.equal(want[2].scale, got[2].scale)


def _run_once(poison):
    params = {"w": torch.ones(3, 2), "b": torch.zeros(2)}
    opt = funcamp.sgd(0.1)
    scaler = funcamp.ScalerState.dynamic(2.0**8)
    x, y = torch.arange(12.0).reshape(4, 3) / 10, torch.ones(4, 2)
    return _step(params, opt.init(params), scaler, x, y, poison, opt)


def test_any_across_validates_flag():
    with pytest.raises(TypeError, match=r"funcamp.distributed.any_across: `flag` must be a 0-d"):
        fdist.any_across(torch.tensor([True]))


def test_collectives_need_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(RuntimeError, match=r"funcamp.distributed.all_reduce_grads: "):
        fdist.all_reduce_grads({"g": torch.ones(1)})
