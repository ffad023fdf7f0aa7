"""The requests a workload sends and what they measure: the workload client (`workload`), one
streamed request and its timeline (`stream`), the exact-length prompts (`prompts`), the metrics
computed from the request records (`metrics`), and whether two variants produced the same
tokens (`tokens`)."""
