"""The train step: one algorithm, composed from public pieces, and the state it threads.

* ``step``: the algorithm, and its front door ``make_train_step``;
* ``config``: ``Compile`` and ``StepOptions``, each option declared once with its check, and
  every rule for what does not combine;
* ``loss``: forward and backward of the scaled loss;
* ``eval``: ``make_eval_step``;
* ``frozen``: parameters passed to the model but never trained;
* ``parallel``: the piece a step asks where processes differ;
* ``state``: the train state, and its way in and out of a module;
* ``torch_run``: a run moving between torch and funcamp (``TrainState.from_torch``/``to_torch``);
* ``compiling``: ``torch.compile`` with funcamp's guards and options (``errors`` explains a
  failed trace; ``pieces`` compiles a loss that cannot be one graph);
* ``wrapper``: the one wrapper every train step runs in (the per-call checks, the donated
  states refused).

Neighbours: checkpoints are :mod:`funcamp.checkpoints`, and the compiled step kept on disk is
:mod:`funcamp.stepcache`. The search for a policy is :mod:`funcamp.search`. Changes to torch's
compiler are :mod:`funcamp.compiler`, which the step calls.
"""
