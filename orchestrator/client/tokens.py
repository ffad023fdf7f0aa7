"""Same tokens: do two variants of one topology produce the same greedy token ids?

A workload with ``same_tokens: true`` records every request's output token ids and, per
position, the top logprobs (``stream.TOP_LOGPROBS``). Each variant after a topology's first
is then held against the first, request by request (the same prompts: they are drawn from the
matrix seed, the workload name and the request's index).

Identical ids are the expectation, but not a bitwise promise: the fused kernel and cuBLAS
reduce K in a different order, so a BF16 query can differ in its last bit, and where the
model's top two tokens are within rounding of each other (random-weight models are full of
such near-ties) greedy decoding may pick the other one -- after which the two texts
legitimately diverge. So only a request's *first* divergence is judged: it is a near-tie
when each run ranked the other's choice within ``NEAR_TIE_NATS`` of its own; anything else
(a clear winner that changed, a missing or failed request) is a difference, and the report
says where.

A run records only its top ``TOP_LOGPROBS`` tokens per position, so at a tie of more tokens
than that (BF16 logits of a random model tie exactly and often: seen on the H200 at 11 heads,
three tokens equal to 1e-5) the other run's choice may be missing. Its logprob is then at most
the run's lowest recorded one, which bounds the margin from below. A divergence where one run
measured a near-tie and the other's bound is within the tolerance is a *bounded* near-tie:
nothing recorded tells it from rounding, and the report says it was bounded, not measured.

Some cases' tokens cannot agree by construction, and are not compared (``not_compared``):
vLLM's synthetic MTP acceptance (a topology's ``mtp_acceptance``) accepts draft tokens by a
random draw from the GPU's generator, not by agreement with the target model, so a request's
tokens depend on where in the random stream its steps fall. Two servers started alike that
run the same-tokens workload first draw the same numbers (restarts mode); the blocks of one
switch-mode server's variants draw at different points of the stream, unless the server
reseeds every worker with the round's seed before each block, as a switch server under
synthetic acceptance does since 2026-12-06 (``reseeded``): then both paths of a round draw
alike and their tokens are compared.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# How close (in nats) two tokens' logprobs must be for a flipped choice to count as rounding.
# A one-ulp BF16 change in the query moves the tiny models' logits by ~1e-3; 0.05 is the
# margin below which the CPU e2e test (tests/fusedq/test_vllm_plugin.py) saw flips and above
# which a real kernel bug (wrong head, stale RoPE part) lands at once.
NEAR_TIE_NATS = 0.05
# Divergences kept in a check's record (the first one decides the sentence).
KEEP = 5

# A check's verdict: compare()'s three, or one of two for a check that compared nothing.
IDENTICAL, NEAR_TIE, DIFFERS = "identical", "near-tie", "differs"
NO_REFERENCE = "no-reference"  # the baseline case recorded no tokens for the workload
NOT_COMPARED = "not-compared"  # the tokens cannot agree by construction (not_compared)

SYNTHETIC_IN_SWITCH = (
    "synthetic MTP acceptance accepts draft tokens by a random draw, and a switch-mode "
    "server's blocks draw at different points of the GPU's random stream (the MTP 0 "
    "topologies and restarts mode compare tokens)"
)

Record = Mapping[str, Any]


def _key(rec: Record) -> tuple[int, int]:
    return int(rec.get("repeat", 0)), int(rec["index"])


def _logprob(tops: Sequence[Mapping[Any, float]] | None, pos: int, token: int) -> float | None:
    """Logprob of ``token`` at ``pos`` if the record kept it (JSON turns int keys to str)."""
    if not tops or pos >= len(tops):
        return None
    top = tops[pos] or {}
    value = top.get(token, top.get(str(token)))
    return None if value is None else float(value)


def _margin(
    tops: Sequence[Mapping[Any, float]] | None, pos: int, chosen: int, other: int
) -> tuple[float | None, bool]:
    """How far this run preferred its own choice over the other run's, and whether that is only
    a lower bound (the other's choice fell outside the recorded top: it is at most the lowest
    recorded logprob). (None, False) when nothing bounds it: this run did not record its own
    choice, or recorded no rival."""
    a, b = _logprob(tops, pos, chosen), _logprob(tops, pos, other)
    if a is None:
        return None, False
    if b is not None:
        return round(a - b, 6), False
    recorded = [float(v) for v in (tops[pos] or {}).values()]
    if len(recorded) < 2:
        return None, False  # only its own choice recorded: no rival bounds the other's
    return round(a - min(recorded), 6), True


def _divergence(ref: Record, got: Record, tol: float) -> dict[str, Any] | None:
    """The first position where the two token id lists part, judged; None when identical."""
    a, b = list(ref.get("token_ids") or []), list(got.get("token_ids") or [])
    pos = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if pos is None:
        if len(a) == len(b):
            return None
        pos = min(len(a), len(b))
        return {"position": pos, "reference_choice": None, "choice": None, "tie": False,
                "why": f"lengths differ ({len(a)} vs {len(b)} tokens)"}  # fmt: skip
    ref_margin, ref_bounded = _margin(ref.get("top_logprobs"), pos, a[pos], b[pos])
    got_margin, got_bounded = _margin(got.get("top_logprobs"), pos, b[pos], a[pos])
    # At most one side may be a bound: if both runs left the other's choice out, neither
    # measured the pair, and a change of winner is all the records show.
    tie = (
        ref_margin is not None
        and got_margin is not None
        and not (ref_bounded and got_bounded)
        and 0 <= ref_margin <= tol
        and 0 <= got_margin <= tol
    )
    found = {
        "position": pos,
        "reference_choice": a[pos],
        "choice": b[pos],
        "reference_margin": ref_margin,
        "margin": got_margin,
        "tie": tie,
    }
    # Only named when true, so rows written before bounds existed read the same.
    if ref_bounded:
        found["reference_margin_bounded"] = True
    if got_bounded:
        found["margin_bounded"] = True
    return found


def compare(
    reference: Iterable[Record], candidate: Iterable[Record], *, tol: float = NEAR_TIE_NATS
) -> dict[str, Any]:
    """Hold ``candidate``'s requests against ``reference``'s (records of one workload).

    Returns ``verdict`` (``identical``, ``near-tie`` or ``differs``), counts, and the first
    divergences with positions, token ids and each run's margin in nats.
    """
    refs = {_key(r): r for r in reference}
    gots = {_key(r): r for r in candidate}
    out: dict[str, Any] = {
        "requests": len(refs), "identical": 0, "ties": 0, "differs": 0, "divergences": [],
    }  # fmt: skip
    for key in sorted(refs.keys() | gots.keys()):
        ref, got = refs.get(key), gots.get(key)
        where = {"request": f"{key[0]}/{key[1]}"}
        if ref is None or got is None or ref.get("error") or got.get("error"):
            which = "reference" if ref is None or ref.get("error") else "compared"
            d = {**where, "tie": False, "why": f"the {which} run has no complete request here"}
        elif ref.get("token_ids") is None or got.get("token_ids") is None:
            d = {**where, "tie": False, "why": "no token ids recorded"}
        else:
            found = _divergence(ref, got, tol)
            if found is None:
                out["identical"] += 1
                continue
            d = {**where, **found}
        out["ties" if d["tie"] else "differs"] += 1
        if len(out["divergences"]) < KEEP:
            out["divergences"].append(d)
    out["verdict"] = DIFFERS if out["differs"] else (NEAR_TIE if out["ties"] else IDENTICAL)
    out["tolerance_nats"] = tol
    return out


def not_compared(
    *, mtp: int, mtp_acceptance: float | None, switch: bool, reseeded: bool = False
) -> str | None:
    """Why a case's tokens are not held against its baseline's, or None when they are: a
    case with synthetic MTP acceptance measured on a switch-mode server that did not reseed
    its workers before each block (see the module docstring). A server that reseeds them
    with the round's seed gives both paths of a round the same draws, and their tokens are
    compared (on the H100, 2026-12-06: identical in 24/24 requests at MTP 1)."""
    if switch and mtp > 0 and mtp_acceptance is not None and not reseeded:
        return SYNTHETIC_IN_SWITCH
    return None


def describe(check: Mapping[str, Any], *, reference: str, variant: str) -> str:
    """One sentence for reports: what was compared and, where they part, where."""
    n, same = check["requests"], check["identical"]
    head = f"{variant} vs {reference}: identical token ids in {same}/{n} requests"
    if check["verdict"] == IDENTICAL:
        return head
    first = next((d for d in check["divergences"] if not d["tie"]), check["divergences"][0])
    if "why" in first and first.get("reference_choice") is None:
        detail = f"request {first['request']}: {first['why']}"
    else:
        detail = (
            f"request {first['request']} parts at output token {first['position']}: "
            f"{reference} {first['reference_choice']}, {variant} {first['choice']} "
            f"(margins {_nats(first, 'reference_margin')} / {_nats(first, 'margin')})"
        )
    kind = (
        f"{check['ties']} near-tie(s) within {check['tolerance_nats']:g} nats"
        if check["verdict"] == NEAR_TIE
        else f"{check['differs']} real difference(s)"
    )
    return f"{head}; {kind}; {detail}"


def _nats(divergence: Mapping[str, Any], key: str) -> str:
    v = divergence.get(key)
    if v is None:
        return "not in top"
    if divergence.get(f"{key}_bounded"):
        return f">= {v:.3f} nats (other's choice below its recorded top)"
    return f"{v:.3f} nats"
