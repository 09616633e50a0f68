"""Training loops (optax) for the models in :mod:`models`.

Empty for now: the training job lands once the models exist; until then the main job is
``python -m cutelayers`` (a short demo).
"""
