"""The engine: add requests, abort them, and step.

The engine keeps the requests (`SequenceGroup`s, by the user's request id) and the loop; each
sequence owns its own state (`Sequence`), and the scheduler, the KV manager and the grammar manager
know sequences, never requests.

One `step()`:
  1. admit: groups whose grammar finished compiling start (their policy creates their sequences);
  2. schedule: pick this step's tokens (`Scheduler.schedule`);
  3. mask, started: fill the grammar bitmask of the constrained sampling rows on a worker thread;
  4. run: the forward pass (`ModelRunner.execute`), logits for the sampling rows;
  5. sample: one vectorized pass over the rows (`Sampler`: padding, raw logprobs, the grammar mask,
     processors, penalties, filters, sampling, logprobs), then one host transfer of its results
     (`StepTransfer`), held with what was scheduled in a `Launched`;
  6. advance: count the step's tokens as computed, caching the blocks they filled
     (`Scheduler.advance`);
  7. resolve: read the results back (`Launched.results`) and hand each sequence its token, which
     takes the decision to stop; finished sequences free their blocks (`Scheduler.accept`);
  8. policies: each touched group forks and prunes (`GroupPolicy.after_step`);
  9. emit a `RequestOutput` per group that progressed; finished groups are forgotten.
With lookahead (`weft/engine/lookahead.py`) step 7 of a step waits until the next step's 5.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np
import torch

from weft.arrays import column, to_device
from weft.config import EngineConfig
from weft.engine.beam import BeamSearch
from weft.engine.exact_choice import ExactChoice
from weft.engine.group import NO_UPDATE, GroupPolicy, GroupUpdate, ParallelSampling, SequenceGroup, Spawner
from weft.engine.kv_cache import KVCacheManager
from weft.engine.launch import Launched
from weft.engine.layout import SchedulerOutput, StepLayout
from weft.engine.lookahead import can_stay_in_flight, commit
from weft.engine.runner import InFlightTokens, ModelRunner, StepLogits
from weft.engine.scheduler import Scheduler
from weft.engine.scoring import Attributed, ChoiceScorer, attribute
from weft.engine.sequence import FinishReason, Sequence, SequenceLimits, SequenceStatus
from weft.engine.smc import SMC
from weft.engine.speculation import Speculation, SpeculationOff
from weft.model.llama import LlamaForCausalLM
from weft.outputs import ChoiceScore, EngineStats, RequestOutput
from weft.parallel.group import RankFailure, TensorParallel
from weft.parallel.workers import Workers
from weft.params import BeamSearchParams, SamplingParams
from weft.sample.prompt_logprobs import prompt_logprobs
from weft.sample.sampler import Sampler, SamplingBatchBuilder
from weft.sample.transfer import KnownTokenLogprobs, StepTransfer
from weft.structured.grammar import CompiledGrammar
from weft.structured.llguidance_backend import LLGuidanceBackend
from weft.structured.manager import GrammarManager, compile_error
from weft.tokenizer import Tokenizer, check_text


@dataclass(frozen=True, slots=True)
class AwaitingGrammar:
    group: SequenceGroup
    grammar: Future[CompiledGrammar]


class ContextOverflow(ValueError):
    """A request's prompt and `max_tokens` do not fit in the model's context (as vLLM, an error
    rather than a completion cut short without a word)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.prompt_tokens, self.max_tokens, self.max_model_len = prompt_tokens, max_tokens, max_model_len
        super().__init__(self.describe("max_tokens"))

    def describe(self, field: str) -> str:
        """The message, naming the request's own field for max_tokens."""
        total = self.prompt_tokens + self.max_tokens
        room = self.max_model_len - self.prompt_tokens
        return (
            f"the prompt ({self.prompt_tokens} tokens) plus {field} ({self.max_tokens}) is {total} tokens, "
            f"more than the model's context (max_model_len {self.max_model_len}): shorten the prompt, "
            f"set {field} to at most {room}, or leave it unset to generate until the context is full"
        )


