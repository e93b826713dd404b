"""Exact scoring of options after a prompt, in one pass over their token trie.

Each option is tokenized together with the prompt (`attribute`); the token sequences form a trie,
so the prompt and every prefix the options share are one node each, computed once. One forward
pass runs the whole trie with tree attention (a node sees itself and its ancestors, at position
= its depth) in borrowed KV blocks, and gives every node's logits; an option's logprob is the sum,
over its tokens, of the log-softmax at the node before each one. The last token of an option is
only predicted, never run, unless it also starts a longer option.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weft.arrays import column
from weft.engine.kv_cache import KVCacheManager
from weft.engine.runner import ModelRunner
from weft.outputs import ChoiceScore
from weft.sample.prompt_logprobs import prompt_logprobs
from weft.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Attributed:
    """One option's tokens: `token_ids` is the whole sequence (prompt, then option), and the
    option's own tokens are those from `start` on."""

    text: str
    token_ids: list[int]
    start: int


@dataclass(frozen=True, slots=True)
class TokenTrie:
    """Token sequences stored once per distinct prefix: node i holds `tokens[i]` after the node
    `parents[i]` (-1 for a first token); parents come before their children."""

    tokens: list[int]
    parents: list[int]
    paths: list[list[int]]  # per sequence, the node of each of its tokens

    @classmethod
    def build(cls, sequences: list[list[int]]) -> TokenTrie:
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}
        paths = []
        for seq in sequences:
            node, path = -1, []
            for token in seq:
                key = (node, token)
                if key not in children:
                    children[key] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = children[key]
                path.append(node)
            paths.append(path)
        return cls(tokens, parents, paths)


def attribute(tokenizer: Tokenizer, prompt: str | None, prompt_ids: list[int], option: str) -> Attributed:
    """The option's tokens after the prompt. A text prompt is tokenized together with the option,
    and the option's tokens start at the first token that differs from the prompt's own: where
    the tokenizer merges the end of the prompt with the start of the option, the merged token
    belongs to the option (and so does its logprob). A prompt of token ids is followed by the
    option's tokens, tokenized alone."""
    if prompt is None:
        return Attributed(
            option, prompt_ids + tokenizer.encode(option, add_special_tokens=False), len(prompt_ids)
        )
    full = tokenizer.encode(prompt + option)
    start = 0
    for a, b in zip(prompt_ids, full, strict=False):
        if a != b:
            break
        start += 1
    if start == 0:
        raise ValueError(
            f"option {option!r} merges with the very first token of the prompt: nothing to score it after"
        )
    if start == len(full):
        raise ValueError(f"option {option!r} adds no token after the prompt")
    return Attributed(option, full, start)


class ChoiceScorer:
    """Scores options with the engine's model, in KV blocks borrowed for the pass."""

    def __init__(self, runner: ModelRunner, kv: KVCacheManager) -> None:
        self.runner = runner
        self.kv = kv
        self.num_computed_tokens = 0  # trie nodes run, over all calls

    @torch.inference_mode()
    def score(self, options: list[Attributed]) -> list[ChoiceScore]:
        # Every token but each option's last runs; the last is only predicted.
        trie = TokenTrie.build([o.token_ids[:-1] for o in options])
        pairs: dict[tuple[int, int], int] = {}  # (predicting node, token) -> row, each pair once
        option_rows = []
        for option, path in zip(options, trie.paths, strict=True):
            rows = []
            for t in range(option.start, len(option.token_ids)):
                rows.append(pairs.setdefault((path[t - 1], option.token_ids[t]), len(pairs)))
            option_rows.append(rows)
        logprobs = self._logprobs(trie, list(pairs))  # [P] one per pair
        return [
            ChoiceScore(
                text=o.text,
                logprob=float(sum(logprobs[r] for r in rows)),
                token_ids=o.token_ids[o.start :],
                token_logprobs=[float(logprobs[r]) for r in rows],
            )
            for o, rows in zip(options, option_rows, strict=True)
        ]

    def _logprobs(self, trie: TokenTrie, pairs: list[tuple[int, int]]) -> np.ndarray:
        """Run the trie and return the logprob of each (node, next token) pair ([P] float)."""
        blocks = self.kv.borrow(len(trie.tokens))
        if blocks is None:
            raise ValueError(
                f"scoring needs KV room for {len(trie.tokens)} tokens and the cache has not that much "
                "free now; retry when fewer requests run, or give the engine more KV blocks"
            )
        try:
            runner = self.runner
            attn, positions = runner.attention.build_tree_metadata(
                trie.parents, blocks.block_ids, runner.block_size, runner.device, blocks.window_block_ids
            )
            input_ids = column(trie.tokens, np.int64, runner.device)
            hidden = runner.model(input_ids, positions, runner.kv_caches, attn)  # [N, hidden]
        finally:
            self.kv.give_back(blocks)
        self.num_computed_tokens += len(trie.tokens)
        rows = column([node for node, _ in pairs], np.int64, runner.device)
        targets = column([token for _, token in pairs], np.int64, runner.device)
        model = runner.model
        _, values, _ = prompt_logprobs(hidden[rows], targets, 0, model.compute_logits, kernels=model.kernels)
        return values[:, 0].double().cpu().numpy()  # [P]
