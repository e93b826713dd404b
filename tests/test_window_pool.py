"""The sliding-window layers' own KV pool (weft/engine/window_blocks.py): a sequence holds only its
window there, and nothing a request computes changes. Each engine test runs a tiny model with
windows of 8 keys (Gemma 3: three layers of four slide; Mistral: every layer) with the pool and
without it (`window_kv_pool=False`, every layer in one pool) and asserts the same tokens and the
same logprobs, bit for bit: the pool changes which blocks hold the keys, never the arithmetic."""

from __future__ import annotations

import itertools

import pytest
from conftest import shared_data
from test_scheduler import LIMITS, TOKENIZER

from weft import LLM, SamplingParams
from weft.config import CacheConfig, ModelConfig, read_json
from weft.engine.kv_cache import KVCacheManager
from weft.engine.kv_pools import bytes_per_token, split_pools, window_blocks_per_seq
from weft.engine.sequence import Sequence
from weft.params import BeamSearchParams

WINDOW = 8
OPTIONS = {"show_progress": False, "block_size": 4, "max_num_batched_tokens": 6}
PROMPTS = [[5 + (i * 7 + j) % 300 for j in range(30 + 9 * i)] for i in range(3)]


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def checkpoint(request, checkpoint_factory) -> str:
    overrides = {"sliding_window": WINDOW} if request.param == "mistral" else {}
    return str(checkpoint_factory(request.param, **overrides))


def records(llm: LLM, prompts, params: SamplingParams) -> list[tuple]:
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, c.logprobs, o.prompt_logprobs) for o in outputs for c in o.outputs]


def pair(checkpoint: str, **options) -> tuple[LLM, LLM]:
    with_pool = LLM(checkpoint, **OPTIONS, **options)
    assert with_pool.engine.kv.window is not None and with_pool.engine.kv.window.window == WINDOW
    one_pool = LLM(checkpoint, **OPTIONS, window_kv_pool=False, **options)
    assert one_pool.engine.kv.window is None
    return with_pool, one_pool


def test_a_window_pool_computes_what_one_pool_does(checkpoint):
    """Greedy and seeded runs several windows long, prompt chunks beside decode rows, with logprobs
    and prompt logprobs: equal; and every block comes back."""
    with_pool, one_pool = pair(checkpoint)
    for params in (
        SamplingParams(temperature=0, max_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=24, logprobs=1, ignore_eos=True),
    ):
        assert records(with_pool, PROMPTS, params) == records(one_pool, PROMPTS, params)
    assert with_pool.stats()["kv_blocks_used"] == 0


def test_a_sequence_holds_only_its_window(checkpoint):
    """Step by step through a long generation, each sequence holds at most a window's blocks of the
    window pool, while its blocks of the main pool grow with it."""
    llm = LLM(checkpoint, **OPTIONS)
    engine, kv = llm.engine, llm.engine.kv
    assert kv.window is not None
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    most = window_blocks_per_seq(WINDOW, kv.block_size)
    longest = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq_id, table in kv.window.tables.items():
            held = sum(block is not None for block in table.blocks)
            assert held <= most, f"sequence {seq_id} holds {held} window blocks, more than {most}"
            longest = max(longest, len(kv.tables[seq_id].blocks))
    assert longest * kv.block_size > 4 * WINDOW  # (the sequences did outgrow their windows)
    assert kv.num_used_blocks == 0


