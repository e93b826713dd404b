"""weft's CUDA kernels in Triton (`attention.py`, `elementwise.py`), gathered into a kernel set
(`kernels.py`). Imported only when chosen, so weft installs and runs without Triton; CUDA-graph
replay of decode steps is `weft/engine/graphs.py`."""
