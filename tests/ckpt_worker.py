"""A small training process for the checkpoint fault tests (run as a script by test_save.py).

    python tests/ckpt_worker.py CKPT STEPS OUT [--resume] [--reference REF_OUT] [--hang-in-save N]

Trains a bfloat16-compute MLP with a dynamic loss scaler (one overflowing batch, so the scaler state
matters), saving a checkpoint with funcamp.save after every step and printing ``saved N``; at the
end it writes the final state (funcamp.state_dict) to OUT. With --resume it starts from CKPT.
With --reference it then also trains from scratch, uninterrupted and without saving, in the same
process, and writes that final state to REF_OUT. The batch of step i depends on i only, so a
resumed run sees the same data. With --hang-in-save N, the save after step N writes part of its
temporary file, prints ``writing`` and waits to be killed (a crash in the middle of a save).
"""

from __future__ import annotations

import sys

POLICY = "bf16-mixed"
BAD_STEP = 3
_TORCH_SAVE = []  # the real torch.save, with --hang-in-save


def _setup():
    import torch

    import funcamp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    params, buffers = funcamp.params_and_buffers(model)
    opt = funcamp.adamw(1e-2)

    def loss_fn(params, buffers, batch):
        x, y = batch
        pred = torch.func.functional_call(model, (params, buffers), (x,))
        return torch.nn.functional.mse_loss(pred, y)

    def template():
        scaler = funcamp.ScalerState.dynamic(2.0**12, growth_interval=3)
        return funcamp.TrainState.create(params, opt, POLICY, buffers=buffers, scaler=scaler)

    step = funcamp.make_train_step(loss_fn, opt, POLICY, compile=False, donate_state=False)
    return template, step


def batch(i: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
    if i == BAD_STEP:
        x[0, 0] = float("inf")
    return x, y


def _half_then_hang(obj, f, *args, **kwargs):
    import io
    import time

    if isinstance(f, io.BytesIO):  # save's in-memory check of the metadata
        return _TORCH_SAVE[0](obj, f, *args, **kwargs)
    f.write(b"funcamp" * 1000)
    f.flush()
    print("writing", flush=True)
    time.sleep(600)


def main(argv: list[str]) -> None:
    import torch

    import funcamp

    torch.set_num_threads(1)
    ckpt, steps, out = argv[0], int(argv[1]), argv[2]
    template, step = _setup()
    state, start = template(), 0
    if "--resume" in argv:
        state = funcamp.load(ckpt, template(), policy=POLICY)
        start = funcamp.checkpoint_info(ckpt).metadata["step"]
        print(f"resumed {start}", flush=True)
    hang_at = int(argv[argv.index("--hang-in-save") + 1]) if "--hang-in-save" in argv else -1
    for i in range(start, steps):
        state, _ = step(state, batch(i))
        if i + 1 == hang_at:
            _TORCH_SAVE.append(torch.save)
            torch.save = _half_then_hang
        funcamp.save(ckpt, state, policy=POLICY, step=i + 1)
        print(f"saved {i + 1}", flush=True)
    torch.save(funcamp.state_dict(state), out)
    if "--reference" in argv:
        state = template()
        for i in range(steps):
            state, _ = step(state, batch(i))
        torch.save(funcamp.state_dict(state), argv[argv.index("--reference") + 1])


if __name__ == "__main__":
    main(sys.argv[1:])
