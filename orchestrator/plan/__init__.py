"""What a run will do, before it does anything: the cases and what they need (`render`,
`orchestrator plan`), the units that run them, each one server (`units`), whether each case
runs the fused query (`fused`), and how long the run will take (`estimate`)."""
