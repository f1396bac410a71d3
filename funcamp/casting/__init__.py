"""Per-op casting: the ``amp`` transform and what it needs at run time.

``amp`` runs a function under a torch function mode that casts each op's inputs as the
:class:`~funcamp.Policy` says (``amp``), with Python copies of C++ composites so their inner ops
are cast one by one as torch.autocast casts them (``cpp_composites``, ``cpp_einsum``, ``reentry``);
activation checkpointing under a policy (``remat``, ``amp.recompute_under``); FP8 matmuls and
their scaling state (``fp8``, ``fp8_matmul``); and the op-by-op record of what ran in which
dtype (``trace``). It reads policies (``funcamp.policy``) and never trains."""
