"""All the orchestrator knows of vLLM: the argv, environment, start, readiness and stop of
`vllm serve` (`server`), its start-up phases (`startup`), its log lines (`logline`), its
`/metrics` names (`server_metrics`) and its compile caches (`compile_cache`)."""
