"""The bottom layer: what every other layer needs and nothing above it may be needed for.

* ``tree``: pytree helpers over optree's ``"funcamp"`` namespace;
* ``checks``, ``specs``: the checks behind every public function's
  ``funcamp.<api>: `arg` must be ...`` errors;
* ``context``: whether dynamo is tracing or a torch.func transform is active;
* ``numerics``, ``rounding``: the numerics shared by the optimizers and the scaler;
* ``atomic``: atomic file writes; ``donation``: what became of a donated state;
* ``collectives``: collectives for data parallel;
* ``progress``: the progress notices of a first compile;
* ``hints`` and ``version``.

It imports only torch and optree.
"""
