"""The engine: add requests, abort them, and step.

One `step()`:
  1. schedule: pick this step's tokens (`Scheduler.schedule`);
  2. run: the forward pass over them (`ModelRunner.execute`), logits for the sampling rows;
  3. sample: one vectorized pass over those rows (`Sampler`), one host sync;
  4. update: advance counters, append tokens (`Scheduler.update`);
  5. finish: token stop rules, detokenize, stop strings; finished requests free their blocks;
  6. fork: a request with n > 1 forks its other samples once its prompt is computed;
  7. emit a `RequestOutput` per request that progressed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from weft.config import EngineConfig
from weft.engine.kv_cache import KVCacheManager
from weft.engine.output import RequestState, SequenceOutput, TokenLogprobs
from weft.engine.runner import ModelRunner
from weft.engine.scheduler import Scheduler
from weft.model.llama import LlamaForCausalLM
from weft.outputs import EngineStats, RequestOutput, SamplerOutput
from weft.params import SamplingParams
from weft.request import FinishReason, Request, check_stop
from weft.sample.sampler import Sampler, SamplingBatch
from weft.tokenizer import Tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(config.cache)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.runner = ModelRunner(model, config.model, config.cache, config.device, config.dtype)
        self.sampler = Sampler()
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = frozenset(config.model.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        self.states: dict[str, RequestState] = {}
        self.sequences: dict[str, SequenceOutput] = {}  # sequence request id -> its output state
        self.parent_of: dict[str, str] = {}  # sequence request id -> user request id
        self._seeds = random.Random(config.seed)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError (and queues nothing) for a bad prompt."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate_prompt(prompt_ids)
        state = RequestState(request_id, prompt_text, prompt_ids, params.output_kind, params.n)
        self.states[request_id] = state
        first = self._new_sequence(state, 0, params)
        self.scheduler.add_request(first)

    def _validate_prompt(self, prompt_ids: list[int]) -> None:
        max_len = self.config.scheduler.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}; "
                "shorten the prompt or raise max_model_len"
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _new_sequence(self, state: RequestState, index: int, params: SamplingParams) -> Request:
        seed = self._seeds.getrandbits(62) if params.seed is None else params.seed + index
        request_id = state.request_id if state.num_samples == 1 else f"{state.request_id}#{index}"
        request = Request(
            request_id, list(state.prompt_token_ids), params, self.eos_token_ids, seed, prompt=state.prompt
        )
        seq = SequenceOutput.create(request, index, self.tokenizer)
        state.sequences.append(seq)
        self.sequences[request_id] = seq
        self.parent_of[request_id] = state.request_id
        return request

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all of its samples) and free its KV blocks at once."""
        state = self.states.pop(request_id, None)
        if state is None:
            return
        for seq in state.sequences:
            self.scheduler.abort(seq.request.request_id)
            self._forget(seq.request.request_id)

    def _forget(self, seq_id: str) -> None:
        self.sequences.pop(seq_id, None)
        self.parent_of.pop(seq_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        logits = self.runner.execute(sched)  # [S, V]
        sampling_requests = [s.request for s in sched.sampling]
        sampler_out = self._sample(logits, sampling_requests)
        token_ids = sampler_out.token_ids.tolist()
        token_logprobs = dict(
            zip([r.request_id for r in sampling_requests], _token_logprobs(sampler_out), strict=True)
        )
        failed = [sampling_requests[row] for row in sampler_out.errors]
        for row, message in sampler_out.errors.items():
            self.scheduler.finish(sampling_requests[row], FinishReason.ERROR, error=message)
        advanced = self.scheduler.update(sched, token_ids)
        for request in advanced:
            self._process_token(request, token_logprobs.get(request.request_id))
        touched = {
            self.parent_of[r.request_id]: self.states[self.parent_of[r.request_id]]
            for r in [*failed, *advanced]
        }
        for state in touched.values():
            self._fork_samples(state)
        return self._emit(list(touched.values()))

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        tokenizer_vocab = self.tokenizer.vocab_size
        if tokenizer_vocab < logits.shape[-1]:
            logits[:, tokenizer_vocab:] = float("-inf")  # padding rows of the embedding, no token
        batch = SamplingBatch.build(requests, logits.shape[-1], logits.device)
        return self.sampler(logits, batch)

    def _process_token(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        seq = self.sequences[request.request_id]
        stop = check_stop(request, self.config.scheduler.max_model_len)
        if stop is not None:
            self.scheduler.finish(request, stop[0], stop_reason=stop[1])
        match = seq.append([request.token_ids[-1]], [logprobs] if logprobs else [], self.tokenizer)
        if match is not None:
            self.scheduler.finish(request, FinishReason.STOP, stop_reason=match.stop)
        elif request.is_finished:
            seq.flush()

    def _fork_samples(self, state: RequestState) -> None:
        """Once the first sample has computed the prompt, the other n - 1 share its blocks."""
        if len(state.sequences) == state.num_samples:
            return
        first = state.sequences[0].request
        if first.num_computed_tokens < first.num_prompt_tokens:
            return
        params = first.params
        for index in range(len(state.sequences), state.num_samples):
            child = self._new_sequence(state, index, params)
            if first.is_finished:
                self.scheduler.add_request(child)  # its blocks are gone: prefix caching takes over
            else:
                self.scheduler.add_forked(first, child)

    def _emit(self, states: Sequence[RequestState]) -> list[RequestOutput]:
        outputs = []
        for state in states:
            output = state.make_output()
            if output is not None:
                outputs.append(output)
            if state.finished:
                self.states.pop(state.request_id, None)
                for seq in state.sequences:
                    self._forget(seq.request.request_id)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            prefix_cache_hit_tokens=self.kv.num_hit_tokens,
            prefix_cache_queried_tokens=self.kv.num_queried_tokens,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_preemptions=self.scheduler.num_preemptions,
        )


def _token_logprobs(out: SamplerOutput) -> list[TokenLogprobs | None]:
    if out.top_logprobs is None:
        return [None] * out.token_ids.shape[0]
    ids = out.top_logprobs.token_ids.tolist()
    values = out.top_logprobs.logprobs.tolist()
    ranks = out.top_logprobs.ranks.tolist()
    return [TokenLogprobs(i, v, r) for i, v, r in zip(ids, values, ranks, strict=True)]
