"""The training step and what lives around it.

The step (``step``, ``loss``, ``eval``, ``frozen``, ``parallel``; the per-call checks and the
donation registry in ``compile``, the explanation of a failed trace in ``errors``), the train
state and its way in and out of a module (``state``), checkpoints (``checkpoint``,
``ckpt_format``, ``save``, ``save_dcp``), the compiled step kept on disk (``cache``,
``cache_files``, with its key in ``describe``) and the search for a policy (``search``). Changes
to torch's compiler are not here: they live in :mod:`funcamp.compiler`, which the step calls."""
