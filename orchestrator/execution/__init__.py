"""A run, start to end: the input checks before anything starts (`preflight`), leftovers of
crashed runs (`leftover_check`), the loop over the plan's units (`runner`), the run
directory's manifest (`manifest`) and a resume (`resume`), one unit's server from placement to
its rows (`case_run`), what a case's own server measures (`measure`) and what a switching
server does (`switch`), live progress, an interrupted run, and `orchestrator nightly`."""
