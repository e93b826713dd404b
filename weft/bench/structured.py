"""Cost of structured generation in weft, and weft against transformers + a grammar processor.

Steps, in order:
  1. build the same random-weight, real-shape model as `weft bench throughput` (default:
     SmolLM2-135M's config; or `--model`, e.g. `default` for the trained default model) and pick
     real JSON schemas that compile (JSONSchemaBench, Glaive);
  2. for each batch size, after an untimed warm-up, time in weft: unconstrained decoding, decoding
     under an armed tool-call grammar that is never triggered (tool_choice="auto": free text until
     the model writes the opener), constrained decoding without fast-forward (the pure mask cost
     per token), and constrained decoding with fast-forward (forced tokens appended without
     sampling);
  3. time the same constrained workload through transformers generate() with a logits processor
     built on the same grammar library (llguidance: one matcher per row, batch bitmask fill);
  4. repeat steps 2-3 `--repeats` times, alternating, and keep each mode's best run (the machine's
     load from other tenants then hits all modes alike);
  5. print per-token time and overhead, the fast-forward share of tokens, and tokens/s ratios.

Per-token time in weft is the wall time of the decode steps in which every row of the batch is still
running, divided by the tokens those steps computed (sampled plus forced): it includes everything
(forward pass, mask, sampling, bookkeeping) but not the smaller batches left when some rows finish
early. transformers keeps every row in its batch to the end; its tokens count up to each row's EOS.
"ff vs no ff, whole run" compares the two constrained modes over every decode step instead: the
same rows, finishing at the same points, all tokens over all the time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from weft.bench.throughput import SHARED, add_repeats_argument, add_shape_arguments, build_checkpoint

SCHEMAS = SHARED / "jsonschema" / "jsonschemabench" / "Glaiveai2K.jsonl.gz"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_shape_arguments(p, "1,8,32")
    p.add_argument("--output-len", type=int, default=64, help="most new tokens per sequence (default: 64)")
    p.add_argument("--schemas", type=Path, default=SCHEMAS, help="a JSONSchemaBench .jsonl.gz file")
    add_repeats_argument(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda: where both engines run (default: cpu)")
    p.add_argument("--no-transformers", action="store_true", help="measure weft alone")
    p.add_argument(
        "--model",
        default=None,
        help="measure this checkpoint or GGUF file (trained weights: 'default', the default model) "
        "instead of a random one built from --config",
    )


@dataclass(slots=True)
class Run:
    seconds: float
    num_tokens: int
    num_forced: int = 0
    num_total: int = 0  # all tokens produced, for the fast-forward share
    all_seconds: float = 0.0  # every decode step, rows finishing early included

    @property
    def whole_run_tokens_per_s(self) -> float:
        return self.num_total / max(self.all_seconds, 1e-9)

    @property
    def ms_per_token(self) -> float:
        return 1000 * self.seconds / max(self.num_tokens, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds


def load_schemas(path: Path, count: int) -> list[dict[str, Any]]:
    """The first `count` schemas of the file that llguidance compiles."""
    import llguidance

    schemas = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            schema = json.loads(line)["schema"]
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
            if not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]:
                schemas.append(schema)
            if len(schemas) == count:
                break
    return schemas


def time_weft(
    llm,
    prompts: list[list[int]],
    schemas: list[dict[str, Any]] | None,
    output_len: int,
    fast_forward: bool = True,
    grammar: str | None = None,
) -> Run:
    """Run the batch step by step. `seconds`/`num_tokens` count only the steps in which every row
    was still running, so that rows finishing early (a completed grammar) do not make the smaller
    remaining batch look like mask overhead; `num_forced` counts over the whole run.

    A step's tokens are the ones it computes: each row's last sampled token plus the tokens the
    grammar forced after it, which the step after their sampling computes. (Counting them in the
    step that appended them instead misattributes whole bursts of forced tokens across the start
    and end of the timed steps, which are few when grammars complete early.)"""
    from weft import SamplingParams

    engine = llm.engine
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=output_len,
            ignore_eos=schemas is None,
            json_schema=s,
            grammar=grammar,
            grammar_syntax="lark" if grammar else "auto",
            fast_forward=fast_forward,
        )
        for s in _schema_per_prompt(schemas, len(prompts))
    ]
    for p in params:  # compile outside the timing: compilation is cached per schema
        if p.structured is not None:
            engine.grammars.validate(p.structured)
    before = engine.stats().extra
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"bench-{i}", prompt, p)
    while engine.has_unfinished_requests() and _admitting(engine):  # grammars, admission, prefill
        engine.step()
    seconds, full_tokens, all_seconds = 0.0, 0, 0.0
    while engine.has_unfinished_requests():
        stats = engine.stats()
        full = stats.num_running == len(prompts)
        computing = int(stats.extra["num_uncomputed_tokens"])
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        all_seconds += elapsed
        if full:
            seconds += elapsed
            full_tokens += computing
    after = engine.stats().extra
    num_forced = int(after["num_forced_tokens"] - before["num_forced_tokens"])
    produced = num_forced + int(after["num_sampled_tokens"] - before["num_sampled_tokens"])
    return Run(seconds, full_tokens, num_forced, produced, all_seconds)


def _admitting(engine) -> bool:
    """Whether some request still waits for its grammar, for admission or for its prompt."""
    stats = engine.stats()
    return stats.num_waiting > 0 or stats.extra["num_computing_prompts"] > 0


def _schema_per_prompt(schemas: list[dict[str, Any]] | None, count: int) -> list[dict[str, Any] | None]:
    return list(schemas) if schemas is not None else [None] * count


class LLGuidanceProcessor:
    """A transformers logits processor on llguidance: one matcher per row, the batch's bitmask
    filled in one call, the mask applied in place (how such processors are usually built)."""

    def __init__(
        self, tokenizer_json: str, vocab_size: int, eos_id: int, schemas: list[dict[str, Any]]
    ) -> None:
        import llguidance
        import llguidance.torch

        self.lt = llguidance.torch
        tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)
        self.executor = llguidance.LLExecutor()
        self.matchers = [
            llguidance.LLMatcher(
                tokenizer,
                llguidance.LLMatcher.grammar_from_json_schema(
                    json.dumps(s),
                    defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
                ),
            )
            for s in schemas
        ]
        self.bitmask = self.lt.allocate_token_bitmask(len(schemas), vocab_size)
        self.prompt_len: int | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prompt_len is None:
            self.prompt_len = input_ids.shape[1]
        elif input_ids.shape[1] > self.prompt_len:
            for matcher, token in zip(self.matchers, input_ids[:, -1].tolist(), strict=True):
                if not matcher.is_stopped():
                    matcher.consume_token(token)
        self.lt.fill_next_token_bitmask_par(
            self.executor, [(m, i) for i, m in enumerate(self.matchers)], self.bitmask
        )
        self.lt.apply_token_bitmask_inplace(scores, self.bitmask)
        return scores


def time_transformers(
    hf,
    tokenizer_json: str,
    prompts: list[list[int]],
    schemas: list[dict[str, Any]],
    output_len: int,
    eos_id: int,
) -> Run:
    from transformers import LogitsProcessorList

    processor = LLGuidanceProcessor(tokenizer_json, hf.config.vocab_size, eos_id, schemas)
    input_ids = torch.tensor(prompts, device=hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=output_len,
            eos_token_id=eos_id,
            pad_token_id=eos_id,
            logits_processor=LogitsProcessorList([processor]),
        )
    seconds = time.perf_counter() - start
    new = out[:, input_ids.shape[1] :].tolist()
    num_tokens = sum(row.index(eos_id) + 1 if eos_id in row else len(row) for row in new)
    return Run(seconds, num_tokens)


def run(args: argparse.Namespace) -> int:
    from weft import LLM

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    schemas = load_schemas(args.schemas, max(batch_sizes))
    print(
        f"weft bench structured: {args.model or args.config}, {len(schemas)} schemas from "
        f"{args.schemas.name}, output<={args.output_len}, threads={torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_path(args, Path(tmp))
        llm = LLM(
            str(path),
            device=args.device,
            max_model_len=256,
            max_num_seqs=max(batch_sizes),
            enable_prefix_caching=False,
            show_progress=False,
        )
        hf = None
        if not args.no_transformers:
            import transformers

            gguf = {"gguf_file": path.name} if path.is_file() else {}  # dequantized to float32
            model = transformers.AutoModelForCausalLM.from_pretrained(path.parent if gguf else path, **gguf)
            hf = torch.nn.Module.to(model, args.device).eval()
        rows = _measure(llm, hf, schemas, batch_sizes, args)
    _print(rows)
    return 0


def _model_path(args: argparse.Namespace, tmp: Path) -> Path:
    """The model measured: --model ('default': the default model), else a random-weight one."""
    if args.model is None:
        return build_checkpoint(args.config, torch.float32, tmp)
    from weft.engine.default_model import named_model

    return named_model(args.model)


def _measure(llm, hf, schemas, batch_sizes: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    tokenizer_json = llm.tokenizer.tokenizer.to_str()
    eos_id = sorted(llm.engine.eos_token_ids)[0]
    prompt = llm.tokenizer.encode("Return the JSON object:")
    time_weft(llm, [prompt], schemas[:1], 8)  # warm-ups (the transformers one compiles the mask kernel)
    if hf is not None:
        time_transformers(hf, tokenizer_json, [prompt], schemas[:1], 4, eos_id)
    armed = armed_tool_grammar(llm, schemas)
    rows = []
    for batch in batch_sizes:
        prompts, batch_schemas = [prompt] * batch, schemas[:batch]
        print(f"  batch {batch}:", end="", flush=True)
        runs: dict[str, list[Run]] = {"free": [], "armed": [], "masked": [], "ff": [], "hf": []}
        for _ in range(args.repeats):
            print(" weft", end="", flush=True)
            runs["free"].append(time_weft(llm, prompts, None, args.output_len))
            runs["armed"].append(time_weft(llm, prompts, None, args.output_len, grammar=armed))
            runs["masked"].append(time_weft(llm, prompts, batch_schemas, args.output_len, fast_forward=False))
            runs["ff"].append(time_weft(llm, prompts, batch_schemas, args.output_len, fast_forward=True))
            if hf is not None:
                print(" transformers", end="", flush=True)
                runs["hf"].append(
                    time_transformers(hf, tokenizer_json, prompts, batch_schemas, args.output_len, eos_id)
                )
        row: dict[str, Any] = {"batch": batch}
        row.update({name: min(r, key=lambda run: run.ms_per_token) for name, r in runs.items() if r})
        print(" done", flush=True)
        rows.append(row)
    return rows


def armed_tool_grammar(llm, schemas: list[dict[str, Any]]) -> str:
    """The grammar of `tool_choice="auto"` in the Hermes format with four of the schemas as tools:
    a random model never writes the trigger, so every token is free text under an armed grammar."""
    from weft.agents.reply import plan_reply
    from weft.agents.tool_formats import FORMATS, ToolSpec

    tools = [ToolSpec(f"tool_{i}", s) for i, s in enumerate(schemas[:4])]
    plan = plan_reply(
        constraint={}, tools=tools, tool_format=FORMATS["hermes"], added_tokens=llm.tokenizer.added_tokens
    )
    return str(plan.constraint["grammar"])


def _print(rows: list[dict[str, Any]]) -> None:
    print("\n| batch | unconstrained ms/tok | armed tool grammar (never triggered) ms/tok | overhead |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        free, armed = r["free"], r["armed"]
        overhead = 100 * (armed.ms_per_token / free.ms_per_token - 1)
        print(f"| {r['batch']} | {free.ms_per_token:.2f} | {armed.ms_per_token:.2f} | {overhead:+.1f}% |")
    _print_constrained(rows)


def _print_constrained(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| batch | unconstrained ms/tok | constrained ms/tok (no ff) | mask overhead | with ff ms/tok "
        "| ff share | ff tok/s vs unconstrained | ff vs no ff, whole run | hf+processor tok/s "
        "| weft ff vs hf |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        free, masked, ff, hf = r["free"], r["masked"], r["ff"], r.get("hf")
        overhead = 100 * (masked.ms_per_token / free.ms_per_token - 1)
        delta = masked.ms_per_token - free.ms_per_token
        share = 100 * ff.num_forced / max(ff.num_total, 1)
        vs_hf = f"{ff.tokens_per_s / hf.tokens_per_s:.2f}x" if hf else "-"
        hf_tps = f"{hf.tokens_per_s:.1f}" if hf else "-"
        print(
            f"| {r['batch']} | {free.ms_per_token:.2f} | {masked.ms_per_token:.2f} | {overhead:+.1f}% "
            f"({delta:+.2f} ms) | {ff.ms_per_token:.2f} | {share:.0f}% "
            f"| {ff.tokens_per_s / free.tokens_per_s:.2f}x "
            f"| {ff.whole_run_tokens_per_s / masked.whole_run_tokens_per_s:.2f}x | {hf_tps} | {vs_hf} |"
        )
