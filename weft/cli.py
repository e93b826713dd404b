"""The `weft` command line: `weft demo`, `weft generate`, `weft score`, `weft bench ...`."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weft.llm import LLM

EPILOG = """examples:
  weft demo                                       chat, extraction, choice, tool call and logprobs
  weft generate "The capital of France is"        complete with the default model
  weft generate --model ./my-checkpoint --temperature 0 --max-tokens 50 "Once upon a time"
  weft generate --stream --seed 1 "Once upon a time"   print tokens as they come
  weft generate --json-schema person.json "A person:"   output that matches a JSON Schema
  weft generate --choice yes --choice no "Is it?"       one of the given strings
  weft generate --beam-width 4 --max-tokens 20 "The three primary colors are"   beam search, best first
  weft score "The capital of France is" --option " Paris" --option " Lyon"   exact option logprobs
  weft serve --port 8000                          OpenAI-compatible server (base_url http://127.0.0.1:8000/v1)
  weft quantize model-f16.gguf model-q8_0.gguf --type q8_0   a GGUF file's matrices in Q8_0 blocks
  weft bench throughput --batch-sizes 1,8         weft vs transformers generate()
  weft bench throughput --model model-q8_0.gguf   weft vs llama.cpp on the same GGUF file
  weft bench structured --batch-sizes 1,8         the cost of a JSON Schema constraint
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weft",
        description="weft: text generation for causal language models.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(
        commands.add_parser(
            "generate",
            help="generate a completion for a prompt",
            description="Generate a completion for PROMPT and print it.",
        )
    )
    _add_score(
        commands.add_parser(
            "score",
            help="the exact logprob of each option after a prompt",
            description="Score each --option after PROMPT: the total logprob of its tokens, computed "
            "in one pass that runs the prompt and the options' shared prefixes once.",
        )
    )
    from weft.server import cli as server_cli

    server_cli.add_arguments(
        commands.add_parser(
            "serve",
            help="an OpenAI-compatible HTTP server (completions, chat, streaming, tools)",
            description="Serve the model over the OpenAI API: /v1/completions, /v1/chat/completions, "
            "/v1/responses, /v1/models, /health, /metrics.",
        )
    )
    _add_quantize(
        commands.add_parser(
            "quantize",
            help="rewrite a GGUF file with its matrices quantized (as llama.cpp's quantizer does)",
            description="Write OUTPUT, a GGUF file of INPUT's model, configuration, tokenizer and chat "
            "template with its matrices in --type blocks; llama.cpp loads it as a file of its own.",
        )
    )
    demo = commands.add_parser(
        "demo",
        help="what weft does, on the default model: chat, extraction, choice, tool call, logprobs",
        description=(
            "A chat answer, a Pydantic model extracted from a sentence, a choice with exact scores, a "
            "tool call and top-5 logprobs, each timed (the bundled model: free, JSON and choice completions)."
        ),
    )
    demo.add_argument(
        "--model", default=None, help="checkpoint directory or GGUF file (default: the default model)"
    )
    demo.add_argument("--seed", type=int, default=7, help="sampling seed (default: 7)")
    _add_bench(commands)
    return parser


