"""A donated train step is all or nothing, proven by fault injection at every point.

A donated step (``make_train_step``'s default) writes the new state into the tensors of the
state it was given. Whatever raises in it -- ``KeyboardInterrupt`` anywhere, an allocation
failure, a torch error on one write -- the state must come out either bit for bit as it was (and
then train on exactly as from a fresh copy), or marked consumed: every later step, ``save``,
``state_dict``, ``load_into_module`` and eval step refuses it, naming the way back (the last
checkpoint, or ``donate_state=False``). Never half-written and accepted.

Eager (the foreach and fused optimizer paths): a ``TorchDispatchMode`` sees every aten op of one
step; the step is re-run from the same state once per op, raising at that op (before it runs),
so every write into the state -- ``lerp_``, ``addcmul_``, ``_foreach_*_``, ``copy_``, ``out=``
kernels, torch's fused Adam -- is a fault point, and every op between them too.

Compiled: the writes run inside the graph, whose wrapper (inductor's output code, or aot_eager's
fx graph module) is Python that calls one kernel (or one aten op) a line: a ``sys.settrace``
line hook raises at each line of it in turn -- a real failure in the middle of the graph, after
some of its in-place kernels have run and before the others.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
from exhaustive import exhaustive
from torch.utils._python_dispatch import TorchDispatchMode

import funcamp
from funcamp._core import donation

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_SLOW = pytest.mark.slow


def _mlp_params(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(4, 8, generator=g),
        "b1": torch.randn(8, generator=g) * 0.1,
        "w2": torch.randn(8, 2, generator=g),
        "b2": torch.zeros(2),
    }


def _loss(params, buffers, batch):
    x, y = batch
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ((h @ params["w2"] + params["b2"] - y).float() ** 2).mean()


_BATCH = (torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.ones(6, 2))

_POLICY = {torch.float32: "float32", torch.bfloat16: "bf16-true"}


def _fresh(opt, dtype):
    """A state (two steps in, so the optimizer's moments are not all zeros)."""
    policy = _POLICY[dtype]
    state = funcamp.TrainState.create(_mlp_params(dtype), opt, policy)
    warm = funcamp.make_train_step(_loss, opt, policy, compile=False, donate_state=False)
    for _ in range(2):
        state, _ = warm(state, _BATCH)
    return state


def _copy(state):
    """A copy of ``state`` with tensors of its own (and a scaler state object of its own)."""
    return torch.utils._pytree.tree_map(
        lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state
    )


def _tensors(state):
    return [x for x in torch.utils._pytree.tree_leaves(tuple(state)) if isinstance(x, torch.Tensor)]


def _snapshot(state):
    return [x.clone() for x in _tensors(state)]


def _raw(x):
    return x.contiguous().reshape(-1).view(torch.uint8)


def _bits_equal(state, snap) -> bool:
    return all(
        a.shape == b.shape and torch.equal(_raw(a), _raw(b))
        if a.dtype.is_floating_point
        else torch.equal(a, b)
        for a, b in zip(_tensors(state), snap)
    )


def _consumed(state) -> bool:
    return donation.status(state.scaler) not in (None, donation.CHECKED)


def _refused_everywhere(step, state, policy, everywhere=True) -> None:
    """Every later use of ``state`` raises funcamp's consumed-state error, naming the way out
    (only the step unless ``everywhere``: the other uses ask the same registry)."""
    uses = {
        "step": lambda: step(state, _BATCH),
        "save": lambda: funcamp.save(
            os.path.join(tempfile.mkdtemp(), "c.pt"), state, policy=policy
        ),
        "state_dict": lambda: funcamp.state_dict({"state": state}),
        "load_into_module": lambda: funcamp.load_into_module(torch.nn.Linear(1, 1), state),
        "eval": lambda: funcamp.make_eval_step(lambda p, b, x: x, policy, compile=False)(
            state, _BATCH[0]
        ),
    }
    for name, use in uses.items() if everywhere else [("step", uses["step"])]:
        with pytest.raises(ValueError, match="raised part-way") as info:
            use()
        message = str(info.value)
        assert "last checkpoint" in message and "donate_state=False" in message, name


class _Inject(TorchDispatchMode):
    """Count the aten ops of one step (and the writes into ``targets``' memory); with ``at``,
    raise ``error`` when op number ``at`` is about to run."""

    def __init__(self, targets=(), at=None, error=None):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in targets}
        self.at, self.error = at, error
        self.ops = 0
        self.writes: list[int] = []  # indices of the ops that write into a target

    def _writes_target(self, func, args, kwargs) -> bool:
        schema = func._schema
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
        for arg, value in zip(schema.arguments, values):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                    return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        index = self.ops
        self.ops += 1
        if self._writes_target(func, args, kwargs):
            self.writes.append(index)
        if index == self.at:
            raise self.error
        return func(*args, **kwargs)


