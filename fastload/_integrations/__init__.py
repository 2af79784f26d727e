"""What the Hugging Face integrations (``fastload.hf``, ``fastload.accelerate``) build on.

Nothing here imports ``transformers`` or ``accelerate``: the collate in ``_causal`` is pickled
into fastload's worker processes, which must not pay for importing them.
"""
