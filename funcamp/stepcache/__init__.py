"""The compiled train step kept on disk: ``funcamp.Compile(cache_dir=...)``.

* ``cache``: :class:`~funcamp.stepcache.cache.CachedStep`. It saves what dynamo and inductor
  produced for a step, and loads it in a later process. It loads only where everything the step
  was specialised on still holds.
* ``key``: what an entry is keyed and checked on. That is values, code digests, the machine,
  torch's context, the inputs' structure, and dynamo's guard sources read back.
* ``files``: the source files an entry depends on, and the note that a step cannot be saved.

``import funcamp`` imports nothing here. The train step loads this package when a step is built
with ``Compile(cache_dir=...)``. (``cache`` imports dynamo's internals at module level; ``key``
reads more of them when a step is first keyed.) A saved step checks guard sources on every call.
They are read as the ``specialize=True`` guard filter reads them
(:mod:`funcamp._core.guard_sources`).
"""
