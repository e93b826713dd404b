"""The engine: add requests, abort them, and step.

One `step()`:
  1. admit: requests whose grammar finished compiling join the scheduler (failed ones end here);
  2. schedule: pick this step's tokens (`Scheduler.schedule`);
  3. mask, started: fill the grammar bitmask of the constrained sampling rows on a worker thread;
  4. run: the forward pass (`ModelRunner.execute`), logits for the sampling rows;
  5. mask, applied: join the fill and mask those rows in place;
  6. sample: one vectorized pass over the rows (`Sampler`), one host sync;
  7. update: advance counters, append tokens (`Scheduler.update`);
  8. finish: advance grammars and append forced tokens (fast-forward), token stop rules,
     detokenize, stop strings; finished requests free their blocks;
  9. fork: a request with n > 1 forks its other samples once its prompt is computed;
 10. emit a `RequestOutput` per request that progressed.
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
from weft.structured.llguidance_backend import LLGuidanceBackend
from weft.structured.manager import Accept, GrammarManager, PendingFill
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
        self.awaiting_grammar: dict[str, Request] = {}  # sequence request id -> request
        self._grammars: GrammarManager | None = None
        self._seeds = random.Random(config.seed)
        self.num_sampled_tokens = 0
        self.num_forced_tokens = 0

    @property
    def grammars(self) -> GrammarManager:
        """The grammar manager, built on first use (wrapping the tokenizer for llguidance takes a
        moment for large vocabularies)."""
        if self._grammars is None:
            backend = LLGuidanceBackend(
                self.tokenizer.tokenizer.to_str(), self.vocab_size, sorted(self.eos_token_ids)
            )
            self._grammars = GrammarManager(backend, self.config.scheduler.max_num_seqs)
        return self._grammars

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> None:
        """Queue a request. Raises ValueError (and queues nothing) for a bad prompt. A structured
        request waits for its grammar to compile off the loop; an invalid grammar finishes it with
        `finish_reason="error"` and the backend's message."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text = prompt if isinstance(prompt, str) else None
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._validate_prompt(prompt_ids)
        state = RequestState(request_id, prompt_text, prompt_ids, params.output_kind, params.n)
        self.states[request_id] = state
        first = self._new_sequence(state, 0, params)
        if params.structured is None:
            self.scheduler.add_request(first)
        else:
            self.grammars.submit(first.request_id, params.structured)
            self.awaiting_grammar[first.request_id] = first

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
            seq.request.finish(FinishReason.ABORT)
            self._forget(seq.request.request_id)

    def _forget(self, seq_id: str) -> None:
        self.sequences.pop(seq_id, None)
        self.parent_of.pop(seq_id, None)
        self.awaiting_grammar.pop(seq_id, None)
        if self._grammars is not None:
            self._grammars.remove(seq_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        touched = self._admit_compiled_grammars()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return self._emit(touched)
        sampling_requests = [s.request for s in sched.sampling]
        fill = self._start_mask(sampling_requests)
        logits = self.runner.execute(sched)  # [S, V]
        sampler_out = self._sample(logits, sampling_requests, fill)
        token_ids = sampler_out.token_ids.tolist()
        token_logprobs = dict(
            zip([r.request_id for r in sampling_requests], _token_logprobs(sampler_out), strict=True)
        )
        failed = [sampling_requests[row] for row in sampler_out.errors]
        for row, message in sampler_out.errors.items():
            self.scheduler.finish(sampling_requests[row], FinishReason.ERROR, error=message)
        advanced = self.scheduler.update(sched, token_ids)
        self.num_sampled_tokens += len(advanced)
        for request in advanced:
            self._process_sampled(request, token_logprobs.get(request.request_id))
        for request in [*failed, *advanced]:
            touched.append(self.states[self.parent_of[request.request_id]])
        states = list({id(s): s for s in touched}.values())
        for state in states:
            self._fork_samples(state)
        return self._emit(states)

    def _admit_compiled_grammars(self) -> list[RequestState]:
        """Move requests whose grammar compiled into the scheduler; finish those whose failed."""
        if not self.awaiting_grammar:
            return []
        idle = self.scheduler.num_unfinished == 0
        ready, failed = self.grammars.poll(wait_s=0.01 if idle else 0.0)
        for request_id in ready:
            self.scheduler.add_request(self.awaiting_grammar.pop(request_id))
        touched = []
        for request_id, message in failed.items():
            request = self.awaiting_grammar.pop(request_id)
            request.finish(FinishReason.ERROR, error=message)
            touched.append(self.states[self.parent_of[request_id]])
        return touched

    def _start_mask(self, requests: list[Request]) -> PendingFill | None:
        if self._grammars is None:
            return None
        return self._grammars.start_fill([r.request_id for r in requests])

    def _sample(
        self, logits: torch.Tensor, requests: list[Request], fill: PendingFill | None
    ) -> SamplerOutput:
        tokenizer_vocab = self.tokenizer.vocab_size
        if tokenizer_vocab < logits.shape[-1]:
            logits[:, tokenizer_vocab:] = float("-inf")  # padding rows of the embedding, no token
        batch = SamplingBatch.build(requests, logits.shape[-1], logits.device)
        raw_logprobs = None
        if fill is not None:
            if batch.num_top_logprobs is not None:
                raw_logprobs = torch.log_softmax(logits, dim=-1)  # the model's distribution, before the mask
            self.grammars.apply(logits, fill)
        return self.sampler(logits, batch, raw_logprobs)

    def _process_sampled(self, request: Request, logprobs: TokenLogprobs | None) -> None:
        """Grammar, forced tokens, stop rules and text for a request that just sampled a token."""
        new_tokens, grammar_done = [request.token_ids[-1]], False
        if self._grammars is not None and self._grammars.has_matcher(request.request_id):
            new_tokens, grammar_done = self._advance_grammar(request)
        if not request.is_finished:
            stop = check_stop(request, self.config.scheduler.max_model_len)
            if stop is not None:
                self.scheduler.finish(request, stop[0], stop_reason=stop[1])
            elif grammar_done:
                self.scheduler.finish(request, FinishReason.STOP)
        token_logprobs = [logprobs] if logprobs is not None and new_tokens else []
        match = self.sequences[request.request_id].append(new_tokens, token_logprobs, self.tokenizer)
        if match is None or request.finish_reason == FinishReason.ERROR:
            return
        if request.is_finished:  # e.g. max_tokens on the very token that completed the stop string
            request.finish(FinishReason.STOP, stop_reason=match.stop)
        else:
            self.scheduler.finish(request, FinishReason.STOP, stop_reason=match.stop)

    def _advance_grammar(self, request: Request) -> tuple[list[int], bool]:
        """Feed the sampled token to the request's matcher, then append the tokens the grammar forces
        (fast-forward; not for requests that want logprobs, whose every token must be sampled).
        Returns the new output tokens and whether the grammar is complete."""
        grammars, rid = self.grammars, request.request_id
        result = grammars.accept(rid, request.token_ids[-1:])
        if result == Accept.ERROR:
            request.token_ids.pop()
            self.scheduler.finish(request, FinishReason.ERROR, error=grammars.error(rid))
            return [], False
        new_tokens = request.token_ids[-1:]
        if result == Accept.OK and request.params.fast_forward and request.params.logprobs is None:
            forced = grammars.forced_tokens(rid)[: self._room_left(request)]
            if forced:
                result = grammars.accept(rid, forced)
                request.token_ids.extend(forced)
                new_tokens += forced
                self.num_forced_tokens += len(forced)
        if result == Accept.ERROR:
            self.scheduler.finish(request, FinishReason.ERROR, error=grammars.error(rid))
        return new_tokens, result == Accept.FINISHED

    def _room_left(self, request: Request) -> int:
        room = self.config.scheduler.max_model_len - request.num_tokens
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - request.num_output_tokens)
        return max(room, 0)

    def _fork_samples(self, state: RequestState) -> None:
        """Once the first sample has computed the prompt, the other n - 1 share its blocks."""
        if len(state.sequences) == state.num_samples:
            return
        first = state.sequences[0].request
        if first.num_computed_tokens < first.num_prompt_tokens and not first.is_finished:
            return
        params = first.params
        for index in range(len(state.sequences), state.num_samples):
            child = self._new_sequence(state, index, params)
            if first.finish_reason == FinishReason.ERROR and first.num_output_tokens == 0:
                child.finish(FinishReason.ERROR, error=first.error)  # e.g. its grammar is invalid
                continue
            if params.structured is not None:
                self.grammars.fork(first.request_id, child.request_id)
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
            num_waiting=len(self.scheduler.waiting) + len(self.awaiting_grammar),
            num_preemptions=self.scheduler.num_preemptions,
            extra={
                "num_sampled_tokens": self.num_sampled_tokens,
                "num_forced_tokens": self.num_forced_tokens,
            },
        )


def _token_logprobs(out: SamplerOutput) -> list[TokenLogprobs | None]:
    if out.top_logprobs is None:
        return [None] * out.token_ids.shape[0]
    ids = out.top_logprobs.token_ids.tolist()
    values = out.top_logprobs.logprobs.tolist()
    ranks = out.top_logprobs.ranks.tolist()
    return [TokenLogprobs(i, v, r) for i, v, r in zip(ids, values, ranks, strict=True)]
