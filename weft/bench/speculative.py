"""Speculative decoding: tokens/s with and without it, in one run, on the same requests.

Workloads (the default model unless --model; prompts from the held-out tenth of Tiny Shakespeare):
  copy    a passage, a blank line and its first lines again (up to the last line end in its first
          80 characters, so that the copy starts where the first showing has a token boundary):
          the output repeats the rest
          (greedy; what prompt lookup is for: edits, quotes, extractions);
  json    a record (`name`, `age`, `home`) then its facts as JSON under a JSON Schema (greedy): the
          values are copied from the prompt, the keys and punctuation forced by the grammar (a
          model with a chat template is asked in a user turn to extract them);
  open    open-ended text (temperature 0.8, seeded): little to copy, where drafting must not cost;
  oracle  drafts that are the model's own greedy continuation, always as many as asked (the
          ceiling of verification, per k), also on random-weight models of real shapes
          (`--oracle-configs`);
  json-oracle  the ceiling of JSON extraction: the model's own greedy JSON as drafts, value by
          value (weft/bench/json_oracle.py), each value alone (`json-oracle`) and chained past the
          tokens the grammar forces (`json-chained`), also on `--oracle-configs`.
Each at every batch size over the same 8 requests (more where the batch is larger), `batch` at a
time, so that batch 1 is not one passage's luck; weft without and with `speculative_config`
alternating `--repeats` times (best time kept): generated tokens/s, their ratio, the acceptance
rate, the mean accepted length (tokens per verifying step), and whether the tokens were identical
(they must be).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from weft.bench.throughput import SHARED, add_repeats_argument, build_checkpoint

CORPUS = SHARED / "corpora" / "tinyshakespeare.txt"
CONFIGS = SHARED / "configs"
NUM_REQUESTS = 8  # per workload and batch size (more at a larger batch), `batch` at a time
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "home": {"type": "string"}},
    "required": ["name", "age", "home"],
}
NAMES = ["Romeo", "Juliet", "Menenius", "Volumnia", "Gloucester", "Hermione", "Petruchio", "Escalus"]
HOMES = ["verona", "mantua", "padua", "rome", "london", "sicilia", "vienna", "athens"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workloads", default="copy,json,open,oracle,json-oracle", help="comma-separated (default: all)"
    )
    p.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default: 1,8,32)")
    p.add_argument(
        "--model", default=None, help="a checkpoint or GGUF file, or 'bundled' (default: the default model)"
    )
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    p.add_argument("--oracle-ks", default="2,4,8", help="k values of the oracle workload (default: 2,4,8)")
    p.add_argument(
        "--oracle-configs",
        default="smollm2-135m-instruct",
        help="random-weight shapes for the oracle too, names under configs/ (comma-separated; '' none)",
    )
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default: 64)")
    add_repeats_argument(p)
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")


@dataclass(slots=True)
class Result:
    model: str
    workload: str
    batch: int
    k: int
    tps_off: float
    tps_on: float
    acceptance: float
    mean_accepted: float
    identical: bool

    @property
    def ratio(self) -> float:
        return self.tps_on / self.tps_off


class ReferenceDrafter:
    """Drafts a sequence's continuation in a known output (the oracle): the reference whose prompt
    the sequence starts with, found on the first guess."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]) -> None:
        self.references = references  # prompt -> prompt + output
        self.reference: list[int] | None = None

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        if self.reference is None:
            self.reference = next(
                (ref for prompt, ref in self.references.items() if tuple(token_ids[: len(prompt)]) == prompt),
                [],
            )
        n, ref = len(token_ids), self.reference
        return ref[n : n + k] if n <= len(ref) and ref[n - 1] == token_ids[-1] else []