def test_preemption_prefix_hits_forks_beams_and_scores_with_a_window_pool(checkpoint):
    """Preempted sequences recompute the numbers of a roomy run; a prompt served from the prefix
    cache (the window before its hit found too) gives its tokens again; n=3 gives the tokens of
    three seeded requests; beams, exact choice scores and speculation equal one pool's."""
    with_pool, one_pool = pair(checkpoint)
    greedy = SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)
    expected = records(one_pool, PROMPTS, greedy)
    small = LLM(checkpoint, **OPTIONS, num_kv_blocks=20, max_model_len=80)
    assert records(small, PROMPTS, greedy) == expected
    assert small.stats()["num_preemptions"] > 0 and small.stats()["kv_blocks_used"] == 0

    first = records(with_pool, [PROMPTS[2]], greedy)
    hits = with_pool.stats()["prefix_cache_hit_tokens"]
    assert records(with_pool, [PROMPTS[2]], greedy)[0][0] == first[0][0]
    assert with_pool.stats()["prefix_cache_hit_tokens"] >= hits + len(PROMPTS[2]) - 2 * WINDOW

    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    (forked,) = with_pool.generate([PROMPTS[1]], sampled, use_tqdm=False)
    for i, completion in enumerate(forked.outputs):
        (single,) = with_pool.generate([PROMPTS[1]], sampled.replace(n=1, seed=7 + i), use_tqdm=False)
        assert completion.token_ids == single.outputs[0].token_ids

    def beams(llm: LLM) -> list[tuple]:
        params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
        (out,) = llm.beam_search([PROMPTS[0]], params)
        return [(b.token_ids, b.cumulative_logprob) for b in out.sequences]

    assert beams(with_pool) == beams(one_pool)
    options = ["the cat sat", "the dog ran far away", "a bird", "the cat sat on the mat"]

    def scores(llm: LLM) -> list[float]:
        return [s.logprob for s in llm.score(PROMPTS[0], options)]

    assert scores(with_pool) == scores(one_pool)
    ngram = {"method": "ngram", "num_speculative_tokens": 3}
    spec_pool, spec_one = pair(checkpoint, speculative_config=ngram)
    repeating = PROMPTS[0][:6] * 6
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert records(spec_pool, [repeating], plain) == records(spec_one, [repeating], plain)
    for llm in (with_pool, spec_pool):
        assert llm.stats()["kv_blocks_used"] == 0


def test_a_fork_shares_only_a_window_its_parent_still_holds():
    """The manager alone: blocks behind the window go back as the sequence passes them, a fork of
    a prefix whose window is gone is refused (the scheduler then recomputes it), and one at the
    parent's end shares both pools' blocks."""
    kv = KVCacheManager(CacheConfig(block_size=4, num_blocks=64, window=WINDOW, num_window_blocks=32))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = itertools.count(10_000)
    seq = Sequence.create(next(ids), params, list(range(100, 140)), LIMITS, seed=1, tokenizer=TOKENIZER)
    for _ in range(5):  # 5 steps of 8 tokens: positions 0 .. 39
        assert kv.allocate_slots(seq, 8) is not None
        seq.num_computed_tokens += 8
        kv.cache_full_blocks(seq)
    assert kv.window is not None
    assert kv.allocate_slots(seq, 0) is not None  # (the pass at position 40: blocks 0 .. 7 go back)
    held = [i for i, b in enumerate(kv.window.tables[seq.seq_id].blocks) if b is not None]
    assert held == [8, 9]  # position 40's window is 33 .. 40
    assert kv.window.num_used_blocks == 2 and len(kv.tables[seq.seq_id].blocks) == 10
    assert not kv.can_share(seq.seq_id, 20) and kv.can_share(seq.seq_id, 40)
    kv.fork(seq.seq_id, 99, 40)
    assert [b is not None for b in kv.window.tables[99].blocks] == [False] * 8 + [True] * 2
    kv.free(99)
    kv.free(seq.seq_id)
    assert kv.num_used_blocks == 0


def test_gemma3_keeps_what_its_global_layers_need_at_32k():
    """Gemma 3 270M's shape (5 sliding layers of 512 keys to each global one), float32 KV, the CPU's
    2 GiB: a 32k-token sequence costs its 3 global layers' 201 MB plus 34 blocks of the others (one
    pool: 1.21 GB); the main pool holds well over one such sequence."""
    config = ModelConfig.from_dict(read_json(shared_data("configs/gemma-3-270m-it/config.json")))
    layer_token = 2 * config.num_kv_heads * config.head_dim * 4  # float32 keys and values
    block = 16 * layer_token
    pools = split_pools(config, 16, block, 2 * 1024**3, None, 32768, 64, 2048)
    assert (pools.window, window_blocks_per_seq(512, 16)) == (512, 34)
    per_seq = 32768 * bytes_per_token(config, layer_token, True) + 34 * 15 * block
    assert per_seq < 0.22e9 and 32768 * bytes_per_token(config, layer_token, False) > 1.2e9
    assert pools.num_blocks * 16 > 4 * 32768
    assert pools.num_window_blocks * 15 * block <= 1024**3