def _benches() -> list[tuple[str, Any, str]]:
    """(name, module, summary) of every `weft bench` benchmark."""
    from weft.bench import (
        logprobs,
        overhead,
        parallel,
        quality,
        sampling,
        schema_corpus,
        serve,
        speculative,
        structured,
        throughput,
    )

    return [
        ("throughput", throughput, "prefill and decode tokens/s vs transformers (or llama.cpp on GGUF)"),
        ("serve", serve, "weft serve under 1-64 concurrent streaming clients vs offline LLM.generate"),
        ("parallel", parallel, "n samples, best_of and beam search: time and KV vs transformers"),
        ("overhead", overhead, "the engine's own cost per step, with a stand-in for the model"),
        ("logprobs", logprobs, "decode and prefill cost of logprobs and prompt logprobs"),
        ("sampling", sampling, "the sampler's work per step: tensor operations vs the device's kernels"),
        ("structured", structured, "constrained vs unconstrained decoding, and vs transformers + processor"),
        ("jsonschema", schema_corpus, "JSONSchemaBench coverage and compliance per subset"),
        (
            "quality",
            quality,
            "extraction accuracy and tool calls on a real model, with and without constraints",
        ),
        (
            "speculative",
            speculative,
            "speculative decoding on and off: copy, JSON, open text, oracle",
        ),
    ]


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="benchmarks against Hugging Face transformers",
        description="Benchmarks that measure weft and transformers side by side.",
    )
    bench_commands = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, module, summary in _benches():
        module.add_arguments(
            bench_commands.add_parser(
                name,
                help=summary,
                description=module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy decoding (default: 0.8)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1, off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0, off)")
    p.add_argument(
        "--min-p", type=float, default=0.0, help="minimum probability relative to the top (default: 0)"
    )
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="default: 1, off")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("-n", type=int, default=1, help="number of completions of the prompt (default: 1)")
    _add_parallel(p)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--stream", action="store_true", help="print text as it is generated")
    p.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="print each token's probability and top-K"
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="print each prompt token's probability and top-K",
    )
    constraint = p.add_argument_group("output constraints (at most one)")
    constraint.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE|JSON",
        help="JSON Schema the output must match: a file or inline JSON",
    )
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    constraint.add_argument(
        "--regex", default=None, help="regular expression the output must match (Rust syntax)"
    )
    constraint.add_argument("--grammar", default=None, metavar="FILE", help="Lark or GBNF grammar file")
    constraint.add_argument(
        "--grammar-syntax",
        default="auto",
        choices=["auto", "lark", "gbnf"],
        help="grammar syntax (default: auto, GBNF when the file uses '::=')",
    )
    constraint.add_argument("--choice", action="append", default=None, help="an allowed output (repeatable)")
    constraint.add_argument(
        "--choice-selection",
        default="greedy",
        choices=["greedy", "exact"],
        help="greedy: decode under the choice grammar; exact: return the most probable option",
    )
    constraint.add_argument(
        "--no-fast-forward", action="store_true", help="sample every token, even those the grammar forces"
    )
    _add_engine_options(p)


# `--seed` of generate and score is the request's; the engine's stays at its default
NOT_ENGINE_OPTIONS = ("seed",)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    from weft.engine.args import add_engine_arguments

    add_engine_arguments(
        p.add_argument_group("engine options (the keyword arguments of LLM)"), exclude=NOT_ENGINE_OPTIONS
    )


def _load_llm(args: argparse.Namespace) -> LLM:
    """The LLM of a command's engine options."""
    from weft import LLM
    from weft.engine.args import engine_options

    return LLM(**engine_options(args, exclude=NOT_ENGINE_OPTIONS))


def _add_parallel(p: argparse.ArgumentParser) -> None:
    p.add_argument("--best-of", type=int, default=None, help="sample this many, return the n most probable")
    p.add_argument(
        "--beam-width", type=int, default=None, metavar="W", help="beam search with W beams (greedy, scored)"
    )
    p.add_argument(
        "--length-penalty", type=float, default=1.0, help="beam search: score = logprob / length**this"
    )


def _add_quantize(p: argparse.ArgumentParser) -> None:
    from weft.model.quantize import QUANTIZATIONS

    p.add_argument("input", help="a GGUF file (float or quantized)")
    p.add_argument("output", help="the GGUF file to write")
    p.add_argument(
        "--type", default="q8_0", choices=QUANTIZATIONS, help="the blocks to write (default: q8_0)"
    )


def run_quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from weft.model.gguf_quantize import quantize_gguf

    count = quantize_gguf(Path(args.input), Path(args.output), args.type)
    print(f"weft quantize: {args.output}: {count} matrices in {args.type.upper()}")
    return 0


