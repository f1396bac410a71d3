"""The bottom layer: what every other layer needs and nothing above it may be needed for.

Pytree helpers over optree's ``"funcamp"`` namespace (``tree``), the checks behind every public
function's ``funcamp.<api>: `arg` must be ...`` errors (``checks``, ``specs``), whether dynamo is
tracing or a torch.func transform is active (``context``), the numerics shared by the
optimizers and the scaler (``numerics``, ``rounding``), all-or-nothing writes into donated
tensors (``atomic``), collectives for data parallel (``collectives``), the progress notices of a
first compile (``progress``), hints (``hints``) and the version (``version``). Imports only torch
and optree."""
