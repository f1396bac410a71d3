"""The compiled train step kept on disk: ``make_train_step(..., cache_dir=...)``.

``cache``: :class:`~funcamp.stepcache.cache.CachedStep`, which saves what dynamo and inductor
produced for a step and loads it in a later process, only where everything the step was
specialised on still holds; ``key``: what an entry is keyed and checked on (values, code
digests, the machine, torch's context, the inputs' structure, dynamo's guard sources read back);
``files``: the source files an entry depends on and the note that a step cannot be saved.

Imported only when a step is built with ``cache_dir=`` (``cache`` imports dynamo's internals);
``key`` is light and also serves the train step's ``specialize=True`` guard filter."""
