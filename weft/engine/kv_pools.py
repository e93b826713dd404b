"""How the KV memory is split between the layers that keep every token and the sliding-window
layers' own pool (`weft/engine/window_blocks.py`).

A sequence holds at most `window_blocks_per_seq` blocks of the window pool (its window, the block
it writes into and one more a step's tokens may reach), and a step's tokens add at most a step's
worth; `max_num_seqs` sequences then never need more than

    window_need = max_num_seqs * window_blocks_per_seq + ceil(max_num_batched_tokens / block_size)

blocks there. The window pool gets that many, but at most half the KV memory (beyond it, a full
window pool makes sequences wait or be preempted as a full main pool does), and never more blocks
than the main pool (a sequence holds no more blocks of the window pool than of the main one). The
main pool gets the rest. A model whose layers all slide keeps no main pool's tensors at all: its
blocks there are bookkeeping (the prefix cache's hashes), sized for every sequence at full length.
"""

from __future__ import annotations

from dataclasses import dataclass

from weft.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVPools:
    num_blocks: int  # the main pool's
    window: int = 0  # the sliding-window layers' keys per query; 0: no window pool
    num_window_blocks: int = 0


def window_layers(config: ModelConfig) -> tuple[int, int]:
    """(the window of the model's sliding-window layers, how many layers slide); (0, 0): none."""
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    sliding = [w for w in windows if w > 0]
    return (max(sliding), len(sliding)) if sliding else (0, 0)


def has_window_pool(config: ModelConfig, max_len: int, enabled: bool = True) -> bool:
    """Whether the sliding-window layers get a pool of their own: they have a window shorter than
    the context (else they hold every token anyway)."""
    window, _ = window_layers(config)
    return enabled and 0 < window < max_len


def window_blocks_per_seq(window: int, block_size: int) -> int:
    """The most window-pool blocks one running sequence holds between steps."""
    return -(-(window - 1) // block_size) + 2


def split_pools(
    config: ModelConfig,
    block_size: int,
    layer_block_bytes: int,
    budget: int | None,
    num_blocks: int | None,
    max_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> KVPools:
    """The pools of a model with a window pool (`has_window_pool`): from `budget` bytes of KV memory
    (`layer_block_bytes`: one layer's block), or from `num_blocks` asked for the main pool."""
    window, num_sliding = window_layers(config)
    num_full = config.num_layers - num_sliding
    blocks_per_seq = -(-max_len // block_size)
    step_blocks = -(-max_num_batched_tokens // block_size)
    per_seq = window_blocks_per_seq(window, block_size)
    need = max_num_seqs * per_seq + step_blocks
    least = per_seq + step_blocks  # one sequence's window and a step's tokens
    if num_blocks is not None:
        return KVPools(num_blocks, window, max(least, min(need, num_blocks)))
    assert budget is not None
    if num_full == 0:  # every layer slides: the main pool is bookkeeping only
        num_window = max(least, min(need, budget // (num_sliding * layer_block_bytes)))
        return KVPools(blocks_per_seq * max_num_seqs + 1, window, num_window)
    num_window = max(least, min(need, budget // 2 // (num_sliding * layer_block_bytes)))
    main = (budget - num_window * num_sliding * layer_block_bytes) // (num_full * layer_block_bytes)
    if num_window > main:  # no saving: a sequence never holds more window blocks than main ones
        num_window = main = max(least, budget // (config.num_layers * layer_block_bytes))
    main = max(blocks_per_seq + 1, min(main, blocks_per_seq * max_num_seqs))
    return KVPools(main, window, num_window)


def bytes_per_token(config: ModelConfig, layer_token_bytes: int, window_pool: bool) -> int:
    """One more token's KV bytes in one sequence: every layer's, or with a window pool only those
    of the layers that keep every token."""
    num_layers = config.num_layers - (window_layers(config)[1] if window_pool else 0)
    return num_layers * layer_token_bytes
