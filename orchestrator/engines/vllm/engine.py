"""vLLM as the orchestrator's engine: `VllmEngine`, the Engine interface
(orchestrator.engines.base, whose docstring gives a server's life in order) over this
package's modules. The registry (orchestrator.engines.ENGINES) names `ENGINE`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from orchestrator.config.expand import Case
from orchestrator.engines.spec_decode import SpecDecodeCounters
from orchestrator.engines.vllm import compile_cache, logline, rpc, server, server_metrics, startup


class VllmEngine:
    """`vllm serve` behind the Engine interface. No state: a copy pickled to a Ray actor is
    the same engine."""

    kind = "vllm"

    # -- 1. the command, on the driver -----------------------------------------------------
    def serve_env(self, *, host: str, run_dir: Path, extra: Mapping[str, str]) -> dict[str, str]:
        """server.serve_env, on nothing but what every server needs."""
        return server.serve_env({}, host=host, run_dir=run_dir, extra=extra)

    api_key = staticmethod(server.api_key)
    shared_compile_cache = staticmethod(compile_cache.prepare_shared)

    def serve_argv(
        self,
        case: Case,
        model_path: str,
        *,
        host: str,
        port: int,
        executable: str | None = None,
        profiler_dir: str | None = None,
    ) -> list[str]:
        """server.serve_argv for `case`'s topology, args and synthetic acceptance, serving
        the name its clients ask for (the model's `served_name`, else its label)."""
        return server.serve_argv(
            model_path,
            tp=case.tp,
            dcp=case.dcp,
            mtp=case.mtp,
            host=host,
            port=port,
            served_name=case.model.served_name or case.model.label,
            extra_args=list(case.args),
            vllm_bin=executable,
            profiler_dir=profiler_dir,
            mtp_acceptance=case.mtp_acceptance,
        )

    switch_server = staticmethod(rpc.switch_server)

    # -- 2. started, on the server's node --------------------------------------------------
    host_env = staticmethod(server.host_ip_env)
    run_dir_env = staticmethod(server.run_dir_env)
    start = staticmethod(server.start_server)

    # -- 3. ready ----------------------------------------------------------------------------
    wait_ready = staticmethod(server.wait_ready)
    is_port_clash = staticmethod(server.is_port_clash)

    # -- 4. measured -------------------------------------------------------------------------
    def spec_decode_counters(
        self, base_url: str, *, api_key: str | None = None
    ) -> SpecDecodeCounters | None:
        """server_metrics.read_spec_decode, with the key a guarded server wants."""
        return server_metrics.read_spec_decode(base_url, headers=server.auth_headers(api_key))

    acceptance_rates = staticmethod(server.synthetic_acceptance_rates)
    profile_request = staticmethod(server.profile_request)
    set_path = staticmethod(rpc.set_path)
    path_state = staticmethod(rpc.path_state)
    seed_workers = staticmethod(rpc.seed_workers)

    # -- 5. stopped --------------------------------------------------------------------------
    stop = staticmethod(server.stop_server)
    read_startup = staticmethod(startup.read_startup)

    # -- any time ----------------------------------------------------------------------------
    log_message = staticmethod(logline.message)
    probe_version = staticmethod(server.probe_version)


ENGINE = VllmEngine()
