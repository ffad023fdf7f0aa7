"""A run, start to end: the input checks before anything starts (`preflight`), leftovers of
crashed runs (`leftover_check`), the loop over cases (`runner`), the run directory's manifest
(`manifest`) and a resume (`resume`), one case from placement to its result row (`case_run`),
the pair on one switching server (`switch`), live progress, an interrupted run, and
`orchestrator nightly`."""
