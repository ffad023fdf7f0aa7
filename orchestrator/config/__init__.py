"""The matrix, read and checked: its schema, the loader, the rules, the expansion into
cases (`matrix`), what a matrix may do beyond its axes (`policy`), and the vLLM flags the
orchestrator owns (`owned_flags`)."""
