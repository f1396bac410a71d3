"""What to cast, as immutable data: :class:`~funcamp.Policy` (compute, param and output
dtypes, per-op rules, per-module overrides, FP8) and its presets (``policy``), the op tables
(torch.autocast's CPU and CUDA lists among them: ``ops``), module keys and path globs
(``modules``) and the FP8 recipes (``fp8``). Pure data and lookups: nothing here runs a model."""
