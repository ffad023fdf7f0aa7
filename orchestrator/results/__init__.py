"""The run directory: a case's result row (`rows`), the append-only store and resume
(`store`), a recorded run as every reader sees it (`recorded_run`), and figures corrected after
they were written (`corrections`)."""
