"""The training text: a small public-domain corpus shipped in the repo, byte-level tokens.

``training/data/corpus.txt`` (about 55 KB of ASCII English) holds chapters I-IV of Lewis
Carroll's *Alice's Adventures in Wonderland* (1865), the Declaration of Independence (1776) and
the Gettysburg Address (1863) -- all public domain; transcribed for this repo, so small differences
from any particular printed edition are possible.

Tokens are bytes (vocabulary 256): ``encode`` / ``decode`` need no tokenizer files.

Split: the corpus is cut into 2 KiB chunks and every ``eval_every_nth`` chunk (default: every
10th) goes to the eval split, so both splits cover all the texts. Batches are a pure function of
``(seed, step)``: training can stop and resume at any step and see exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

VOCAB_SIZE = 256
CORPUS_PATH = Path(__file__).resolve().parent / "data" / "corpus.txt"
CHUNK_BYTES = 2048


def encode(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as a uint8 token array."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Token ids (bytes) back to text; invalid UTF-8 is replaced, not raised."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def load_corpus(path: str | Path | None = None) -> np.ndarray:
    """The corpus (default: the shipped one) as uint8 tokens."""
    path = Path(path) if path is not None else CORPUS_PATH
    return np.fromfile(path, dtype=np.uint8)


@dataclasses.dataclass(frozen=True)
class TextData:
    """Train / eval token arrays and deterministic batching over them."""

    train: np.ndarray
    eval: np.ndarray

    @classmethod
    def load(cls, path: str | Path | None = None, *, eval_every_nth: int = 10) -> TextData:
        """Load the corpus and split it: every ``eval_every_nth`` 2 KiB chunk is eval data."""
        if eval_every_nth < 2:
            raise ValueError(f"eval_every_nth must be >= 2; got {eval_every_nth}")
        tokens = load_corpus(path)
        chunks = [tokens[i:i + CHUNK_BYTES] for i in range(0, len(tokens), CHUNK_BYTES)]
        is_eval = [i % eval_every_nth == eval_every_nth - 1 for i in range(len(chunks))]
        train = np.concatenate([c for c, e in zip(chunks, is_eval) if not e])
        evals = [c for c, e in zip(chunks, is_eval) if e]
        if not evals:
            raise ValueError(f"corpus {path or CORPUS_PATH} is too small for an eval split "
                             f"({len(tokens)} bytes; need at least {eval_every_nth} chunks of {CHUNK_BYTES})")
        return cls(train=train, eval=np.concatenate(evals))

    def check_seq_len(self, seq_len: int) -> None:
        for name, split in (("train", self.train), ("eval", self.eval)):
            if len(split) < seq_len + 1:
                raise ValueError(f"seq_len={seq_len} is too long for the {name} split ({len(split)} tokens)")

    def train_batch(self, step: int, batch_size: int, seq_len: int, seed: int,
                    rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each (batch_size, seq_len) int32: random windows of the train split,
        a pure function of (seed, step); targets are inputs shifted by one token. ``rows``: only
        those rows of the batch (one process's share), the same windows as in the whole batch."""
        rng = np.random.default_rng([seed, step])
        starts = rng.integers(0, len(self.train) - seq_len, size=batch_size)
        return _windows(self.train, starts[rows], seq_len)

    def eval_batches(self, batch_size: int, seq_len: int, max_batches: int | None = None,
                     rows: slice = slice(None)):
        """A fixed list of (inputs, targets) batches over the eval split: consecutive
        non-overlapping windows (the last partial batch dropped; at least one batch); ``rows``
        as for :meth:`train_batch`."""
        n_windows = (len(self.eval) - 1) // seq_len
        starts = np.arange(n_windows) * seq_len
        n_batches = max(1, n_windows // batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        batches = []
        for b in range(n_batches):
            s = starts[b * batch_size:(b + 1) * batch_size]
            if len(s) < batch_size:  # fewer windows than one batch: wrap around
                s = np.resize(s, batch_size)
            batches.append(_windows(self.eval, s[rows], seq_len))
        return batches


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    w = tokens[idx].astype(np.int32)
    return w[:, :-1], w[:, 1:]
