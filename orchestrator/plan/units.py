"""What a run executes: its units, each one `vllm serve` and the result rows it writes.

A matrix's cases are its rows; a unit is a server. Outside switch mode each case is a unit
of its own (``restart``: a server started, measured and stopped for that case alone). In an
A/B's switch mode (``ab.mode: switch``) one server per topology and start serves every
variant (``switch``): it is started as its own case (`server_case`), measures the variants in
blocks between path flips (`schedule`), and writes one row per variant
(orchestrator.execution.switch). orchestrator.execution.runner runs the units in order;
`orchestrator plan` counts them as its server launches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from orchestrator.config.expand import Case
from orchestrator.config.schema import SWITCH_SERVER_VARIANT, Matrix
from orchestrator.engines import engine_for

RESTART, SWITCH = "restart", "switch"


@dataclass(frozen=True)
class Unit:
    """One server of a run: what it is started as, the rows it writes and, in switch mode,
    its blocks."""

    kind: Literal["restart", "switch"]
    server: Case  # the case the server is started, audited and logged as
    cases: tuple[Case, ...]  # the rows it writes, in order: switch mode's baseline first
    blocks: tuple[str, ...] = ()  # a switch server's blocks in order, by variant name

    @property
    def shown_as(self) -> str:
        """The case id the live view files the server under: the run's view follows its
        cases, and a switch server's own id is none of them."""
        return self.cases[0].case_id


def run_units(matrix: Matrix, todo: Sequence[Case], cases: Sequence[Case]) -> list[Unit]:
    """The units that measure the `todo` cases, in run order: one case each; in switch mode
    every variant of a todo case's topology and start (all of them re-run: blocks of two
    servers do not pair), baseline first. `cases`: all the matrix's cases."""
    if not matrix.switch_mode:
        return [Unit(RESTART, c, (c,)) for c in todo]
    ab = matrix.ab
    assert ab is not None
    order = [v.name for v in matrix.variants]
    baseline = matrix.baseline_variant.name
    order.sort(key=lambda n: n != baseline)
    groups: dict[tuple[str, int | None], list[Case]] = {}
    for c in todo:
        key = (c.topology_id, c.server)
        if key not in groups:
            members = [x for x in cases if (x.topology_id, x.server) == key]
            groups[key] = sorted(members, key=lambda x: order.index(x.variant.name))
    units = []
    for members in groups.values():
        names = [c.variant.name for c in members]
        # Under the stopping rule the worst case: the run stops part-way along it, at a look.
        blocks = schedule(names, ab.worst_case_blocks, ab.order, ab.first)
        units.append(Unit(SWITCH, server_case(members, matrix), tuple(members), tuple(blocks)))
    return units


def schedule(variants: Sequence[str], blocks: int, order: str, first: str) -> list[str]:
    """The server's blocks in order, by variant (`variants` baseline first): `blocks` rounds
    of one block per variant. ``abba`` runs round k in the variants' order or against it as
    the Thue-Morse sequence says (parity of k's binary ones: A B, B A, B A, A B, B A, ...),
    so every two rounds mirror each other and each variant's blocks sit at the same mean
    position over any even number of rounds (a linear drift cancels; over a multiple of four
    a quadratic one too). ``alternate`` keeps the order every round: not drift-balanced."""
    names = list(variants)
    if first == "candidate":
        names = names[1:] + names[:1]
    out: list[str] = []
    for k in range(blocks):
        mirrored = order == "abba" and bin(k).count("1") % 2 == 1
        out += names[::-1] if mirrored else names
    return out


def server_case(unit: Sequence[Case], matrix: Matrix) -> Case:
    """The one server of `unit` (the variants of one topology and start): the `serve_as`
    variant's args and env, plus what the engine's switch server needs
    (Engine.switch_server: the extension, the endpoint that flips paths, no prefix caching)."""
    ab = matrix.ab
    assert ab is not None
    by_name = {c.variant.name: c for c in unit}
    baseline = matrix.baseline_variant.name
    name = ab.serve_as or next(n for n in by_name if n != baseline)
    chosen = by_name[name]
    engine = engine_for(matrix.engine.kind)
    args, env = engine.switch_server(chosen.args, dict(chosen.env), ab.extension)
    variant = chosen.variant.model_copy(update={"name": SWITCH_SERVER_VARIANT})
    return dataclasses.replace(chosen, variant=variant, args=args, env=tuple(sorted(env.items())))
