"""The run directory: a case's result row (`rows`, with its audit in `stored_audit` and its
profile in `profile_figures`, all on the lenient base of `record`), the manifest (`manifest`),
the append-only store and resume (`store`), a recorded run as every reader sees it
(`recorded_run`), and figures corrected after they were written (`corrections`)."""
