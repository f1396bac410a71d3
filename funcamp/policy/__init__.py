"""What to cast, as immutable data. Pure data and lookups: nothing here runs a model.

* ``policy``: :class:`~funcamp.Policy` (compute, param and output dtypes, per-op rules,
  per-module overrides, FP8) and its presets;
* ``ops``: the op tables, torch.autocast's CPU and CUDA lists among them;
* ``modules``: module keys and path globs;
* ``fp8``: the FP8 recipes.
"""
