"""Argument checks shared by the Flax and Equinox modules (importing neither framework)."""

from __future__ import annotations


def check_tied_embedding(module: str, tie_embedding: bool, embedding, vocab_size: int, hidden: int) -> None:
    """A tied LM head takes the (vocab_size, hidden) embedding table at call time; an untied one
    uses its own kernel and takes none."""
    if tie_embedding and embedding is None:
        raise ValueError(f"{module}: tie_embedding=True needs the embedding table: call "
                         f"head(h, labels, embedding=table) with a table of shape (vocab_size, hidden) = "
                         f"({vocab_size}, {hidden})")
    if not tie_embedding and embedding is not None:
        raise ValueError(f"{module}: got an embedding table but tie_embedding=False, so the head uses its own "
                         "kernel; construct it with tie_embedding=True to tie the weights")
    if embedding is not None and tuple(embedding.shape) != (vocab_size, hidden):
        raise ValueError(f"{module}: embedding has shape {tuple(embedding.shape)}; expected (vocab_size, hidden) "
                         f"= ({vocab_size}, {hidden})")
