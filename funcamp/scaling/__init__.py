"""Loss scaling as pure functions over immutable state: GradScaler's semantics, threaded explicitly.

* ``state``: :class:`~funcamp.ScalerState`;
* ``ops``: ``scale``/``unscale``/``update``, without host syncs;
* ``step``: the skip-or-step of ``unscale_and_step``;
* ``skip``: :class:`Skip`, the one place that keeps the old values of a skipped step;
* ``guard``: the collapse guard;
* ``headroom``: the headroom report of a policy.
"""