_OPTIMIZERS = {
    "sgd": lambda: funcamp.sgd(0.05),
    "sgd-momentum": lambda: funcamp.sgd(0.05, momentum=0.9),
    "adam": lambda: funcamp.adam(1e-2),
    "adamw": lambda: funcamp.adamw(1e-2, weight_decay=0.1),
    "adam-fused": lambda: funcamp.adam(1e-2, fused=True),
    "adamw-fused": lambda: funcamp.adamw(1e-2, weight_decay=0.1, fused=True),
}


@pytest.mark.parametrize(
    ("name", "dtype"),
    [pytest.param(name, torch.float32, id=f"{name}-f32") for name in _OPTIMIZERS]
    + [
        # fused Adam takes float32 params only (bfloat16 ones with master weights)
        # bfloat16 params: one point in the suite (the write path is the optimizers' common
        # one); every optimizer in the exhaustive sweep
        pytest.param(
            name,
            torch.bfloat16,
            id=f"{name}-bf16",
            marks=[_SLOW] if name == "sgd-momentum" else [_SLOW, exhaustive],
        )
        for name in _OPTIMIZERS
        if "fused" not in name
    ],
)
def test_eager_fault_at_every_op(name, dtype):
    opt = _OPTIMIZERS[name]()
    policy = _POLICY[dtype]
    step = funcamp.make_train_step(_loss, opt, policy, compile=False)
    pure = funcamp.make_train_step(_loss, opt, policy, compile=False, donate_state=False)
    # What one clean step from the state gives, and where it writes.
    template = _fresh(opt, dtype)
    reference, _ = pure(_copy(template), _BATCH)
    step(_copy(template), _BATCH)  # the first call's checks run ops of their own
    state = _copy(template)
    with _Inject(_tensors(state)) as counted:
        step(state, _BATCH)
    assert counted.writes, "the donated step wrote nothing into its state"
    first_write = counted.writes[0]
    outcomes = []
    for at in range(counted.ops):
        interrupt, alloc = KeyboardInterrupt(), RuntimeError("can't allocate memory")
        # each write point with both; the ops between with one or the other
        errors = [interrupt, alloc] if at in counted.writes else [(interrupt, alloc)[at % 2]]
        for error in errors:
            state = _copy(template)
            with pytest.raises(type(error)), _Inject(at=at, error=error):
                step(state, _BATCH)
            if _bits_equal(state, _tensors(template)) and not _consumed(state):
                # untouched, and accepted: the next step is exactly a clean one
                new, _ = step(state, _BATCH)
                assert _bits_equal(new, _tensors(reference)), f"op {at}"
                outcome = "intact"
            else:
                _refused_everywhere(step, state, policy, everywhere="consumed" not in outcomes)
                outcome = "consumed"
        outcomes.append(outcome)
    # A fault before the state is marked leaves it intact and usable (the forward, the
    # backward, the checks: a loss_fn that raises); from the mark on -- at most a few ops
    # (the fused kernel's arguments) before the first write -- it is consumed.
    intact = outcomes.count("intact")
    assert outcomes == ["intact"] * intact + ["consumed"] * (counted.ops - intact)
    assert first_write - 4 <= intact <= first_write, (first_write, intact)


