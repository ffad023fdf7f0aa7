"""fusedq inside vLLM: the general plugin and the worker extension.

- ``plugin``: ``register()``, the entry point vLLM calls in every process it starts;
- ``releases``: the vLLM releases read, one row each; ``backends``: how each attention backend
  takes the decode query;
- ``patch``: the version guard and the recompiled ``MLAAttention.forward_impl``;
- ``layer_plan``: per layer, whether the fused op serves it, prewarm, the start-up lines;
- ``report``: the mode and the one line per worker; ``hook``: the decode-step hook;
  ``switch``: the process's decode path;
- ``query``: the tensor side (no vLLM imported), what the hook runs;
- ``worker_ext``: the worker extension that switches a running server's path.
"""
