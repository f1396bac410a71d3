"""funcamp.save / funcamp.load / funcamp.checkpoint_info: whole-state checkpoints that record what
produced them, check it on load, survive failures during a save, and reject damaged files."""

from __future__ import annotations

import io
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bitwise import assert_bitwise

import funcamp
import funcamp.checkpoints.save

ROOT = Path(__file__).resolve().parents[1]


def _state(policy="mixed_float16", scaler=None, seed=0, opt=None):
    gen = torch.Generator().manual_seed(seed)
    params = {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    buffers = {"seen": torch.tensor(7), "mean": torch.randn(3, generator=gen)}
    return funcamp.TrainState.create(
        params, opt or funcamp.adamw(1e-3), policy, buffers=buffers, scaler=scaler
    )


def _trained(policy="mixed_float16"):
    """A state a few steps in (non-trivial optimizer and scaler state, one skipped step)."""
    opt = funcamp.adamw(1e-2)
    state = _state(policy, funcamp.ScalerState.dynamic(2.0**10, growth_interval=2), opt=opt)
    if funcamp.get_policy(policy).compute_dtype != torch.float16:
        state = _state(policy, opt=opt)

    def loss_fn(params, buffers, batch):
        x, y = batch
        buffers["seen"].add_(1)
        return torch.nn.functional.mse_loss(x @ params["w"] + params["b"], y)

    step = funcamp.make_train_step(loss_fn, opt, policy, compile=False, donate_state=False)
    gen = torch.Generator().manual_seed(3)
    for i in range(4):
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        if i == 2:
            x[0, 0] = float("inf")
        state, _ = step(state, (x, y))
    return state


# ------------------------------------------------------------------------------- round trip


def test_round_trip_is_bit_identical_and_records_what_produced_it(tmp_path):
    state = _trained()
    assert int(state.scaler.skipped) == 1
    path = tmp_path / "ckpt.pt"
    funcamp.save(path, state, policy="mixed_float16", epoch=3, history=[0.5, 0.25], note="x")
    loaded = funcamp.load(path, _state(), policy="mixed_float16")
    assert_bitwise(loaded, state)
    assert isinstance(loaded, funcamp.TrainState)

    info = funcamp.checkpoint_info(path)
    assert info.policy == "params=float32,compute=float16,output=float32"
    assert info.scaler_kind == "dynamic" and info.scalers == {"scaler": "dynamic"}
    assert info.funcamp_version == funcamp.__version__
    assert info.torch_version == str(torch.__version__)
    assert info.metadata == {"epoch": 3, "history": [0.5, 0.25], "note": "x"}
    assert info.world_size == 1
    # A plain torch.load with weights_only=True reads it (no pickled code).
    raw = torch.load(path, weights_only=True)
    assert raw["state"]["scaler"]["kind"] == "dynamic"


def test_load_does_not_modify_the_template(tmp_path):
    funcamp.save(tmp_path / "c.pt", _trained(), policy="mixed_float16")
    template = _state()
    before = torch.utils._pytree.tree_map(
        lambda x: x.clone() if torch.is_tensor(x) else x, funcamp.state_dict(template)
    )
    loaded = funcamp.load(tmp_path / "c.pt", template, policy="mixed_float16")
    assert_bitwise(funcamp.state_dict(template), before)
    assert not torch.equal(loaded.params["w"], template.params["w"])


def test_policy_none_skips_the_policy_check(tmp_path):
    funcamp.save(tmp_path / "c.pt", _state(), policy="mixed_float16")
    loaded = funcamp.load(tmp_path / "c.pt", _state())
    assert_bitwise(loaded, _state())


def test_any_pytree_and_several_scalers(tmp_path):
    tree = {"a": _state(), "b": [funcamp.ScalerState.static(8.0), torch.arange(3)]}
    funcamp.save(tmp_path / "c.pt", tree, policy="bf16-mixed")
    info = funcamp.checkpoint_info(tmp_path / "c.pt")
    assert info.scalers == {"a/scaler": "dynamic", "b/0": "static"}
    assert info.scaler_kind is None
    assert_bitwise(funcamp.load(tmp_path / "c.pt", tree, policy="bf16-mixed"), tree)


# --------------------------------------------------------------------------- policy checks


def test_a_different_policy_is_an_error_naming_both(tmp_path):
    path = tmp_path / "c.pt"
    funcamp.save(path, _state("bf16-mixed"), policy="bf16-mixed")
    with pytest.raises(ValueError) as info:
        funcamp.load(path, _state("mixed_float16"), policy="mixed_float16")
    msg = str(info.value)
    assert msg.startswith("funcamp.load: ")
    assert "saved under policy 'params=float32,compute=bfloat16,output=float32'" in msg
    assert "`policy` is 'params=float32,compute=float16,output=float32'" in msg
    assert "convert=True" in msg


def test_module_overrides_count_as_a_different_policy(tmp_path):
    base = funcamp.get_policy("bf16-mixed")
    custom = base.with_module_policies({torch.nn.LayerNorm: "float32"})
    funcamp.save(tmp_path / "c.pt", _state(base), policy=custom)
    with pytest.raises(
        ValueError,
        match=r"first difference: module rule #1: .class torch.nn.modules.normalization.LayerNorm. in the checkpoint, None in `policy`",
    ):
        funcamp.load(tmp_path / "c.pt", _state(base), policy=base)
    funcamp.load(tmp_path / "c.pt", _state(base), policy=custom)  # the same: fine


def test_a_different_scaler_kind_is_an_error(tmp_path):
    saved = _state("mixed_float16", scaler=funcamp.ScalerState.static(128.0))
    funcamp.save(tmp_path / "c.pt", saved, policy="mixed_float16")
    with pytest.raises(
        ValueError, match=r"holds a 'static' scaler at scaler, but the template's is 'dynamic'"
    ):
        funcamp.load(tmp_path / "c.pt", _state("mixed_float16"), policy="mixed_float16")
    template = _state("mixed_float16", scaler=funcamp.ScalerState.static(1.0))
    loaded = funcamp.load(tmp_path / "c.pt", template, policy="mixed_float16")
    assert float(loaded.scaler.scale) == 128.0


def test_convert_to_bf16_params_casts_and_swaps_the_scaler(tmp_path):
    state = _trained("mixed_float16")
    funcamp.save(tmp_path / "c.pt", state, policy="mixed_float16")
    template = _state("bf16-true")
    out = funcamp.load(tmp_path / "c.pt", template, policy="bf16-true", convert=True)
    assert out.params["w"].dtype == torch.bfloat16
    assert torch.equal(out.params["w"], state.params["w"].to(torch.bfloat16))
    assert out.buffers["mean"].dtype == torch.bfloat16
    assert torch.equal(out.buffers["seen"], state.buffers["seen"])  # integers untouched
    assert torch.equal(out.opt_state.count, state.opt_state.count)  # optimizer state kept
    assert out.scaler.kind == "noop"  # the template's scaler: bf16 needs no loss scaling


def test_convert_keeps_a_scaler_of_the_same_kind(tmp_path):
    state = _trained("mixed_float16")
    funcamp.save(tmp_path / "c.pt", state, policy="mixed_float16")
    new = funcamp.get_policy("mixed_float16").with_op_rules({"softmax": funcamp.OpRule.COMPUTE})
    out = funcamp.load(tmp_path / "c.pt", _state(new), policy=new, convert=True)
    assert_bitwise(out, state)  # same dtypes, same scaler kind: nothing to change


def test_convert_needs_a_policy(tmp_path):
    funcamp.save(tmp_path / "c.pt", _state(), policy="mixed_float16")
    with pytest.raises(TypeError, match=r"funcamp.load: convert=True needs `policy`"):
        funcamp.load(tmp_path / "c.pt", _state(), convert=True)


def test_save_refuses_a_policy_that_does_not_match_the_params(tmp_path):
    with pytest.raises(
        ValueError, match=r"funcamp.save: `policy` .*bfloat16.*state.params\['b'\] is torch.float32"
    ):
        funcamp.save(tmp_path / "c.pt", _state("mixed_float16"), policy="bf16-true")
    assert not (tmp_path / "c.pt").exists()


def test_metadata_must_load_with_weights_only(tmp_path):
    class Custom:
        pass

    with pytest.raises(TypeError, match=r"funcamp.save: metadata `obj` must be made of tensors"):
        funcamp.save(tmp_path / "c.pt", _state(), policy="mixed_float16", obj=Custom())
    assert not (tmp_path / "c.pt").exists()


def test_structure_mismatch_names_the_path(tmp_path):
    funcamp.save(tmp_path / "c.pt", _state(), policy="mixed_float16")
    other = _state()._replace(params={"w": torch.zeros(4, 3), "b": torch.zeros(5)})
    with pytest.raises(
        ValueError,
        match=r"funcamp.load: .* does not fit `template`: the checkpoint at \['params'\]\['b'\]",
    ):
        funcamp.load(tmp_path / "c.pt", other, policy="mixed_float16")


def test_bad_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"funcamp.save: `path` must be a str or os.PathLike"):
        funcamp.save(3, _state(), policy="mixed_float16")
    with pytest.raises(IsADirectoryError, match=r"funcamp.save: `path` .* is a directory"):
        funcamp.save(tmp_path, _state(), policy="mixed_float16")
    with pytest.raises(FileNotFoundError, match=r"funcamp.save: the directory of `path`"):
        funcamp.save(tmp_path / "no" / "c.pt", _state(), policy="mixed_float16")
    with pytest.raises(FileNotFoundError, match=r"funcamp.load: no checkpoint at"):
        funcamp.load(tmp_path / "missing.pt", _state())
    with pytest.raises(ValueError, match=r"funcamp.get_policy: unknown policy 'bf16_mixed'"):
        funcamp.save(tmp_path / "c.pt", _state(), policy="bf16_mixed")


