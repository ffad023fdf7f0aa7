"""All the orchestrator knows of vLLM, offered through the engine interface by `engine`
(orchestrator.engines.base.Engine): the argv, environment, start, readiness and stop of
`vllm serve` (`server`), its start-up phases (`startup`), its log lines (`logline`), its
`/metrics` names (`server_metrics`), its compile caches (`compile_cache`) and the dev endpoint
a switch-mode server's path is flipped through (`rpc`)."""
