"""vLLM's side of a switch-mode server: its dev endpoint, and what opens it.

A switch server loads a worker extension (vLLM's ``--worker-extension-cls``, the matrix's
``ab.extension``: fusedq's ``FusedqWorkerExtension`` by default) and runs with
``VLLM_SERVER_DEV_MODE=1``, which opens vLLM's dev endpoint ``POST /collective_rpc``: a method
of the extension run on every worker, each worker's answer in rank order. ``fusedq_set_path``
(the worker re-captures its CUDA graphs) answers ``{"path", "recaptured", "seconds",
"layers"}``; ``fusedq_state`` the path it runs; ``fusedq_seed`` seeds the worker's random
streams (synthetic MTP acceptance draws from them) and answers ``{"seed", "path"}``. What the
answers must say is the orchestrator's to check (orchestrator.execution.switch).

Only httpx (imported when a server is called) and the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fusedq import contract
from orchestrator.engines.base import WorkerAnswers, WorkerCallError
from orchestrator.engines.vllm.server import auth_headers

# The worker extension's methods (fusedq.vllm.worker_ext.FusedqWorkerExtension), by the names
# fusedq's contract gives them.
SET_PATH, STATE = contract.RPC_SET_PATH, contract.RPC_STATE
# fusedq_seed: the extension's third method, not in fusedq.contract yet (the contract is part
# of the kernel tree, whose every change needs a new GPU record).
SEED = "fusedq_seed"
RPC_PATH = "/collective_rpc"
# The environment variable that opens vLLM's dev endpoint, RPC_PATH.
DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "1")


def switch_server(
    args: Sequence[str], env: Mapping[str, str], extension: str
) -> tuple[tuple[str, ...], dict[str, str]]:
    """`args` and `env` plus the worker extension, the dev endpoint and no prefix caching:
    the k-th block of each path sends the same prompts, and the second block of a round
    would otherwise find the first's cached."""
    args = (*args, "--worker-extension-cls", extension, "--no-enable-prefix-caching")
    return args, {**env, DEV_MODE_ENV[0]: DEV_MODE_ENV[1]}


def collective_rpc(
    base_url: str,
    method: str,
    args: Sequence[str] = (),
    *,
    timeout_s: float,
    api_key: str | None = None,
) -> list[Any]:
    """POST /collective_rpc: `method` run on every worker; each worker's answer, in rank
    order. WorkerCallError naming the endpoint and the answer when it is not a list of
    results."""
    import httpx  # not at import: the CLI's plan path reaches this module without a server

    url = base_url.rstrip("/") + RPC_PATH
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=auth_headers(api_key)) as c:
            reply = c.post(url, json={"method": method, "args": list(args)})
    except httpx.HTTPError as exc:
        raise WorkerCallError(f"POST {url} {method}: {type(exc).__name__}: {exc}") from None
    if reply.status_code != 200:
        hint = {
            404: f" (no dev endpoint: the server needs {DEV_MODE_ENV[0]}=1)",
            500: " (the server log says why: does the worker extension define it?)",
        }.get(reply.status_code, "")
        raise WorkerCallError(
            f"POST {url} {method}: HTTP {reply.status_code}{hint}: {reply.text[:300]}"
        )
    try:
        results = reply.json()["results"]
    except (ValueError, KeyError, TypeError):
        results = None
    if not isinstance(results, list):
        raise WorkerCallError(f"POST {url} {method}: not a list of results: {reply.text[:300]}")
    return results


def set_path(
    base_url: str, path: str, *, timeout_s: float, api_key: str | None = None
) -> WorkerAnswers:
    """Every worker's answer to SET_PATH(`path`)."""
    answers = collective_rpc(base_url, SET_PATH, [path], timeout_s=timeout_s, api_key=api_key)
    return WorkerAnswers(SET_PATH, answers)


def path_state(base_url: str, *, timeout_s: float, api_key: str | None = None) -> WorkerAnswers:
    """Every worker's answer to STATE()."""
    return WorkerAnswers(
        STATE, collective_rpc(base_url, STATE, timeout_s=timeout_s, api_key=api_key)
    )


def seed_workers(
    base_url: str, seed: int, *, timeout_s: float, api_key: str | None = None
) -> WorkerAnswers:
    """Every worker's answer to SEED(`seed`), sent as text (the dev endpoint's args are
    JSON; the extension takes either)."""
    answers = collective_rpc(base_url, SEED, [str(seed)], timeout_s=timeout_s, api_key=api_key)
    return WorkerAnswers(SEED, answers)
