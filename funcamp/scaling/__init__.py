"""Loss scaling as pure functions over immutable state: :class:`~funcamp.ScalerState`
(``state``), ``scale``/``unscale``/``update`` without host syncs (``ops``), the skip-or-step of
``unscale_and_step`` (``step``), the collapse guard (``guard``) and the headroom report of a
policy (``headroom``). GradScaler's semantics, threaded explicitly."""
