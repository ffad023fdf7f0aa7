"""The requests a workload sends and what they measure: the streaming client and its
metrics (`workload`), and whether two variants produced the same tokens (`tokens`)."""