def run(args: argparse.Namespace) -> int:
    from weft import LLM
    from weft.engine.factory import describe_kernels

    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    print(f"weft bench speculative: workloads={','.join(workloads)} batches={args.batch_sizes} k={args.k}")
    results: list[Result] = []
    from weft.engine.default_model import named_model

    model = named_model(args.model)
    label = model.stem if model.is_file() else model.name
    off, on = LLM(str(model), show_progress=False), _speculating(model, args.k)
    print(f"model: {model}\nwhat ran: {describe_kernels(off.kernels)}", flush=True)
    for workload in workloads:
        for batch in batches:
            if workload == "oracle":
                for k in (int(x) for x in args.oracle_ks.split(",")):
                    results.append(_oracle(label, off, _speculating(model, k), batch, k, args))
                continue
            if workload == "json-oracle":
                results += _json_oracle(label, off, _speculating(model, args.k), batch, args)
                continue
            requests = _requests(workload, max(batch, NUM_REQUESTS), args.max_tokens, _chat(off))
            results.append(_compare(label, workload, off, on, requests, batch, args.k, args.repeats))
            _print(results[-1])
    for name in (c for c in args.oracle_configs.split(",") if c.strip()):
        with tempfile.TemporaryDirectory() as tmp:
            print(f"[{name}] building a random-weight checkpoint ...", flush=True)
            path = build_checkpoint(CONFIGS / name / "config.json", _bf16(), Path(tmp))
            model_off = LLM(str(path), show_progress=False)
            for batch in batches:
                if "oracle" in workloads:
                    for k in (int(x) for x in args.oracle_ks.split(",")):
                        results.append(_oracle(name, model_off, _speculating(path, k), batch, k, args))
                if "json-oracle" in workloads:
                    results += _json_oracle(name, model_off, _speculating(path, args.k), batch, args)
    _table(results)
    if args.json:
        args.json.write_text(json.dumps([{**asdict(r), "ratio": r.ratio} for r in results], indent=2))
    return 0


def _bf16() -> Any:
    import torch

    return torch.bfloat16


def _speculating(path: Path, k: int) -> Any:
    from weft import LLM

    config = {"method": "ngram", "num_speculative_tokens": k}
    return LLM(str(path), show_progress=False, speculative_config=config)


def _bundled_ids(text: str) -> list[int]:
    from weft.engine.default_model import bundled_model_path
    from weft.tokenizer import Tokenizer

    return Tokenizer.from_dir(bundled_model_path()).encode(text)


def _chat(llm: Any) -> Callable[[str], str] | None:
    """A user turn in the model's chat template, or None where it has none."""
    if llm.tokenizer.chat_template is None:
        return None
    return lambda text: llm.render_chat_text([{"role": "user", "content": text}])


def _requests(
    workload: str, count: int, max_tokens: int, chat: Callable[[str], str] | None = None
) -> list[tuple[Any, Any]]:
    """The workload's prompts and sampling; `chat`: how an instruction becomes a prompt (an
    instruct model's chat template), where the workload asks for something."""
    from weft import SamplingParams

    text = CORPUS.read_text(encoding="utf-8")
    held = text[int(len(text) * 0.9) :]
    passages = [held[i * 1500 : i * 1500 + 300] for i in range(count)]
    if workload == "copy":
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        return [(p + "\n\n" + p[: _line_start(p, 80)], params) for p in passages]
    if workload == "json":
        params = SamplingParams(temperature=0, max_tokens=max_tokens, json_schema=SCHEMA)
        homes = [HOMES[(3 * i) % 8] for i in range(count)]
        if chat is not None:  # an instruct model writes places capitalized: so do real records
            homes = [home.title() for home in homes]
        records = [f"name: {NAMES[i % 8]}\nage: {17 + 7 * i % 60}\nhome: {homes[i]}\n" for i in range(count)]
        if chat is not None:
            return [(chat(f"Write this record as JSON.\n\n{r}"), params) for r in records]
        return [(r, params) for r in records]
    if workload == "open":
        return [
            (p[:200], SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens))
            for i, p in enumerate(passages)
        ]
    raise SystemExit(f"unknown workload {workload!r}: copy, json, open, oracle or json-oracle")


def _line_start(text: str, most: int) -> int:
    """Where the last line that starts within `text[:most]` starts (`most` when none does): a
    prompt cut in a word would ask for a token the first showing never had."""
    return text.rfind("\n", 0, most) + 1 or most


def _timed(llm: Any, requests: list[tuple[Any, Any]], batch: int) -> tuple[float, list[Any]]:
    """The requests, `batch` at a time: the seconds they took and their outputs, in order."""
    seconds, outputs = 0.0, []
    for first in range(0, len(requests), batch):
        group = requests[first : first + batch]
        started = time.perf_counter()
        outputs += llm.generate([p for p, _ in group], [s for _, s in group])
        seconds += time.perf_counter() - started
    return seconds, outputs


