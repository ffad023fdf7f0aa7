"""What the figures say: intervals (`stats`), the A/B verdict (`ab`), what changed between
two runs (`compare`), the evidence chain (`evidence`), profiler traces (`trace`), the kernel
names they are read by (`kernel_names`), and the decode step by kernel family, in one trace
(`step_work`) and between two paths (`step_compare`)."""
