"""Checkpoints of a whole training state.

* ``state_dict``: any pytree as plain nested dicts of tensors and Python scalars, loadable with
  ``torch.load(weights_only=True)`` (:func:`funcamp.state_dict`, :func:`funcamp.load_state_dict`);
* ``format``: what a checkpoint file holds and how it is checked (the header with the policy,
  scaler kinds, versions and metadata; the checksum);
* ``save``: :func:`funcamp.save`, :func:`funcamp.load` and :func:`funcamp.checkpoint_info`,
  atomic on one process;
* ``dcp``: the same through ``torch.distributed.checkpoint``, when a process group is given.
"""
