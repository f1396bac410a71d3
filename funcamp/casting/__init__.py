"""Per-op casting: the ``amp`` transform and what it needs at run time.

* ``amp``: runs a function under a torch function mode that casts each op's inputs as the
  :class:`~funcamp.Policy` says;
* ``cpp_composites``, ``cpp_einsum``, ``reentry``: Python copies of C++ composites, so their
  inner ops are cast one by one as torch.autocast casts them;
* ``remat``, ``amp.recompute_under``: activation checkpointing under a policy;
* ``fp8``, ``fp8_matmul``: FP8 matmuls and their scaling state;
* ``trace``: the op-by-op record of what ran in which dtype.

It reads policies (``funcamp.policy``) and never trains.
"""
