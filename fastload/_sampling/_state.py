"""The sampler's resume state: a plain, JSON-able dict, validated on load.

Besides the cursor, a state records what shaped the plan (sampler class, population, options),
so that loading it into a sampler that would plan differently fails with a clear message instead
of silently resuming a different epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastload._sampling._batch_options import check_int
from fastload._sampling._ranks import Cursor

STATE_FORMAT = 1
_CURSOR_KEYS = (
    "seed",
    "epoch",
    "plan_num_replicas",
    "deal_start",
    "num_replicas",
    "batches_consumed",
)


def dump_state(cursor: Cursor, *, seed: int, identity: Mapping[str, Any]) -> dict[str, Any]:
    """The state of a stream at ``cursor``; ``identity`` holds the JSON-able settings that
    must match on load."""
    return {
        "format": STATE_FORMAT,
        **identity,
        "seed": seed,
        "epoch": cursor.epoch,
        "plan_num_replicas": cursor.plan_replicas,
        "deal_start": cursor.start,
        "num_replicas": cursor.replicas,
        "batches_consumed": cursor.consumed,
    }


def check_identity(
    state: Mapping[str, Any], identity: Mapping[str, Any], *, required: tuple[str, ...] = ()
) -> None:
    """Raise ``ValueError`` unless ``state`` has the supported format, was saved with the same
    ``identity`` and holds the ``required`` keys. A differing setting is named before a missing
    key, so a state of another kind of sampler says so (its ``sampler`` differs) first."""
    if "format" in state and state["format"] != STATE_FORMAT:
        raise ValueError(
            f"sampler state format {state['format']!r} is not the supported {STATE_FORMAT}"
        )
    for key, mine in identity.items():
        if key in state and state[key] != mine:
            raise ValueError(
                f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                f"{key}={mine!r}; build the sampler with the same settings to resume"
            )
    missing = [key for key in ("format", *identity, *required) if key not in state]
    if missing:
        raise ValueError(f"sampler state lacks {', '.join(missing)}; got keys {sorted(state)}")


def load_state(state: Mapping[str, Any], *, identity: Mapping[str, Any]) -> tuple[int, Cursor]:
    """``(seed, cursor)`` of ``state``, after checking its format and that it was saved with
    the same ``identity``."""
    check_identity(state, identity, required=_CURSOR_KEYS)
    cursor = Cursor(
        epoch=check_int("state['epoch']", state["epoch"], minimum=0),
        plan_replicas=check_int(
            "state['plan_num_replicas']", state["plan_num_replicas"], minimum=1
        ),
        start=check_int("state['deal_start']", state["deal_start"], minimum=0),
        replicas=check_int("state['num_replicas']", state["num_replicas"], minimum=1),
        consumed=check_int("state['batches_consumed']", state["batches_consumed"], minimum=0),
    )
    return check_int("state['seed']", state["seed"], minimum=0), cursor
