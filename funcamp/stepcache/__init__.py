"""The compiled train step kept on disk: ``make_train_step(..., cache_dir=...)``.

``cache``: :class:`~funcamp.stepcache.cache.CachedStep`, which saves what dynamo and inductor
produced for a step and loads it in a later process, only where everything the step was
specialised on still holds; ``key``: what an entry is keyed and checked on (values, code
digests, the machine, torch's context, the inputs' structure, dynamo's guard sources read back);
``files``: the source files an entry depends on and the note that a step cannot be saved.

Nothing here is imported by ``import funcamp``: the train step loads this package when a step
is built with ``cache_dir=`` (``cache`` imports dynamo's internals at module level, ``key``
reads more of them when a step is first keyed). The guard sources a saved step checks on every
call are read as the ``specialize=True`` guard filter reads them
(:mod:`funcamp._core.guard_sources`)."""
