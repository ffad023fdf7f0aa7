"""``fusedq-bench``: fusedq's kernels measured on a GPU, apart from the runtime package.

``cli`` is the command (``fusedq-bench``, ``python -m fusedq_bench``); ``harness`` captures and
times each path's CUDA graphs, ``replay`` one shape's graphs and row, ``chain`` the
predecessors of ``--chain``, ``floors`` the ``--floors`` kernels, ``sweep`` the launch-config
variants of ``--sweep``, ``bars`` what a run is held to, ``tables`` its Markdown table,
``eager`` the host time per call of ``--eager``, ``options`` a run's options, ``common`` what
they share, and ``sass`` the SASS scoreboard reader (``python -m fusedq_bench.sass``).
"""
