"""Sequence classifier in Equinox with ``cutelayers.equinox.MeanPoolClassifier``, trained with optax
on synthetic data.

    python examples/classifier.py [--seed S] [--steps N]

Each sequence has a random length; its class is the marker token planted at a few random positions
among random filler tokens. Positions past the length are padding, filled with *other classes'*
markers, so a model that pooled over the padding would be misled: the mask has to work. Model:
token embedding -> per-token Linear + gelu (cutelayers, fused) -> masked mean pool -> Linear.
Exit status 1 unless the loss falls to under half its first value.
"""

from __future__ import annotations

import argparse
import secrets
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from cutelayers import equinox as cl_eqx

CLASSES, FILLER, SEQ, DIM, BATCH = 4, 60, 32, 32, 64
VOCAB = CLASSES + FILLER  # tokens 0..CLASSES-1 are the class markers
PLANTED = 3  # markers per sequence


def batch(rng: np.random.Generator, size: int):
    """tokens (size, SEQ) int32, mask (size, SEQ) bool, labels (size,) int32."""
    labels = rng.integers(0, CLASSES, size)
    lengths = rng.integers(PLANTED + 4, SEQ + 1, size)
    mask = np.arange(SEQ) < lengths[:, None]
    tokens = rng.integers(CLASSES, VOCAB, (size, SEQ))
    for row, (label, length) in enumerate(zip(labels, lengths)):
        tokens[row, rng.choice(length, PLANTED, replace=False)] = label
        tokens[row, length:] = (label + rng.integers(1, CLASSES, SEQ - length)) % CLASSES  # decoys
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), jnp.asarray(labels, jnp.int32)


class Classifier(eqx.Module):
    embed: eqx.nn.Embedding
    mix: cl_eqx.Linear
    head: cl_eqx.MeanPoolClassifier

    def __init__(self, key):
        embed, mix, head = jax.random.split(key, 3)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=embed)
        self.mix = cl_eqx.Linear(DIM, DIM, activation="gelu", key=mix)
        self.head = cl_eqx.MeanPoolClassifier(DIM, CLASSES, key=head)

    def __call__(self, tokens, mask):
        """One sequence: tokens (SEQ,), mask (SEQ,) -> logits (CLASSES,)."""
        x = jax.vmap(self.embed)(tokens)
        return self.head(jax.vmap(self.mix)(x), mask)


def loss_fn(model, tokens, mask, labels):
    logits = jax.vmap(model)(tokens, mask)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=None, help="seed of data and init (default: fresh)")
    parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1; got {args.steps}")
    seed = secrets.randbits(31) if args.seed is None else args.seed
    rng = np.random.default_rng(seed)
    print(f"seed {seed}; {CLASSES} classes, sequences of up to {SEQ} tokens, batch {BATCH}")

    model = Classifier(jax.random.key(seed))
    optimizer = optax.adam(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state, tokens, mask, labels):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens, mask, labels)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for i in range(args.steps):
        model, opt_state, loss = step(model, opt_state, *batch(rng, BATCH))
        losses.append(float(loss))
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}")

    tokens, mask, labels = batch(rng, 1024)  # held out: fresh sequences

    def accuracy(mask):
        return float(jnp.mean(jnp.argmax(jax.vmap(model)(tokens, mask), -1) == labels))

    # the mean of the last few steps: one batch's loss is noisy
    first, last = losses[0], float(np.mean(losses[-5:]))
    print(f"loss fell from {first:.4f} to {last:.4f}; held-out accuracy {accuracy(mask):.3f} "
          f"({accuracy(jnp.ones_like(mask)):.3f} if the padding were pooled too)")
    if not last < 0.5 * first:
        print("FAIL: the loss did not fall to under half its first value")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