def test_eager_fault_counts_every_kind_of_write():
    """The harness sees the writes of the paths it tests: foreach (``_foreach_lerp_``...),
    torch's fused Adam kernel, and the count's copy."""

    class Names(_Inject):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self._writes_target(func, args, kwargs or {}):
                self.names.append(func.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)

    seen = {}
    for name in ("adam", "adam-fused", "sgd"):
        opt = _OPTIMIZERS[name]()
        state = _fresh(opt, torch.float32)
        with Names(_tensors(state)) as mode:
            mode.names = []
            funcamp.make_train_step(_loss, opt, "float32", compile=False)(state, _BATCH)
        seen[name] = mode.names
    assert any("fused_adam" in n for n in seen["adam-fused"]), seen
    assert len(seen["adam"]) > 3, seen  # moments, params and count, each a write


def test_loss_fn_error_leaves_the_state_usable():
    """A ``loss_fn`` that raises runs before the first write: the state is not marked."""
    opt = funcamp.adam(1e-2)
    step = funcamp.make_train_step(_loss, opt, "float32", compile=False)
    state = _fresh(opt, torch.float32)
    snap = _snapshot(state)
    with pytest.raises(RuntimeError):
        step(state, (torch.ones(6, 5), torch.ones(6, 2)))  # wrong shape
    assert _bits_equal(state, snap)
    step(state, _BATCH)  # accepted


def test_expanded_param_refused_before_any_write():
    """A stride-0 param (torch refuses to write into it in place) is refused by path, before
    the first write, eager and compiled."""
    params = _mlp_params(torch.float32)
    params["b1"] = torch.zeros(1).expand(8)
    opt = funcamp.adam(1e-2)
    for compile in (False, True):
        state = funcamp.TrainState.create(params, opt, "float32")
        snap = _snapshot(state)
        how = funcamp.Compile(backend="eager") if compile else False
        step = funcamp.make_train_step(_loss, opt, "float32", compile=how)
        with pytest.raises(ValueError, match=r"state\.params\['b1'\] share memory"):
            step(state, _BATCH)
        assert _bits_equal(state, snap)
    pure = funcamp.make_train_step(_loss, opt, "float32", compile=False, donate_state=False)
    pure(state, _BATCH)  # not written in place: accepted


def test_save_refuses_a_donated_state(tmp_path):
    """The file would hold params and count from after the step with the scaler from before."""
    opt = funcamp.adam(1e-2)
    state = funcamp.TrainState.create(_mlp_params(torch.float32), opt, "mixed_float16")
    step = funcamp.make_train_step(_loss, opt, "mixed_float16", compile=False)
    new, _ = step(state, _BATCH)
    with pytest.raises(ValueError, match=r"funcamp\.save: the state was donated"):
        funcamp.save(tmp_path / "c.pt", state, policy="mixed_float16")
    assert not (tmp_path / "c.pt").exists()
    with pytest.raises(ValueError, match=r"state_dict: the state at \['a'\] was donated"):
        funcamp.state_dict({"a": state})
    with pytest.raises(ValueError, match="load_into_module: `state` was donated"):
        funcamp.load_into_module(torch.nn.Linear(1, 1), state)
    funcamp.save(tmp_path / "c.pt", new, policy="mixed_float16")  # the returned one saves


def _aux_loss(params, buffers, batch):
    return ((params["w"] - 1.0) ** 2).sum(), {"w": params["w"], "view": params["w"][:1]}


@pytest.mark.parametrize("backend", [None, "aot_eager", pytest.param("inductor", marks=_SLOW)])
def test_aux_never_aliases_the_state(backend):
    """An aux that is a param (or a view of one) is the value of that step, not the memory the
    next steps write into."""
    opt = funcamp.sgd(0.1)
    kw = {"compile": False} if backend is None else {"compile": funcamp.Compile(backend=backend)}
    step = funcamp.make_train_step(_aux_loss, opt, "float32", has_aux=True, **kw)
    state = funcamp.TrainState.create({"w": torch.zeros(1)}, opt, "float32")
    logged = []
    for _ in range(4):
        state, metrics = step(state, None)
        logged.append(metrics["aux"])
    assert [float(a["w"]) for a in logged] == pytest.approx([0.0, 0.2, 0.36, 0.488])
    assert [float(a["view"]) for a in logged] == pytest.approx([0.0, 0.2, 0.36, 0.488])


