"""What to cast, as immutable data. Pure data and lookups: nothing here runs a model.

* ``policy``: :class:`~funcamp.Policy` (compute, param and output dtypes, per-op rules,
  per-module overrides, FP8) and get_policy;
* ``ops``: the op tables, torch.autocast's CPU and CUDA lists and cast at entry among them;
* ``text``: the policy grammar ``get_policy`` reads and ``str(policy)`` writes, and the presets;
* ``describe``: a policy as plain data, for checkpoints;
* ``modules``: module keys and path globs;
* ``fp8``: the FP8 recipes.
"""