def _add_score(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--option", action="append", required=True, help="an option to score (repeatable)")
    _add_engine_options(p)


def run_score(args: argparse.Namespace) -> int:
    llm = _load_llm(args)
    scores = llm.score(args.prompt, args.option)
    print("| option | logprob | probability | tokens |")
    print("|---|---:|---:|---:|")
    for s in sorted(scores, key=lambda s: -s.logprob):
        print(f"| {s.text!r} | {s.logprob:.4f} | {math.exp(s.logprob):.4g} | {len(s.token_ids)} |")
    return 0


def _constraint_options(args: argparse.Namespace) -> dict[str, Any]:
    """The output constraint options, as SamplingParams / BeamSearchParams fields."""
    return {
        "json_schema": _read_json_or_file(args.json_schema),
        "json_object": args.json_object,
        "regex": args.regex,
        "grammar": _read_file(args.grammar),
        "grammar_syntax": args.grammar_syntax,
        "choice": args.choice,
    }


def run_beam_search(args: argparse.Namespace) -> int:
    from weft import BeamSearchParams

    params = BeamSearchParams(
        beam_width=args.beam_width,
        max_tokens=args.max_tokens,
        length_penalty=args.length_penalty,
        stop=args.stop,
        **_constraint_options(args),
    )
    llm = _load_llm(args)
    (result,) = llm.beam_search(args.prompt, params)
    if result.error is not None:
        print(f"weft: error: {result.error}", file=sys.stderr)
        return 1
    for rank, beam in enumerate(result.sequences):
        print(f"--- beam {rank}: score {beam.score:.4f}, logprob {beam.cumulative_logprob:.4f}")
        structured = any(v is not None for v in (args.json_schema, args.regex, args.grammar, args.choice))
        print(beam.text if structured or args.json_object else args.prompt + beam.text)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from weft import SamplingParams

    if args.beam_width is not None:
        return run_beam_search(args)
    params = SamplingParams(
        n=args.n,
        best_of=args.best_of,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=args.stop,
        **_constraint_options(args),
        choice_selection=args.choice_selection,
        fast_forward=not args.no_fast_forward,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )
    llm = _load_llm(args)
    if args.stream and args.n == 1:
        sys.stdout.write(args.prompt)
        for output in llm.stream(args.prompt, params):
            sys.stdout.write(output.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    (result,) = llm.generate(args.prompt, params)
    if result.prompt_logprobs is not None:
        print(logprob_table("prompt", result.prompt_token_ids, result.prompt_logprobs))
    for completion in result.outputs:
        if args.n > 1:
            print(f"--- completion {completion.index} ({completion.finish_reason})")
        if completion.finish_reason == "error":
            print(f"weft: error: {completion.error}", file=sys.stderr)
            return 1
        print(completion.text if params.structured else args.prompt + completion.text)
        if completion.logprobs is not None:
            table = logprob_table(
                "generated", completion.token_ids, list(completion.logprobs), completion.forced
            )
            print(table)
    return 0


def logprob_table(
    title: str, token_ids: Sequence[int], positions: list[Any], forced: Sequence[bool] | None = None
) -> str:
    """A readable table of one logprob entry per token: the token, its probability and rank, and
    the alternatives with theirs (`None` entries, the first prompt token, are skipped). Tokens a
    grammar forced are marked."""
    lines = [f"{title} tokens: probability, rank, alternatives", "| # | token | prob | rank | alternatives |"]
    lines.append("|---:|---|---:|---:|---|")
    for i, (token, position) in enumerate(zip(token_ids, positions, strict=True)):
        if position is None:
            continue
        chosen = position[token]
        others = [
            f"{lp.decoded_token!r} {math.exp(lp.logprob):.3f}" for t, lp in position.items() if t != token
        ]
        probability = math.exp(chosen.logprob)
        token_text = repr(chosen.decoded_token) + (" (forced)" if forced is not None and forced[i] else "")
        lines.append(f"| {i} | {token_text} | {probability:.4f} | {chosen.rank} | {', '.join(others)} |")
    return "\n".join(lines)


def _read_file(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None


def _read_json_or_file(value: str | None) -> str | None:
    """Inline JSON (starts with '{') or the path of a JSON file."""
    if value is None or value.lstrip().startswith("{"):
        return value
    return _read_file(value)


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(raw)
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "score":
            return run_score(args)
        if args.command == "serve":
            from weft.server import cli as server_cli

            if args.data_parallel_size > 1:  # replicas behind a router (weft/server/replicas.py)
                from weft.server import replicas

                return replicas.run(args, raw[raw.index("serve") + 1 :])
            return server_cli.run(args)
        if args.command == "quantize":
            return run_quantize(args)
        if args.command == "demo":
            from weft import demo

            return demo.run(args.model, args.seed)
        if args.bench == "throughput" and args.tensor_parallel_size > 1:
            from weft.bench import tensor_parallel  # one rank against N (weft/bench/tensor_parallel.py)

            return tensor_parallel.run(args)
        benches = {name: module for name, module, _ in _benches()}
        return benches[args.bench].run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"weft: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
