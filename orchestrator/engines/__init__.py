"""Serving-engine adapters: how to launch, probe, wait for and stop one engine's server.

Only vLLM exists today (`orchestrator.engines.vllm`). Adapters import nothing heavy at
module level: the CLI's `plan` path must stay fast.
"""
