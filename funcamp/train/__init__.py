"""The train step: one algorithm, composed from public pieces, and the state it threads.

The step (``step``: the algorithm; ``loss``: forward and backward of the scaled loss; ``eval``:
``make_eval_step``; ``frozen``: parameters passed to the model but never trained; ``parallel``:
the piece a step asks where processes differ), the train state and its way in and out of a
module (``state``), compiling a step (``compiling``: ``torch.compile`` with funcamp's guards
and options, a failed trace explained by ``errors``) and the one wrapper every train step runs
in (``wrapper``: the per-call checks, the donated states refused). Neighbours: checkpoints are
:mod:`funcamp.checkpoints`, the compiled step kept on disk is :mod:`funcamp.stepcache`, the
search for a policy is :mod:`funcamp.search`, and changes to torch's compiler are
:mod:`funcamp.compiler`, which the step calls."""
