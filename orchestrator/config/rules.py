"""The rules a matrix keeps that need more than one field: unique names, one baseline,
DCP and MTP within what the topology and the models allow, the host policy, the flags the
profile and A/B phases own, and a folder of its own for every case."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from orchestrator.config import policy as matrix_policy
from orchestrator.config.axes import TopologySpec
from orchestrator.config.context import context_bound
from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import Case, expand
from orchestrator.config.owned_flags import PROFILE_OWNED, owned_flag
from orchestrator.config.schema import SWITCH_FLAGS, SWITCH_SERVER_VARIANT, ABSpec, Matrix


def _dups(names: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    added = seen.add
    return sorted({n for n in names if n in seen or added(n)})  # type: ignore[func-returns-value]


def _check_variants(m: Matrix, source: str) -> None:
    """At least one variant, at most one baseline, and a baseline that same_tokens compares
    against runs first."""
    if not m.variants:
        raise MatrixError(
            source, "variants", "needs at least one variant (omit the key for one default)"
        )
    baselines = [v.name for v in m.variants if v.baseline]
    if len(baselines) > 1:
        raise MatrixError(
            source, "variants", f"more than one baseline: {', '.join(map(repr, baselines))}"
        )
    same = [w.name for w in m.workloads if w.same_tokens]
    if baselines and same and baselines[0] != m.variants[0].name:
        raise MatrixError(
            source, "variants", f"workload {same[0]!r} compares tokens against the baseline "
            f"{baselines[0]!r}, which must run first: list it first",
        )  # fmt: skip


def check_matrix(m: Matrix, source: str = "<matrix>") -> None:
    """Semantic checks that need more than one field; raise the first problem found."""
    for kind, names in (
        ("models", [x.label for x in m.models]),
        ("workloads", [x.name for x in m.workloads]),
        ("variants", [x.name for x in m.variants]),
    ):
        dup = _dups(names)
        if dup:
            raise MatrixError(source, kind, f"duplicate name {dup[0]!r}")
    _check_variants(m, source)
    columns = _dups(w.report_column for w in m.workloads)
    if columns:
        raise MatrixError(source, "workloads", f"two workloads report into column {columns[0]!r}")

    for ti, topo in enumerate(m.topologies):
        where = f"topologies[{ti}]"
        if not topo.mtp:
            raise MatrixError(source, f"{where}.mtp", "is empty; use [0] for MTP off")
        if topo.dcp != "divisors" and not topo.dcp:
            raise MatrixError(source, f"{where}.dcp", "is empty; use [1] for DCP off")
        for d in topo.dcp_values():
            if d < 1:
                raise MatrixError(source, f"{where}.dcp={d}", "must be >= 1")
            if topo.tp % d:
                raise MatrixError(source, f"{where}.dcp={d}", f"does not divide tp={topo.tp}")
            if d > 1 and m.resources.accelerator == "cpu":
                raise MatrixError(
                    source,
                    f"{where}.dcp={d}",
                    "is not possible on CPU: DCP needs an attention backend that returns the "
                    "softmax LSE; vLLM's CPU MLA backends do not (resources.accelerator=cpu): "
                    "use dcp: [1] on CPU",
                )
        for k in topo.mtp:
            if k < 0 or k > m.max_mtp:
                raise MatrixError(source, f"{where}.mtp={k}", f"must be within 0..{m.max_mtp}")
        _check_acceptance(m, topo, f"{where}.mtp_acceptance", source)
        if (
            m.resources.gpus_per_node
            and m.resources.accelerator == "gpu"
            and topo.tp > m.resources.gpus_per_node
        ):
            raise MatrixError(
                source,
                f"{where}.tp={topo.tp}",
                f"needs {topo.tp} GPUs on one node; "
                f"resources.gpus_per_node={m.resources.gpus_per_node}",
            )
        for mi, model in enumerate(m.models):
            if model.num_heads % topo.tp and not m.engine.pads_heads:
                raise MatrixError(
                    source,
                    f"{where}.tp={topo.tp}",
                    f"does not divide models[{mi}].num_heads={model.num_heads} ({model.label}); "
                    f"upstream vLLM refuses this. If your engine build pads heads "
                    f"({math.ceil(model.num_heads / topo.tp)} per rank), "
                    "set engine.pads_heads: true",
                )
            if model.num_heads < topo.tp:
                raise MatrixError(
                    source,
                    f"{where}.tp={topo.tp}",
                    f"exceeds models[{mi}].num_heads={model.num_heads}",
                )
            if any(k > 0 for k in topo.mtp) and model.no_mtp is not None:
                raise MatrixError(
                    source,
                    f"{where}.mtp",
                    f"MTP > 0 but models[{mi}] ({model.label}) {model.no_mtp}",
                )
    _check_host(m, source)
    cases = expand(m)
    _check_context(m, cases, source)
    _check_profile(m, cases, source)
    _check_ab(m, cases, source)
    dup = _dups(c.case_id for c in cases)
    if dup:
        raise MatrixError(source, "topologies", f"case {dup[0]!r} appears twice")
    _check_case_folders(cases, source)


def _check_host(m: Matrix, source: str) -> None:
    problem = matrix_policy.host_problem(m.host, m.bind_all_interfaces)
    if problem is not None:
        raise MatrixError(source, "host", problem)


# A case folder's name is one path component; most filesystems stop at 255 bytes.
_MAX_FOLDER_BYTES = 255


def _check_case_folders(cases: Sequence[Case], source: str) -> None:
    """Every case gets a folder of its own: two case ids that map to one folder name (or to
    names only case differs in, which a case-insensitive filesystem makes one) are refused,
    naming both. The mapping itself stays: committed runs are read by it."""
    seen: dict[str, Case] = {}
    for case in cases:
        slug = case.slug
        if len(slug.encode()) > _MAX_FOLDER_BYTES:
            raise MatrixError(
                source, "models", f"case {case.case_id!r} needs a folder name of "
                f"{len(slug.encode())} bytes, over the {_MAX_FOLDER_BYTES} a filesystem takes: "
                "shorten its model label",
            )  # fmt: skip
        other = seen.setdefault(slug.casefold(), case)
        if other is not case:
            raise MatrixError(
                source, "models", f"cases {other.case_id!r} and {case.case_id!r} would share "
                f"the folder cases/{slug}: give their models (or variants) labels that differ "
                "in more than punctuation, spaces or case",
            )  # fmt: skip


def _check_acceptance(m: Matrix, topo: TopologySpec, where: str, source: str) -> None:
    """Synthetic acceptance needs an MTP case, and a GPU."""
    if topo.mtp_acceptance is None:
        return
    if not any(k > 0 for k in topo.mtp):
        raise MatrixError(
            source, f"{where}={topo.mtp_acceptance}", "is for MTP cases, and every mtp here is 0"
        )
    if m.resources.accelerator == "cpu":
        # vllm/utils/cpu_triton_utils.py (0.32): `assert not SYNTHETIC_MODE`.
        raise MatrixError(
            source,
            f"{where}={topo.mtp_acceptance}",
            "is not possible on CPU: vLLM's CPU sampler refuses synthetic acceptance "
            "('Synthetic acceptance not supported with CPU sampling'); leave it out on CPU",
        )


def _check_context(m: Matrix, cases: Sequence[Case], source: str) -> None:
    """Every workload, and the profiled request, fits each case's context where it is known
    without loading the model (orchestrator.config.context): vLLM would refuse every request
    of a longer one, after the server's start."""
    bounds = [(case, context_bound(case)) for case in cases]
    per_model: dict[str, set[int | None]] = {}
    for case, bound in bounds:
        per_model.setdefault(case.model.label, set()).add(bound and bound.tokens)
    asks = [(f"workloads[{i}] ({w.name})", w.prompt_tokens, w.output_tokens)
            for i, w in enumerate(m.workloads)]  # fmt: skip
    if m.profile is not None:
        asks.append(("profile", m.profile.prompt_tokens, m.profile.decode_steps))
    for case, bound in bounds:
        if bound is None:
            continue
        for where, prompt, output in asks:
            if prompt + output <= bound.tokens:
                continue
            # A bound some of the model's cases set (a topology's or variant's args) names
            # the case it holds for.
            which = "" if len(per_model[case.model.label]) == 1 else f" (case {case.case_id!r})"
            raise MatrixError(
                source, where, f"prompt {prompt} + output {output} tokens exceed "
                f"{bound.what} {bound.tokens} of model {case.model.label!r}{which}",
            )  # fmt: skip


