"""ReaDy's swapped-state control: the ready modes' reader reads the committed GDN state (and deferred rows) of the
request one slot up instead of its own — what the reader gains from its own state is the difference.

Not a serving option: the control is a drafter (`SwappedStateDrafter`, a `Drafter` whose `draft` rolls the states
it is handed by one slot), so the library's round carries nothing for it. `Engine.generate` runs every round
over all of its slots, so each slot's neighbour is the same slot of the batch in every round; a batch needs two or
more slots (with one, the roll hands the slot its own state).

    python -m experiments.reader_swap --json tau_swapped.json --drafter DIR --batch 4 --modes ar ready [...]

takes `hyspec bench e2e`'s flags (every --batch >= 2), runs it with the reader drafter swapped, and labels the
report (`meta.reader_state = "swapped"`, the markdown's header says so).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
from flax import nnx

from hyspec_jax.models.drafter import Drafter

COMMAND = "python -m experiments.reader_swap"


class SwappedStateDrafter(Drafter):
    """A ReaDy drafter whose reader reads the state of the slot one row up (axis 1 of every leaf of `ssm` and
    `pending` is the slot)."""

    def draft(self, dstate, anchor, heads, ssm=None, num_slots=None, pending=None):
        if ssm is not None:
            ssm, pending = jax.tree.map(lambda x: jnp.roll(x, 1, axis=1), (ssm, pending))
        return super().draft(dstate, anchor, heads, ssm, num_slots=num_slots, pending=pending)


def swapped(drafter: Drafter) -> SwappedStateDrafter:
    """A copy of `drafter` (same weights, reader required) that drafts as `SwappedStateDrafter`."""
    if drafter.reader is None:
        raise ValueError("the swapped-state control needs a drafter with a ReaDy reader")
    clone = nnx.merge(*nnx.split(drafter))
    clone.__class__ = SwappedStateDrafter
    return clone


def main(argv: list[str] | None = None) -> int:
    from hyspec_jax.bench import e2e
    from hyspec_jax.bench.report import portable_command
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = e2e.build_parser()
    parser.prog = COMMAND
    a = parser.parse_args(argv)
    if min(a.batch) < 2:
        parser.error("the swapped-state control reads another request's state: every --batch must be >= 2")
    load = e2e.load_models

    def load_swapped(*args, **kw):
        target, drafters = load(*args, **kw)
        if drafters.get(True) is not None:
            drafters[True] = swapped(drafters[True])
        return target, drafters

    with mock.patch.object(e2e, "load_models", load_swapped):
        rc = e2e.main(argv)
    out = Path(a.json)
    report = json.loads(out.read_text())
    report["meta"].update(reader_state="swapped", command=portable_command(COMMAND, argv))
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(e2e.markdown(report))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