# --------------------------------------------------------------------- damaged files


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "c.pt"
    funcamp.save(path, _trained(), policy="mixed_float16", epoch=1)
    return path


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1])
def test_truncated_file_is_a_clear_error(saved, keep):
    data = saved.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) - 1)
    saved.write_bytes(data[:n])
    with pytest.raises(
        ValueError, match=r"^funcamp.load: .* is not a readable checkpoint \(truncated or corrupted"
    ):
        funcamp.load(saved, _state(), policy="mixed_float16")
    with pytest.raises(ValueError, match=r"^funcamp.checkpoint_info: "):
        funcamp.checkpoint_info(saved)


def test_flipped_bytes_in_a_tensor_are_caught_by_the_checksum(saved):
    data = bytearray(saved.read_bytes())
    w = funcamp.load(saved, _state(), policy="mixed_float16").params["w"]
    at = bytes(data).find(w.reshape(-1)[:2].numpy().tobytes())
    assert at > 0
    data[at] ^= 0x40  # torch.load itself reads this without complaint
    saved.write_bytes(bytes(data))
    assert not torch.equal(torch.load(saved, weights_only=True)["state"]["params"]["w"], w)
    with pytest.raises(
        ValueError, match=r"^funcamp.load: .* is corrupted \(its contents do not match the CRC-32"
    ):
        funcamp.load(saved, _state(), policy="mixed_float16")