def _check_profile(m: Matrix, cases: Sequence[Case], source: str) -> None:
    """The profile phase owns vLLM's profiler flag: a case that passes its own is refused."""
    if m.profile is None:
        return
    owner = next((c for c in cases if any(_profiler_flag(a) for a in c.args)), None)
    if owner is not None:
        raise MatrixError(
            source,
            "profile",
            f"case {owner.case_id!r} passes --profiler-config itself; the profile phase "
            "sets it (remove it from args, or the profile key)",
        )


def _check_ab(m: Matrix, cases: Sequence[Case], source: str) -> None:
    """An A/B needs a baseline and a candidate and, in restarts mode, two starts of each;
    switch mode's server owns its extension and prefix-cache flags, and its blocks are the
    repeats."""
    ab = m.ab
    if ab is None:
        return
    names = [v.name for v in m.variants]
    if len(names) < 2:
        raise MatrixError(source, "ab", "needs two or more variants: a baseline and a candidate")
    workloads = [w.name for w in m.workloads]
    if ab.primary.workload is not None and ab.primary.workload not in workloads:
        raise MatrixError(
            source, f"ab.primary.workload={ab.primary.workload!r}",
            f"names no workload of this matrix; the workloads are {workloads}",
        )  # fmt: skip
    if ab.mode == "restarts":
        if ab.server_count < 2:
            raise MatrixError(
                source, f"ab.servers={ab.server_count}",
                "restarts mode needs 2 or more server starts per variant: one cannot show how "
                "far two servers of one configuration differ",
            )  # fmt: skip
        switch_only = {"blocks", "order", "first", "serve_as", "paths", "extension"}
        switch_only |= {"target_half_width_pct", "max_blocks"}
        extra = sorted(ab.model_fields_set & switch_only)
        if extra:
            raise MatrixError(source, f"ab.{extra[0]}", "is for mode: switch")
        return
    if SWITCH_SERVER_VARIANT in names:
        raise MatrixError(
            source, "variants", f"{SWITCH_SERVER_VARIANT!r} names a switch-mode server's own "
            "directory; call the variant something else",
        )  # fmt: skip
    for key in ([ab.serve_as] if ab.serve_as else []) + list(ab.paths):
        if key not in names:
            raise MatrixError(source, "ab", f"names variant {key!r}; the variants are {names}")
    _check_balance(ab.blocks, ab.order, source)
    _check_stopping(ab, source)
    for i, w in enumerate(m.workloads):
        if w.repeats != 1:
            raise MatrixError(
                source, f"workloads[{i}].repeats={w.repeats}",
                "ab.mode switch runs each workload once per block; the blocks are the repeats "
                "(set ab.blocks)",
            )  # fmt: skip
    for c in cases:
        flag = next((a for a in c.args if a.split("=", 1)[0] in SWITCH_FLAGS), None)
        if flag is not None:
            raise MatrixError(
                source, "ab",
                f"case {c.case_id!r} passes {flag.split('=', 1)[0]}; a switch-mode server gets "
                "it from the orchestrator (ab.extension, and no prefix caching)",
            )  # fmt: skip


