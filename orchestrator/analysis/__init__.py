"""What the figures say: intervals (`stats`), the A/B verdict (`ab`), what changed between
two runs (`compare`), the evidence chain (`evidence`), and profiler traces (`trace`)."""
