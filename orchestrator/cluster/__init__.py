"""Ray: one placement group and one server actor per case, fusedq shipped to each node
(`launch`), every node of the cluster (`nodes`), the processes a crashed run left behind
(`leftovers`), and `orchestrator gpu-check` (`gpucheck`, `gpucheck_worker`)."""
