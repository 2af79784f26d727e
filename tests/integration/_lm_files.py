"""A small token file a causal LM can learn (``input_ids``, as ``fastload convert`` names the
field, plus a fixed ``idx`` that says which sample a row is), and a tiny random-weight Llama."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

VOCAB = 64


def write_lm_file(path: Path, samples: int = 400, *, seed: int = 0) -> Path:
    """``samples`` sequences of 8..95 ids, each an arithmetic progression modulo the vocabulary
    (so the loss has something to learn), in the fastload layout."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 96, samples).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.concatenate(
        [(rng.integers(1, VOCAB) + np.arange(n) * rng.integers(1, 4)) % (VOCAB - 1) + 1 for n in lengths]
    ).astype(np.uint16)
    with h5py.File(path, "w") as f:
        f.attrs["fastload_format"] = 1
        f.attrs["num_samples"] = samples
        f.create_dataset("input_ids/values", data=values)
        f.create_dataset("input_ids/offsets", data=offsets)
        f.create_dataset("idx", data=np.arange(samples, dtype=np.int64))
        f.create_dataset("lengths", data=lengths)
    return path


def tiny_llama(seed: int = 0):  # type: ignore[no-untyped-def]
    """A 2-layer Llama of hidden size 32 with random weights (about 30k parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)