def _check_balance(blocks: int, order: str, source: str) -> None:
    """Order abba promises that every variant's blocks sit at the same mean position on the
    server's schedule, so a drift linear in time lands on each alike. The positions 1..vb
    of v variants' b blocks sum to vb(vb + 1)/2, and rounds (one block of each variant)
    mirrored in pairs give each variant the same share only over an even number of rounds;
    for two variants no order at all can balance an odd b (each would need b(2b + 1)/2, not
    a whole number). An odd count is refused rather than rounded up: the run does what the
    matrix says."""
    if order != "abba" or blocks % 2 == 0:
        return
    raise MatrixError(
        source, f"ab.blocks={blocks}",
        "cannot be drift-balanced with order abba: each variant's blocks must sit at the same "
        f"mean position, which needs an even number of blocks per variant; use {blocks - 1} "
        f"or {blocks + 1} (or order: alternate, which is not drift-balanced)",
    )  # fmt: skip


def _check_stopping(ab: ABSpec, source: str) -> None:
    """The sequential stopping rule (orchestrator.analysis.sequential) looks after `blocks`
    rounds and every two after, up to `max_blocks`: its looks must be fixed before the run
    (the interval pays for each), and two rounds at a time keep the schedule drift-balanced
    (the next pair of Thue-Morse rounds mirror each other)."""
    target, cap = ab.target_half_width_pct, ab.max_blocks
    if target is None and cap is None:
        return
    if target is None:
        raise MatrixError(
            source, f"ab.max_blocks={cap}",
            "does nothing without ab.target_half_width_pct (the half-width to stop at); "
            "set both, or neither",
        )  # fmt: skip
    if cap is None:
        raise MatrixError(
            source, f"ab.target_half_width_pct={target:g}",
            "needs ab.max_blocks: the most rounds the stopping rule may run (the looks it "
            "pays for in the interval are counted up to it)",
        )  # fmt: skip
    if cap < ab.blocks:
        raise MatrixError(
            source, f"ab.max_blocks={cap}",
            f"is below ab.blocks={ab.blocks}: the rule first looks after ab.blocks rounds",
        )  # fmt: skip
    pairs = (
        "the rule adds rounds two at a time, a round and its mirror, which keeps the blocks "
        "drift-balanced at every look"
    )
    for key, value in (("max_blocks", cap), ("blocks", ab.blocks)):
        if value % 2:
            raise MatrixError(
                source, f"ab.{key}={value}",
                f"must be even under the stopping rule: {pairs}; use {value - 1} or {value + 1}",
            )  # fmt: skip
    if ab.server_count != 1:
        raise MatrixError(
            source, f"ab.servers={ab.server_count}",
            "the stopping rule needs one switch server per topology: with two or more the "
            "interval is over servers, which the rounds' rule does not bound",
        )  # fmt: skip


def _profiler_flag(arg: str) -> bool:
    # Every spelling vLLM reads as --profiler-config: dotted, abbreviated (owned_flags).
    return owned_flag(arg, PROFILE_OWNED) is not None
