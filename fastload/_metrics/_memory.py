"""``estimate_memory``: the rule of thumb for a training step's device memory.

Total = parameters + gradients + optimizer states + activations, where

* parameters = ``parameters * bytes_per_param``;
* gradients = the same again (one gradient per parameter, same precision);
* optimizer states = ``parameters * bytes_per_param * k`` with ``k`` = 2 for Adam/AdamW (first
  and second moments), 1 for SGD with momentum, 0 for plain SGD;
* activations ≈ ``batch_size * seq_len * hidden * layers * bytes_per_param *
  activation_factor``: what the forward pass keeps for the backward pass.

The approximations, plainly:

* ``activation_factor`` is a property of the architecture. The default, 17, is what a standard
  transformer layer keeps per token per hidden unit without activation checkpointing (34 bytes
  at 16-bit precision, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models"); it leaves out the attention scores, which add ``5 * heads * seq_len /
  hidden`` to the factor unless a fused attention kernel avoids storing them, and grow with
  the sequence length squared. Activation checkpointing divides it by roughly the number of
  layers between checkpoints. Measure once and fit the factor for anything else.
* Mixed precision is not modelled: 16-bit weights with fp32 master copies and fp32 Adam states
  need about ``parameters * 16`` bytes in all, not ``parameters * 2 * 4``.
* Not counted: the framework's workspace (cuBLAS/cuDNN), the caching allocator's
  fragmentation (often 10-20 %), the CUDA context (several hundred MiB), the data batch itself,
  temporary buffers of individual operators, and anything sharded across devices.

So treat the result as a lower bound and keep a margin; :func:`~fastload.find_batch_size`
measures instead of estimating.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Optimizer → number of per-parameter state tensors it keeps.
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd_momentum": 1, "sgd": 0}

#: Activation values kept per token, per hidden unit, per layer (see the module docstring).
TRANSFORMER_ACTIVATION_FACTOR = 17.0


@dataclass(frozen=True)
class MemoryEstimate:
    """The four terms of :func:`estimate_memory` in bytes, their total, and the fit.

    ``activation_bytes_per_sample`` is the activation term for one sample. ``max_batch_size``
    is the largest batch whose total is at most ``budget_bytes`` (0 when the parameters,
    gradients and optimizer states alone exceed it; ``None`` without a budget).
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    activation_bytes_per_sample: float
    total_bytes: int
    budget_bytes: int | None
    max_batch_size: int | None

    @property
    def fits(self) -> bool | None:
        """Whether the total is within the budget (``None`` without a budget)."""
        return None if self.budget_bytes is None else self.total_bytes <= self.budget_bytes

    def __str__(self) -> str:
        def gib(n: float) -> str:
            return f"{n / 2**30:,.2f} GiB"

        lines = [
            f"parameters   {gib(self.params_bytes)}",
            f"gradients    {gib(self.grads_bytes)}",
            f"optimizer    {gib(self.optimizer_bytes)}",
            f"activations  {gib(self.activation_bytes)}",
            f"total        {gib(self.total_bytes)}",
        ]
        if self.budget_bytes is not None:
            verdict = "fits" if self.fits else "does not fit"
            lines.append(
                f"budget       {gib(self.budget_bytes)}: {verdict}; largest batch that fits: "
                f"{self.max_batch_size}"
            )
        return "\n".join(lines)


def estimate_memory(
    *,
    parameters: int,
    batch_size: int,
    seq_len: int,
    hidden: int,
    layers: int,
    bytes_per_param: int = 4,
    optimizer: str = "adam",
    activation_factor: float = TRANSFORMER_ACTIVATION_FACTOR,
    budget_bytes: int | None = None,
) -> MemoryEstimate:
    """Estimate a training step's memory by the rule of thumb in the module docstring (read
    its list of approximations before trusting the number). ``optimizer`` is one of
    ``"adam"``, ``"adamw"``, ``"sgd_momentum"``, ``"sgd"``."""
    for name, value, minimum in (
        ("parameters", parameters, 0),
        ("batch_size", batch_size, 0),
        ("seq_len", seq_len, 1),
        ("hidden", hidden, 1),
        ("layers", layers, 1),
        ("bytes_per_param", bytes_per_param, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"estimate_memory: {name} must be an integer >= {minimum}; got {value!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(
            f"estimate_memory: optimizer must be one of {', '.join(map(repr, OPTIMIZER_STATES))}; "
            f"got {optimizer!r}"
        )
    if not (isinstance(activation_factor, (int, float)) and 0 < activation_factor < math.inf):
        raise ValueError(
            f"estimate_memory: activation_factor must be a number > 0; got {activation_factor!r}"
        )
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0
    ):
        raise ValueError(f"estimate_memory: budget_bytes must be an integer >= 0; got {budget_bytes!r}")

    params = parameters * bytes_per_param
    states = params * OPTIMIZER_STATES[optimizer]
    per_sample = seq_len * hidden * layers * bytes_per_param * float(activation_factor)
    activations = math.ceil(batch_size * per_sample)
    fixed = 2 * params + states
    max_batch = None
    if budget_bytes is not None:
        max_batch = max(0, math.floor((budget_bytes - fixed) / per_sample))
    return MemoryEstimate(
        params_bytes=params,
        grads_bytes=params,
        optimizer_bytes=states,
        activation_bytes=activations,
        activation_bytes_per_sample=per_sample,
        total_bytes=fixed + activations,
        budget_bytes=budget_bytes,
        max_batch_size=max_batch,
    )