def test_decode_graphs_read_the_window_pool():
    """A replayed decode step (weft/engine/graphs.py) takes the window pool's slots and tables into
    static buffers of their own, pads its rows there with that pool's scratch block, and hands the
    sliding-window layers metadata over them."""
    import numpy as np
    import torch

    from weft.engine.graphs import DecodeGraphs
    from weft.kernels import TorchKernels
    from weft.model.attention import build_attention_metadata

    seen = []

    class Model:  # what a replay hands the model, recorded
        attention = type("Backend", (), {"window": WINDOW})()
        kernels = TorchKernels()  # which stages the step's rows into the graph's buffers

        def __call__(self, input_ids, positions, kv_caches, meta):
            seen.append(meta)
            return torch.zeros(input_ids.shape[0], 1)

    caches = [torch.zeros(1)]
    graphs = DecodeGraphs(Model(), caches, 50, 4, 64, 4, window_scratch=20)  # type: ignore[arg-type]
    graphs.replays = {size: graphs._forward(size) for size in graphs.sizes}
    tables = np.array([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0], [9, 0, 0, 0, 0]])  # [B, max_blocks] main pool
    window_tables = np.array([[20, 20, 20, 11, 12], [20, 13, 14, 0, 0], [15, 0, 0, 0, 0]])  # 20: behind
    meta, positions = build_attention_metadata(
        [1, 1, 1], [19, 11, 2], tables, 4, torch.device("cpu"), ragged=True, window=WINDOW,
        window_tables=window_tables,
    )  # fmt: skip
    graphs.run(torch.tensor([3, 4, 5]), positions, meta)  # 3 rows, padded to 4
    replayed = seen[-1]
    assert replayed.windowed(WINDOW) is replayed.sliding and replayed.sliding.ragged.window == WINDOW
    assert replayed.slot_mapping.tolist() == [5 * 4 + 2, 8 * 4 + 2, 9 * 4 + 1, 50 * 4]  # positions 18, 10, 1
    assert replayed.sliding.slot_mapping.tolist() == [12 * 4 + 2, 14 * 4 + 2, 15 * 4 + 1, 20 * 4]
    assert replayed.sliding.ragged.block_table[:3, :5].tolist() == window_tables.tolist()
    assert replayed.sliding.ragged.block_table[3, 0] == 20  # the padding row reads the scratch block


def test_the_default_context_counts_the_layers_that_keep_every_token():
    """gpt-oss-20b's shape (every other layer slides over 128 keys): the CPU's 2 GiB of float32 KV
    hold twice the context for one sequence with the window pool; a model whose layers all slide
    is held to no KV budget at all."""
    import torch

    from weft.engine.args import EngineArgs
    from weft.engine.loading import _kv_budget_tokens

    config = ModelConfig.from_dict(read_json(shared_data("configs/gpt-oss-20b/config.json")))
    cpu = torch.device("cpu")
    with_pool = _kv_budget_tokens(EngineArgs(), config, torch.float32, cpu)
    one_pool = _kv_budget_tokens(EngineArgs(window_kv_pool=False), config, torch.float32, cpu)
    assert one_pool == 2 * 1024**3 // (24 * 2 * 8 * 64 * 4) and with_pool == 2 * one_pool
    every_layer = ModelConfig.from_dict(
        {
            **read_json(shared_data("configs/gpt-oss-20b/config.json")),
            "layer_types": ["sliding_attention"] * 24,
        }
    )
    assert _kv_budget_tokens(EngineArgs(), every_layer, torch.float32, cpu) == config.max_position_embeddings