# -- compiled ------------------------------------------------------------------------------------


def _graph_frame(frame) -> bool:
    """A frame of the compiled graph's Python wrapper: inductor's output code (one kernel call
    a line, in inductor's cache directory, wherever TORCHINDUCTOR_CACHE_DIR puts it) or an fx
    graph module (aot_eager: one aten op a line)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    name = frame.f_code.co_filename
    roots = (cache_dir(), os.path.realpath(cache_dir()))
    return name.startswith("<eval_with_key>") or name.startswith(roots)


class _LineFault:
    """``sys.settrace`` hook: count the lines the graph's wrapper runs; raise at line ``at``."""

    def __init__(self, at=None, error=None, key=None):
        self.at, self.error, self.key = at, error, key
        self.lines = 0
        self.marked: list[str | None] = []

    def __call__(self, frame, event, arg):
        if event == "call":
            return self.local if _graph_frame(frame) else None
        return None

    def local(self, frame, event, arg):
        if event == "line":
            if self.key is not None and not self.marked:
                self.marked.append(donation.status(self.key))
            index = self.lines
            self.lines += 1
            if index == self.at:
                raise self.error
        return self.local

    def __enter__(self):
        sys.settrace(self)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


def _compiled_fault_at_every_line(backend: str, name: str) -> None:
    opt = _OPTIMIZERS[name]()
    step = funcamp.make_train_step(_loss, opt, "float32", compile=funcamp.Compile(backend=backend))
    pure = funcamp.make_train_step(_loss, opt, "float32", compile=False, donate_state=False)
    template = _fresh(opt, torch.float32)
    reference, _ = pure(_copy(template), _BATCH)
    step(_copy(template), _BATCH)  # compiled
    state = _copy(template)
    with _LineFault(key=state.scaler) as counted:
        step(state, _BATCH)
    assert counted.lines > 0, "no line of the compiled graph was traced"
    # the state is marked before the graph runs, and donated only after it returned
    assert counted.marked == [donation.WRITING]
    assert donation.status(state.scaler) == donation.DONATED
    intact = 0
    for at in range(counted.lines):
        error = KeyboardInterrupt() if at % 2 == 0 else RuntimeError("can't allocate memory")
        state = _copy(template)
        with pytest.raises(type(error)), _LineFault(at=at, error=error):
            step(state, _BATCH)
        if _bits_equal(state, _tensors(template)) and not _consumed(state):
            new, _ = step(state, _BATCH)  # accepted: exactly a clean step
            torch.testing.assert_close(_tensors(new), _tensors(reference), rtol=1e-5, atol=1e-6)
            intact += 1
        else:
            _refused_everywhere(step, state, "float32", everywhere=at == 0)
    assert intact == 0  # every fault inside the graph leaves a marked state


@pytest.mark.parametrize("name", ["adam", pytest.param("sgd", marks=[_SLOW, exhaustive])])
def test_compiled_aot_eager_fault_at_every_op(name):
    _compiled_fault_at_every_line("aot_eager", name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("adamw", marks=exhaustive), "adam-fused"])
def test_compiled_inductor_fault_at_every_kernel(name):
    _compiled_fault_at_every_line("inductor", name)


def test_compiled_trace_failure_leaves_the_state_usable():
    """A trace that fails before the graph runs wrote nothing: the state is unmarked."""

    def loss_fn(params, buffers, batch):
        if float(params["w1"].sum()) > 1e9:  # a branch on a value: refused by the trace
            return params["w1"].sum()
        return _loss(params, buffers, batch)

    opt = funcamp.sgd(0.1)
    strict = funcamp.Compile(backend="eager", fullgraph=True)
    step = funcamp.make_train_step(loss_fn, opt, "float32", compile=strict)
    state = _fresh(opt, torch.float32)
    snap = _snapshot(state)
    with pytest.raises(RuntimeError, match="cannot be compiled"):
        step(state, _BATCH)
    assert _bits_equal(state, snap)
    assert not _consumed(state)
    funcamp.make_train_step(loss_fn, opt, "float32", compile=False)(state, _BATCH)
