"""weft's CUDA path: Triton kernels (`attention.py`, `elementwise.py`) gathered into a kernel set
(`kernels.py`), and CUDA-graph replay of decode steps (`graphs.py`). Imported only when chosen, so
weft installs and runs without Triton."""
