"""Ray: one placement group and one server actor per case (`launch`), the actor that owns a
case's `vllm serve` on its node (`server_actor`), fusedq shipped to each node and checked there
(`ship`), every node of the cluster (`nodes`), the processes a crashed run left behind
(`leftovers`), and `orchestrator gpu-check` (`gpucheck`, `gpucheck_worker`)."""