def test_garbage_and_foreign_files(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(500))
    with pytest.raises(ValueError, match=r"^funcamp.load: .* not a readable checkpoint"):
        funcamp.load(junk, _state())
    plain = tmp_path / "plain.pt"
    torch.save(funcamp.state_dict(_state()), plain)
    with pytest.raises(ValueError, match=r"^funcamp.load: .* is not a funcamp checkpoint"):
        funcamp.load(plain, _state())
    newer = tmp_path / "newer.pt"
    raw = torch.load(_save_one(tmp_path), weights_only=True)
    torch.save({**raw, "version": 99}, newer)
    with pytest.raises(ValueError, match=r"format version 99, newer than this funcamp reads"):
        funcamp.load(newer, _state())


def _save_one(tmp_path) -> Path:
    path = tmp_path / "one.pt"
    funcamp.save(path, _state(), policy="mixed_float16")
    return path


# -------------------------------------------------------------------------- atomicity


class _Boom(Exception):
    pass


def test_an_exception_in_the_middle_of_a_save_keeps_the_previous_checkpoint(saved, monkeypatch):
    good = saved.read_bytes()
    real_save = torch.save

    def half_then_fail(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if isinstance(f, io.BytesIO):  # save's own in-memory check of the metadata
            return
        f.truncate(f.tell() // 2)  # half a file written...
        raise _Boom("disk full")  # ... then the failure

    monkeypatch.setattr(funcamp.checkpoints.save.torch, "save", half_then_fail)
    with pytest.raises(_Boom):
        funcamp.save(saved, _state(seed=5), policy="mixed_float16", epoch=2)
    monkeypatch.undo()
    assert saved.read_bytes() == good
    assert sorted(p.name for p in saved.parent.iterdir()) == ["c.pt"]  # no temporary file left
    loaded = funcamp.load(saved, _state(), policy="mixed_float16")
    assert_bitwise(loaded, _trained())
    assert funcamp.checkpoint_info(saved).metadata == {"epoch": 1}


def test_an_interrupt_before_the_rename_keeps_the_previous_checkpoint(saved, monkeypatch):
    good = saved.read_bytes()

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(funcamp.checkpoints.save.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        funcamp.save(saved, _state(seed=5), policy="mixed_float16")
    monkeypatch.undo()
    assert saved.read_bytes() == good
    assert sorted(p.name for p in saved.parent.iterdir()) == ["c.pt"]


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        calls.append("fsync-dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync-file")
        real_fsync(fd)

    def replace(a, b):
        calls.append("replace")
        real_replace(a, b)

    monkeypatch.setattr(funcamp.checkpoints.save.os, "fsync", fsync)
    monkeypatch.setattr(funcamp.checkpoints.save.os, "replace", replace)
    funcamp.save(tmp_path / "c.pt", _state(), policy="mixed_float16")
    assert calls == ["fsync-file", "replace", "fsync-dir"]


def test_permissions_follow_the_umask(tmp_path):
    funcamp.save(tmp_path / "c.pt", _state(), policy="mixed_float16")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "c.pt").stat().st_mode) == 0o666 & ~umask


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    """A training process that saves after every step is killed with SIGKILL mid-run; resumed
    from its last checkpoint in a new process, it ends with the same bits as a run that was
    never interrupted (trained from scratch in that new process, to share its thread setup)."""
    worker = str(ROOT / "tests" / "ckpt_worker.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ckpt, steps = tmp_path / "ckpt.pt", 60
    victim = subprocess.Popen(
        [sys.executable, worker, str(ckpt), str(steps), str(tmp_path / "unused")],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in victim.stdout:
        if line.strip() == "saved 10":
            victim.send_signal(signal.SIGKILL)
            break
    victim.wait(timeout=120)
    assert victim.returncode == -signal.SIGKILL
    assert not (tmp_path / "unused").exists()  # it died mid-run
    killed_at = funcamp.checkpoint_info(ckpt).metadata["step"]
    assert 10 <= killed_at < steps

    out, ref = tmp_path / "out.pt", tmp_path / "ref.pt"
    resumed = subprocess.run(
        [
            sys.executable,
            worker,
            str(ckpt),
            str(steps),
            str(out),
            "--resume",
            "--reference",
            str(ref),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.startswith(f"resumed {killed_at}\n")
    got = torch.load(out, weights_only=True)
    want = torch.load(ref, weights_only=True)
    assert_bitwise(got, want)
    assert int(want["scaler"]["skipped"]) >= 1  # the overflowing step is in the run
    assert int(want["opt_state"]["count"]) + int(want["scaler"]["skipped"]) == steps


@pytest.mark.slow
def test_a_later_save_removes_what_a_killed_save_left_behind(tmp_path):
    """A process killed in the middle of a save leaves its temporary file (up to the whole
    state's size). While the writer lives, other saves to that path leave its file alone; once it
    is dead, the next save removes it -- and nothing else: other paths' temporary files, files of
    older funcamp versions (no writer in the name) and other files stay."""
    worker = str(ROOT / "tests" / "ckpt_worker.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ckpt = tmp_path / "ckpt.pt"
    victim = subprocess.Popen(
        [sys.executable, worker, str(ckpt), "5", str(tmp_path / "unused"), "--hang-in-save", "2"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in victim.stdout:
            lines.append(line.strip())
            if line.strip() == "writing":
                break
        assert lines == ["saved 1", "writing"]
        debris = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert len(debris) == 1 and debris[0].startswith(".ckpt.pt.")
        assert f".{victim.pid}." in debris[0]  # the writer's pid is in the name
        others = [".ckpt.pt.0123456789abcdef.tmp", ".other.pt.host.1.0123456789abcdef.tmp", "x.tmp"]
        for name in others:
            (tmp_path / name).write_bytes(b"keep")

        funcamp.save(ckpt, _state(seed=1), policy="mixed_float16")  # the writer is alive
        assert (tmp_path / debris[0]).exists()
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=60)
    assert victim.returncode == -signal.SIGKILL

    funcamp.save(ckpt, _state(seed=2), policy="mixed_float16")  # the writer is dead
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt.pt", *others])
    assert_bitwise(funcamp.load(ckpt, _state(), policy="mixed_float16"), _state(seed=2))


# ------------------------------------------------------- the whole policy, the header, the disk


def test_other_op_rules_are_a_different_policy_named_by_the_first_difference(tmp_path):
    base = funcamp.get_policy("mixed_float16")
    saved_with = base.with_op_rules({"softmax": funcamp.OpRule.COMPUTE})
    other = base.with_op_rules({"layer_norm": funcamp.OpRule.COMPUTE})
    assert str(saved_with).endswith(",ops.softmax=compute")  # the header's policy string
    funcamp.save(tmp_path / "c.pt", _state(), policy=saved_with)
    with pytest.raises(
        ValueError,
        match=r"first difference: op rule for 'layer_norm': 'float32' in the checkpoint, "
        r"'compute' in `policy`",
    ):
        funcamp.load(tmp_path / "c.pt", _state(), policy=other)
    funcamp.load(tmp_path / "c.pt", _state(), policy=saved_with)  # the same rules: fine
    info = funcamp.checkpoint_info(tmp_path / "c.pt")
    assert info.policy_spec["ops"] == {"table": "default", "rules": {"softmax": "compute"}}
    assert funcamp.get_policy(info.policy) == saved_with


def test_fp8_and_module_rule_differences_are_named(tmp_path):
    base = funcamp.get_policy("bf16-mixed")
    fp8 = base.with_fp8(funcamp.Fp8Recipe.delayed(history=4))
    funcamp.save(tmp_path / "c.pt", _state(base), policy=fp8)
    with pytest.raises(ValueError, match=r"first difference: FP8 history: 4 in the checkpoint, 8"):
        funcamp.load(
            tmp_path / "c.pt", _state(base), policy=base.with_fp8(funcamp.Fp8Recipe.delayed(8))
        )
    nested = base.with_module_policies({"enc.*": "float32"})
    funcamp.save(tmp_path / "m.pt", _state(base), policy=nested)
    with pytest.raises(
        ValueError, match=r"module rule 'path enc\.\*': compute dtype: 'float32' in the checkpoint"
    ):
        funcamp.load(
            tmp_path / "m.pt",
            _state(base),
            policy=base.with_module_policies({"enc.*": "bf16-mixed"}),
        )


def test_checkpoint_info_verifies_its_checksum_against_every_bit_flip(tmp_path):
    """One bit of every byte flipped in turn: checkpoint_info returns the saved header or raises
    ``ValueError: funcamp.checkpoint_info: ...``, never altered metadata or another error."""
    path = tmp_path / "c.pt"
    funcamp.save(path, {"w": torch.ones(2)}, policy="mixed_float16", step=1234, epoch=7, note="abc")
    good = funcamp.checkpoint_info(path)
    data = path.read_bytes()
    start = data.find(b"step")  # the pickled header: the metadata's keys and values
    assert start > 0
    altered = raised = 0
    for at in range(max(0, start - 400), min(len(data), start + 400)):
        flipped = bytearray(data)
        flipped[at] ^= 1 << (at % 8)
        path.write_bytes(bytes(flipped))
        try:
            info = funcamp.checkpoint_info(path)
        except ValueError as e:
            assert str(e).startswith("funcamp.checkpoint_info: "), e
            raised += 1
            continue
        altered += info != good
    assert altered == 0 and raised > 100


def test_load_with_info_returns_the_state_and_the_header_of_one_file(tmp_path):
    path = tmp_path / "c.pt"
    funcamp.save(path, _trained(), policy="mixed_float16", step=9)
    state, info = funcamp.load(path, _state(), policy="mixed_float16", with_info=True)
    assert_bitwise(state, _trained())
    assert info == funcamp.checkpoint_info(path) and info.metadata == {"step": 9}
    with pytest.raises(TypeError, match=r"`with_info` must be a bool"):
        funcamp.load(path, _state(), with_info="yes")


class _FullDisk:
    """A file whose writes fail with ENOSPC after ``room`` bytes, as a full disk does."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        self.room -= len(data)
        if self.room < 0:
            raise OSError(28, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("room", [0, 100, 2000])
def test_a_full_disk_raises_oserror_enospc_naming_the_path(saved, monkeypatch, room):
    import funcamp._core.atomic as atomic

    good = saved.read_bytes()
    real_fdopen = os.fdopen
    monkeypatch.setattr(atomic.os, "fdopen", lambda *a, **k: _FullDisk(real_fdopen(*a, **k), room))
    with pytest.raises(OSError) as caught:
        funcamp.save(saved, _state(seed=5), policy="mixed_float16")
    monkeypatch.undo()
    assert caught.value.errno == 28 and caught.value.filename == str(saved)
    assert "No space left on device" in str(caught.value)
    assert saved.read_bytes() == good
    assert sorted(p.name for p in saved.parent.iterdir()) == ["c.pt"]


def test_a_file_name_as_long_as_allowed_saves(tmp_path):
    path = tmp_path / ("c" * 250 + ".pt")  # 253 bytes: NAME_MAX is 255
    funcamp.save(path, _state(), policy="mixed_float16")
    funcamp.save(path, _state(seed=1), policy="mixed_float16")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]
    assert_bitwise(funcamp.load(path, _state()), _state(seed=1))