@dataclass(eq=False)
class Ranks:
    """A tensor-parallel engine's group (this process is rank 0) and the processes of the others."""

    tp: TensorParallel
    workers: Workers

    def stop(self) -> None:
        self.workers.stop(self.tp)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer, ranks: Ranks | None = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(config.cache)
        self.scheduler = Scheduler(config.scheduler, self.kv)
        # model.config: a tensor-parallel rank's part of the model (its KV heads), else config.model
        self.runner = ModelRunner(model, model.config, config.cache, config.device, config.dtype)
        self.kv_bytes_per_token = self.runner.kv_bytes_per_token  # (this rank's part, in every layer)
        self.ranks = ranks  # tensor parallel: the other ranks follow each step
        self.failure: str | None = None  # why this engine stopped for good (a tensor-parallel rank died)
        if ranks is not None:
            weakref.finalize(self, ranks.stop)
        num_real_tokens = min(tokenizer.vocab_size, config.model.vocab_size)
        self.sampler = Sampler(num_real_tokens, model.kernels)
        self.sampling_batches = SamplingBatchBuilder()
        self.vocab_size = config.model.vocab_size
        self.eos_token_ids = frozenset(config.model.eos_token_ids) | (
            {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        )
        self.limits = SequenceLimits(config.scheduler.max_model_len, self.eos_token_ids)
        self.spawner = Spawner(config.seed)
        self.groups: dict[str, SequenceGroup] = {}  # user request id -> its group
        self.awaiting: list[AwaitingGrammar] = []
        self.scorer = ChoiceScorer(self.runner, self.kv)
        self.started: list[SequenceGroup] = []  # groups finished as their policy started them
        self._grammars: GrammarManager | None = None
        speculative = config.speculative
        self.speculation = SpeculationOff() if speculative is None else Speculation(speculative, tokenizer)
        self.num_sampled_tokens = 0
        self.num_forced_tokens = 0
        self.in_flight: Launched | None = None  # a step left running by lookahead (`step`)

    @property
    def model(self) -> LlamaForCausalLM:
        return self.runner.model

    @property
    def grammars(self) -> GrammarManager:
        """The grammar manager, built on first use (wrapping the tokenizer for llguidance takes a
        moment for large vocabularies)."""
        if self._grammars is None:
            backend = LLGuidanceBackend(
                self.tokenizer.tokenizer.to_str(), self.vocab_size, sorted(self.eos_token_ids)
            )
            max_rows = self.config.scheduler.max_num_seqs
            pinned = self.config.device.type == "cuda"
            self._grammars = GrammarManager(backend, max_rows, self.model.kernels, pin_memory=pinned)
        return self._grammars

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request_id: str, prompt: str | Iterable[int], params: SamplingParams | BeamSearchParams
    ) -> None:
        """Queue a request (sampling, or beam search). Raises ValueError (and queues nothing) for a
        bad prompt or parameters this engine cannot serve. A structured request waits for its
        grammar to compile off the loop; an invalid grammar finishes it with
        `finish_reason="error"` and the backend's message."""
        if self.failure is not None:
            raise RuntimeError(f"this engine has stopped: {self.failure}; build a new one")
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_text, prompt_ids = self._encode_prompt(prompt)
        policy, params, seq_params = self._policy(params)
        self._validate(prompt_ids, params)
        policy.validate(params, self.vocab_size, min(self.config.max_logprobs, self.vocab_size))
        group = SequenceGroup(request_id, prompt_text, prompt_ids, params, policy)
        seed = self.spawner.seed_for(params, 0)
        first = Sequence.create(
            self.spawner.next_id(), seq_params, prompt_ids, self.limits, seed, self.tokenizer
        )
        group.add([first])
        self.groups[request_id] = group
        if params.structured is None or params.exact_choice:
            self._start(group, first)
        else:
            self.awaiting.append(AwaitingGrammar(group, self.grammars.submit(params.structured)))

    def _policy(
        self, params: SamplingParams | BeamSearchParams
    ) -> tuple[GroupPolicy, SamplingParams, SamplingParams]:
        """The request's policy, its parameters and those of its sequences: best_of tracks each
        sample's logprob (for the ranking) even when the user asked for none."""
        if isinstance(params, BeamSearchParams):
            beams = BeamSearch(params, self.eos_token_ids, self.config.scheduler.max_model_len)
            beam_params = params.sampling_params(beams.num_candidates)
            return beams, beam_params, beam_params
        if params.exact_choice:
            return ExactChoice(params.n, self._score_options), params, params
        if params.smc is not None:  # particles track their positions: their weights come from them
            smc = SMC(params.smc, params.n, self.spawner.rng_for(params))
            return smc, params, params.replace(logprobs=0) if params.logprobs is None else params
        policy = ParallelSampling(params.num_samples, params.n)
        ranks = params.num_samples > params.n and params.logprobs is None
        return policy, params, params.replace(logprobs=0) if ranks else params

    def score(self, prompt: str | Iterable[int], options: list[str]) -> list[ChoiceScore]:
        """The total logprob of each option's tokens after the prompt, in one pass over the
        options' token trie (see `weft.engine.scoring`). Raises ValueError for bad input."""
        if not isinstance(options, list | tuple) or not options:
            raise ValueError("options must be a non-empty list of strings")
        for option in options:
            if not isinstance(option, str) or not option:
                raise ValueError(f"options must be non-empty strings, got {option!r}")
            check_text(option, "option")
        prompt_text, prompt_ids = self._encode_prompt(prompt)
        self._validate(prompt_ids, SamplingParams(max_tokens=None))
        return self._score_options(prompt_text, prompt_ids, list(options))

    def _score_options(
        self, prompt: str | None, prompt_ids: list[int], options: list[str]
    ) -> list[ChoiceScore]:
        if self.ranks is not None:
            raise ValueError(
                "exact scoring (LLM.score, choice_selection='exact') runs on one rank: "
                "use tensor_parallel_size=1, or choice_selection='greedy'"
            )
        return self.scorer.score(self._attribute(prompt, prompt_ids, options))

    def _attribute(self, prompt: str | None, prompt_ids: list[int], options: list[str]) -> list[Attributed]:
        attributed = [attribute(self.tokenizer, prompt, prompt_ids, option) for option in options]
        max_len = self.config.scheduler.max_model_len
        for item in attributed:
            if len(item.token_ids) > max_len:
                raise ValueError(
                    f"prompt + option {item.text!r} is {len(item.token_ids)} tokens, more than "
                    f"max_model_len ({max_len})"
                )
        return attributed

    def _encode_prompt(self, prompt: str | Iterable[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        ids = list(prompt)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("the prompt must be a string or a list of integer token ids")
        return None, ids

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """What every request must satisfy; its policy checks the rest (`GroupPolicy.validate`)."""
        max_len = self.config.scheduler.max_model_len
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= max_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}; "
                "shorten the prompt or raise max_model_len"
            )
        max_tokens = None if params.exact_choice else params.max_tokens  # exact choice only scores
        if max_tokens is not None and len(prompt_ids) + max_tokens > max_len:
            raise ContextOverflow(len(prompt_ids), max_tokens, max_len)
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"SamplingParams.stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )

    def _start(self, group: SequenceGroup, first: Sequence) -> None:
        """The group's policy starts it; a group finished at once (exact choice) is reported by the
        next step."""
        group.policy.start(group, first, self.spawner)
        if not first.is_finished:
            self.scheduler.add(first)
        elif group.finished:
            self.started.append(group)

    def abort_request(self, request_id: str) -> None:
        """Abort a request (all of its sequences) and free its KV blocks at once."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        self.awaiting = [a for a in self.awaiting if a.group is not group]
        self.started = [g for g in self.started if g is not group]
        for seq in group.sequences:
            self.scheduler.finish(seq, FinishReason.ABORT)
        self.speculation.forget(group.sequences)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step (`_step`). When a tensor-parallel rank dies, every request fails with why, the
        other ranks are stopped, and the engine refuses new requests."""
        try:
            return self._step()
        except RankFailure as exc:
            return self._fail_everything(exc)

    def _fail_everything(self, exc: RankFailure) -> list[RequestOutput]:
        assert self.ranks is not None
        dead = self.ranks.workers.failure(wait_s=2.0)
        self.failure = f"tensor-parallel {dead or 'communication failed'}: {exc}"
        self.ranks.stop()
        self.in_flight = None
        self.awaiting, self.started = [], []
        groups = list(self.groups.values())
        for group in groups:
            for seq in group.sequences:
                if not seq.is_finished:
                    self.scheduler.finish(seq, FinishReason.ERROR, error=self.failure)
        return self._emit(groups)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one rank). Also done when the
        engine is collected or the process exits."""
        if self.ranks is not None:
            self.ranks.stop()

    def _step(self) -> list[RequestOutput]:
        """One step: schedule, launch, then read back and apply what came back. With lookahead
        (`weft/engine/lookahead.py`) the step launched here may stay in flight until the next call,
        which then reads it back after launching its own."""
        touched = self._admit_compiled_grammars() + self.started
        self.started = []
        previous, self.in_flight = self.in_flight, None
        started = time.perf_counter()
        drafts = self.speculation.propose(self.scheduler.running)
        sched = self.scheduler.schedule(drafts)
        launched = None
        if not sched.is_empty:
            launched = self._launch(sched, None if previous is None else previous.in_flight)
        elif previous is None and self.scheduler.waiting and not self.scheduler.running:
            touched += self._fail_unschedulable()
        if previous is not None:  # its tokens were counted as computed when it was launched
            touched += self._resolve(previous)
        stays = False
        if launched is not None:
            self.scheduler.advance(launched.sched)  # after `previous`: its tokens are on the host
            stays = (  # with speculation, only while the gate keeps drafting off: drafts need the tokens
                self.config.async_scheduling
                and can_stay_in_flight(launched, self.groups)
                and self.speculation.lets_stay_in_flight(bool(drafts), self.scheduler.running)
            )
            if not stays:
                touched += self._resolve(launched)
            self.speculation.observe(launched.sched, time.perf_counter() - started)
        groups = list(dict.fromkeys(touched))  # in order, once each (groups hash by identity)
        for group in groups:
            update = group.policy.after_step(group)
            if update is not NO_UPDATE:
                self._apply(update)
        outputs = self._emit(groups)
        if stays and launched is not None:  # after the outputs, which so never show a pending token
            commit(launched)
            self.in_flight = launched
        return outputs

    def _group_of(self, seq: Sequence) -> SequenceGroup | None:
        """The group of a request's sequence (None: not a request's, or its request is gone)."""
        return None if seq.request_id is None else self.groups.get(seq.request_id)

    def _fail_unschedulable(self) -> list[SequenceGroup]:
        """Nothing runs and the next waiting sequence still gets no blocks: the rest of the cache
        is held by sequences that wait themselves (beams parked for their siblings, forks), so no
        step will ever free any. The request holding the most parked beams (else the one at the
        head of the queue) fails, alone, and gives its blocks back."""
        parked = [
            (sum(s.status == SequenceStatus.PARKED for s in g.sequences), i, g)
            for i, g in enumerate(self.groups.values())
        ]
        most = max(parked, default=(0, 0, None), key=lambda item: item[:2])
        group = most[2] if most[0] > 0 else self._group_of(self.scheduler.waiting[0])
        if group is None:  # not a request's sequence: nothing to fail it with
            return []
        message = (
            f"the KV cache ({self.kv.num_blocks} blocks of {self.kv.block_size} tokens) cannot hold "
            "this request's sequences at once; lower beam_width, n, best_of or max_tokens, or give "
            "the engine more KV memory (num_kv_blocks, kv_cache_memory_gb)"
        )
        for seq in list(group.sequences):
            self.scheduler.finish(seq, FinishReason.ERROR, error=message)
        return [group]

    def _admit_compiled_grammars(self) -> list[SequenceGroup]:
        """Start the groups whose grammar compiled; those whose grammar failed fail at once."""
        if not self.awaiting:
            return []
        if self.scheduler.num_unfinished == 0:  # nothing else to do: wait a little for one
            wait([a.grammar for a in self.awaiting], timeout=0.01, return_when=FIRST_COMPLETED)
        done: list[AwaitingGrammar] = []  # one done() per future: one completing now lands in one list
        pending: list[AwaitingGrammar] = []
        for item in self.awaiting:
            (done if item.grammar.done() else pending).append(item)
        self.awaiting = pending
        for item in done:
            first = item.group.sequences[0]
            error = compile_error(item.grammar)
            if error is None:
                first.matcher = self.grammars.new_matcher(item.grammar.result())
            else:
                first.finish(FinishReason.ERROR, error=error)
            self._start(item.group, first)
        return [item.group for item in done]

    def _launch(self, sched: SchedulerOutput, in_flight: InFlightTokens | None) -> Launched:
        """Forward and sample one scheduled step, and start reading its results back."""
        room = self.config.scheduler.max_num_seqs - len(self.scheduler.running)
        layout = StepLayout.of(sched, self._take_fanout, room)
        fill = None
        if self._grammars is not None:
            fill = self._grammars.start_fill(layout.grammar_rows, layout.num_rows)
        step = self.runner.execute(sched, in_flight)
        logits = step.logits  # [S, V]
        fanout_rows = layout.fanout_rows()
        if fanout_rows is not None:  # [S + F, V]: each fanout child samples from its parent's row
            logits = logits.index_select(0, column(fanout_rows, np.int64, logits.device))
        rows = self.speculation.sampling_rows(layout)
        batch = self.sampling_batches.build(rows, logits.shape[-1], logits.device)
        out = self.sampler(logits, batch, fill)
        transfer = StepTransfer.start(out.token_ids, out.top_logprobs, self._known_logprobs(step))
        return Launched(layout, out.token_ids, transfer, out.errors, step.known_spans)

    def _resolve(self, launched: Launched) -> list[SequenceGroup]:
        """Read a launched step back (its tokens already counted as computed, `Scheduler.advance`)
        and hand each sequence its token and logprobs: the one way a step's results reach the
        sequences. Returns the groups it touched."""
        rows, prompt_items = launched.results()
        offset = 0
        for span in launched.spans:
            items = prompt_items[offset : offset + span.count]
            if span.forced:
                span.seq.add_forced_logprobs(span.first_token, items)
            else:
                span.seq.add_prompt_logprobs(span.first_token, items)
            offset += span.count
        layout, speculation = launched.layout, self.speculation
        accepted = speculation.tally.num_accepted_tokens  # every accepted draft is a sampled token too
        self.num_forced_tokens += self.scheduler.accept(layout, rows, speculation.verify)
        accepted = speculation.tally.num_accepted_tokens - accepted
        scheduled = layout.sched.scheduled
        speculation.retire(item.seq for item in scheduled)
        self.num_sampled_tokens += len(layout.sequences) - layout.num_failed(rows.errors) + accepted
        groups = (self._group_of(item.seq) for item in scheduled)
        return [g for g in groups if g is not None]

    def _take_fanout(self, seq: Sequence, room: int) -> list[Sequence]:
        """The fanout children of `seq`, whose prompt ends this step (see `Fanout`): its group's."""
        group = self._group_of(seq)
        return [] if group is None else group.policy.take_fanout(seq, room)

    def _known_logprobs(self, step: StepLogits) -> KnownTokenLogprobs | None:
        """The logprobs of this step's known tokens whose logprobs were asked for (prompt tokens,
        forced tokens), or None."""
        if step.known_hidden is None or step.known_targets is None:
            return None
        spans = step.known_spans
        num_top = max(span.num_top for span in spans)
        temperatures = [span.temperature for span in spans]
        scale = None  # [N] float32: SMC particles' forced tokens are weighed at their temperature
        if any(t != 1.0 for t in temperatures):
            per_row = np.repeat(np.array(temperatures, np.float32), [span.count for span in spans])
            scale = to_device(per_row, step.known_hidden.device)
        return prompt_logprobs(
            step.known_hidden,
            step.known_targets,
            num_top,
            self.model.compute_logits,
            kernels=self.model.kernels,
            temperature=scale,
        )

    def _apply(self, update: GroupUpdate) -> None:
        """Forks first (they take their share of their parents' blocks), then the parked sequences
        given a token, then the prunes (whose blocks the forks may still share)."""
        if update.forks:
            self.scheduler.add_forked(update.forks)
        if update.resumes:
            self.scheduler.resume(update.resumes)
        for seq in update.prunes:
            self.scheduler.finish(seq, FinishReason.PRUNED)
        self.speculation.forget(update.prunes)

    def _emit(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        outputs = []
        for group in groups:
            if self.groups.get(group.request_id) is not group:
                continue  # aborted
            finished = group.finished
            output = group.make_output(finished, self.speculation.counts(group.sequences))
            if output is not None:
                outputs.append(output)
            if finished:
                del self.groups[group.request_id]
                self.speculation.forget(group.sequences)
        return outputs

    @property
    def kv_bytes_held(self) -> int:
        """The KV memory of the blocks sequences hold now, in both pools (this rank's part)."""
        main, window = self.kv.used_blocks_per_pool
        main_bytes, window_bytes = self.runner.kv_block_bytes
        return main * main_bytes + window * window_bytes

    def stats(self) -> EngineStats:
        running = self.scheduler.running
        running_requests = len({s.request_id for s in running if s.request_id is not None})
        return EngineStats(
            kv_blocks_total=self.kv.num_blocks,
            kv_blocks_used=self.kv.num_used_blocks,
            prefix_cache_hit_tokens=self.kv.num_hit_tokens,
            prefix_cache_queried_tokens=self.kv.num_queried_tokens,
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting) + len(self.awaiting),
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_running=running_requests,
            num_requests_waiting=len(self.groups) - running_requests,
            extra={
                "num_sampled_tokens": self.num_sampled_tokens,
                "num_forced_tokens": self.num_forced_tokens,
                "num_scored_tokens": self.scorer.num_computed_tokens,
                "num_parked": sum(
                    s.status == SequenceStatus.PARKED for g in self.groups.values() for s in g.sequences
                ),
                "num_uncomputed_tokens": sum(s.num_tokens - s.num_computed_tokens for s in running),
                "num_computing_prompts": sum(s.num_computed_tokens < s.num_prompt_tokens for s in running),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                **self.speculation.stats(),
            },
        )
