"""What each MLA attention backend takes as its decode query, as data.

Per layer, the plan reads the class of the attention ``impl`` the layer got against
``ATTENTION_BACKENDS``: a backend that takes one ``[B, N, 576]`` tensor gets the fused output,
one that takes only a ``(q_nope, q_rope)`` pair (FLASH_ATTN_MLA_SPARSE, GLM-5's DSA decode on
sm_90) gets two views of it, and a backend without a row is refused with the reason
(docs/vllm-plugin.md).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

from fusedq.vllm.releases import Release


@dataclasses.dataclass(frozen=True)
class QueryForm:
    """A way an MLA backend's ``forward_mqa`` takes the decode query."""

    name: str  # in the enabled line: query=<name>
    text: str  # in a refusal: "<backend> takes <text>"
    # forward_mqa's line (stripped) that branches on the query's type, as read: a backend
    # whose source no longer has its form's line is not known any more.
    reads: tuple[str, ...]
    # Hand the fused [B, N, 576] output on as the (ql_nope, q_pe) views (``query.split_query``)
    # instead of as one tensor.
    split: bool


QUERY_FORMS: dict[str, QueryForm] = {
    # Joins a pair itself (torch.cat, concat_mla_q) or splits a tensor into views: a finished
    # tensor saves the join, or costs nothing.
    "tensor": QueryForm(
        "tensor",
        "one [M, H, 576] query or a (q_nope, q_rope) pair",
        ("if type(q) is tuple:", "if isinstance(q, tuple):"),
        split=False,
    ),
    # Raises on a tensor (FlashAttention 3 reads q_rope as `q` and q_nope as `q_v`).
    "pair": QueryForm(
        "pair", "only a (q_nope, q_rope) pair", ("if not isinstance(q, tuple):",), split=True
    ),
}


@dataclasses.dataclass(frozen=True)
class BackendRow:
    """One MLA attention backend whose ``forward_mqa`` this plugin was read against.

    Supporting another backend is a new row of this table, not a new branch of code: the plan
    decides per layer from the class of the ``impl`` the layer actually got, and refuses any
    class without a row (docs/vllm-plugin.md).
    """

    name: str  # vLLM's AttentionBackend.get_name()
    impl: str  # the impl class's __name__, matched exactly (a subclass may override forward_mqa)
    form: str  # a QUERY_FORMS key
    releases: tuple[str, ...]  # the RELEASES rows whose source of this forward_mqa was read


ATTENTION_BACKENDS: tuple[BackendRow, ...] = (
    # Dense. FLASH_ATTN_MLA and FLASHMLA (FP8 KV) ran the hook on the H200 (0.26.0).
    BackendRow("FLASH_ATTN_MLA", "FlashAttnMLAImpl", "tensor", ("0.26", "0.32")),
    BackendRow("FLASHMLA", "FlashMLAImpl", "tensor", ("0.26", "0.32")),
    BackendRow("TRITON_MLA", "TritonMLAImpl", "tensor", ("0.26", "0.32")),
    BackendRow("FLASHINFER_MLA", "FlashInferMLAImpl", "tensor", ("0.26", "0.32")),
    BackendRow("CUTLASS_MLA", "CutlassMLAImpl", "tensor", ("0.26", "0.32")),
    BackendRow("TOKENSPEED_MLA", "TokenspeedMLAImpl", "tensor", ("0.26", "0.32")),
    BackendRow("CPU_MLA", "CPUMLAImpl", "tensor", ("0.32",)),
    # Sparse (DSA: a model config with index_topk). FLASH_ATTN_MLA_SPARSE is sm_90's default.
    BackendRow("FLASH_ATTN_MLA_SPARSE", "FlashAttnMLASparseImpl", "pair", ("0.26", "0.32")),
    BackendRow("FLASHMLA_SPARSE", "FlashMLASparseImpl", "tensor", ("0.26", "0.32")),
    BackendRow("FLASHINFER_MLA_SPARSE", "FlashInferMLASparseImpl", "tensor", ("0.26", "0.32")),
    BackendRow(
        "FLASHINFER_MLA_SPARSE_SM120", "FlashInferMLASparseSM120Impl", "tensor", ("0.26", "0.32")
    ),
)


def backend_row(impl: str, release: str) -> BackendRow | None:
    """The ATTENTION_BACKENDS row of this impl class read for this RELEASES row, or None."""
    return next((b for b in ATTENTION_BACKENDS if b.impl == impl and release in b.releases), None)


@functools.cache
def _type_test(cls: type) -> str | None:
    """The first line of ``cls.forward_mqa`` that some query form reads (stripped), or None;
    ``ValueError`` when its source cannot be read."""
    known = {line for form in QUERY_FORMS.values() for line in form.reads}
    try:
        lines = inspect.getsource(cls.forward_mqa).splitlines()
    except (AttributeError, OSError, TypeError) as exc:
        raise ValueError(f"{cls.__name__}.forward_mqa has no readable source ({exc})") from exc
    return next((ln.strip() for ln in lines if ln.strip() in known), None)


def query_form(layer, release: Release, *, fp8_query: bool) -> tuple[QueryForm | None, str]:
    """How this layer's backend takes the decode query: ``(form, "")``, or ``(None, reason)``
    when this plugin does not know it."""
    cls = type(layer.impl)
    row = backend_row(cls.__name__, release.name)
    backend = _backend_name(layer, row)
    if row is None:
        # ("BACKENDS": the table's name when this message was first logged; kept as worded.)
        return None, (
            f"{backend} takes the decode query as {cls.__name__}.forward_mqa reads it, which this "
            f"plugin does not know (no BACKENDS row for {cls.__name__} under vLLM {release.name})"
        )
    form = QUERY_FORMS[row.form]
    try:
        line = _type_test(cls)
    except ValueError as exc:
        return None, f"{backend} takes a query this plugin cannot check: {exc}"
    if line not in form.reads:
        return None, (
            f"{backend} takes the decode query as {cls.__name__}.forward_mqa reads it now "
            f"({line!r}), which this plugin does not know (its row was read from "
            f"{' / '.join(map(repr, form.reads))})"
        )
    if form.split and fp8_query:
        # vLLM itself would hand such a backend one FP8 tensor: no combination to copy.
        why = f"{backend} takes {form.text} with an FP8 query, which this plugin does not know"
        return None, why
    return form, ""


def _backend_name(layer, row: BackendRow | None) -> str:
    backend = getattr(layer, "attn_backend", None)
    name = getattr(backend, "get_name", None)
    if callable(name):
        try:
            return str(name())
        except Exception:  # a name only labels the message
            pass
    return row.name if row is not None else type(layer.impl).__name__
