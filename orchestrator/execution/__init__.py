"""A run, start to end: the input checks before anything starts (`preflight`), the loop
over cases (`runner`), one case from placement to its result row (`case_run`), the pair on one
switching server (`switch`), live progress, an interrupted run, and `orchestrator nightly`."""
