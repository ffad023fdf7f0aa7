"""The matrix, read and checked. Pure (no torch, ray or vllm), so `orchestrator plan` answers
at once and every rule is unit-testable: the blocks a case is made of (`axes`), the matrix
and its run-wide blocks (`schema`), how a problem is told (`errors`), the expansion into
cases (`expand`), the rules across fields (`rules`) and the context a case's server takes
(`context`), the loader with `--set` and ${ENV}
(`load`), what a matrix may do beyond its axes (`policy`), and the vLLM flags the
orchestrator owns (`owned_flags`)."""
