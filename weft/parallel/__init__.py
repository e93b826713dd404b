"""Tensor parallelism: one model sharded over several processes (`weft/parallel/group.py`,
`shard.py`, `workers.py`)."""