def _compare(
    model: str,
    workload: str,
    off: Any,
    on: Any,
    requests: list[tuple[Any, Any]],
    batch: int,
    k: int,
    repeats: int,
) -> Result:
    """Both engines on the same requests, `batch` at a time, alternating, best time each."""
    best_off = best_on = float("inf")
    for _ in range(repeats):
        seconds, expected = _timed(off, requests, batch)
        best_off = min(best_off, seconds)
        seconds, got = _timed(on, requests, batch)
        best_on = min(best_on, seconds)
    tokens = sum(len(o.outputs[0].token_ids) for o in expected)
    counts = [o.speculation for o in got if o.speculation is not None]
    drafted = sum(c.num_draft_tokens for c in counts)
    accepted = sum(c.num_accepted_tokens for c in counts)
    drafts = sum(c.num_drafts for c in counts)
    identical = [o.outputs[0].token_ids for o in expected] == [o.outputs[0].token_ids for o in got]
    return Result(
        model, workload, batch, k, tokens / best_off, tokens / best_on,
        accepted / drafted if drafted else 0.0, 1 + accepted / drafts if drafts else 1.0, identical,
    )  # fmt: skip


def _oracle(model: str, off: Any, on: Any, batch: int, k: int, args: argparse.Namespace) -> Result:
    """The model's own greedy continuation as drafts, as many as asked every step."""
    from weft import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [p for p, _ in _requests("open", batch, args.max_tokens)]  # as the bundled tokenizer's ids:
    requests = [(_bundled_ids(p)[:96], params) for p in prompts]  # any model's vocabulary holds them
    _, reference = _timed(off, requests, batch)
    refs = {tuple(o.prompt_token_ids): o.prompt_token_ids + o.outputs[0].token_ids for o in reference}
    speculation = on.engine.speculation
    speculation.adaptive = False
    speculation.new_drafter = lambda: ReferenceDrafter(refs)
    result = _compare(model, "oracle", off, on, requests, batch, k, args.repeats)
    _print(result)
    return result


def _json_oracle(model: str, off: Any, on: Any, batch: int, args: argparse.Namespace) -> list[Result]:
    """The model's own greedy JSON under `json_oracle.SCHEMA` as drafts, value by value: each
    value alone, then chained past the tokens the grammar forces (every proposed draft verified,
    as in `_oracle`)."""
    from weft import SamplingParams
    from weft.bench.json_oracle import SCHEMA, ChainedValueDrafter, ValueDrafter, references

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, json_schema=SCHEMA)
    prompts = [p for p, _ in _requests("open", max(batch, NUM_REQUESTS), args.max_tokens)]
    requests = [(_bundled_ids(p)[:96], params) for p in prompts]  # (as in `_oracle`)
    _, outputs = _timed(off, requests, batch)
    refs = references(off.engine, outputs)
    on.engine.speculation.adaptive = False
    results = []
    for workload, drafter in (("json-oracle", ValueDrafter), ("json-chained", ChainedValueDrafter)):
        on.engine.speculation.new_drafter = lambda drafter=drafter: drafter(refs)
        results.append(_compare(model, workload, off, on, requests, batch, args.k, args.repeats))
        _print(results[-1])
    return results


def _print(r: Result) -> None:
    print(
        f"  {r.model} {r.workload} batch {r.batch} k {r.k}: {r.tps_off:.1f} -> {r.tps_on:.1f} tok/s "
        f"({r.ratio:.2f}x), acceptance {r.acceptance:.2f}, {r.mean_accepted:.2f} tokens/step, "
        f"identical {r.identical}",
        flush=True,
    )


def _table(results: list[Result]) -> None:
    print()
    columns = [
        "model",
        "workload",
        "batch",
        "k",
        "tok/s off",
        "tok/s on",
        "ratio",
        "acceptance",
        "tokens/step",
    ]
    print("| " + " | ".join([*columns, "identical"]) + " |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| {r.model} | {r.workload} | {r.batch} | {r.k} | {r.tps_off:.1f} | {r.tps_on:.1f} | "
            f"{r.ratio:.2f} | {r.acceptance:.2f} | {r.mean_accepted:.2f} | {r.identical} |"
        )
