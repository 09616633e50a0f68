"""Training loop (optax) for the models in :mod:`models`: ``python -m training.train --help``.

* :mod:`training.data`: the shipped public-domain corpus, byte-level tokens, deterministic
  batches, train / eval split.
* :mod:`training.train`: the command line and :func:`training.train.train`.
* :mod:`training.checkpoint`: Orbax checkpoints of (params, optimizer state, step).
* :mod:`training.sharding`: the device mesh (``--mesh``) and the rule table that lays parameters,
  optimizer state and batches over it.
* :mod:`training.bench`: the train-step benchmark, cutelayers vs stock vs reference (``--mesh``:
  over device meshes too).
"""
