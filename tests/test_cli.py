"""The `weft` command line, run as a user would run it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weft.cli import build_parser, main


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "weft", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_help_documents_every_command():
    parser = build_parser()
    text = parser.format_help()
    assert "generate" in text and "bench" in text
    result = run_cli("generate", "--help")
    assert result.returncode == 0
    for flag in ("--model", "--max-tokens", "--temperature", "--top-p", "--seed", "--stream"):
        assert flag in result.stdout


def test_help_of_a_bench_names_its_options(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench", "throughput", "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--batch-sizes", "--prompt-len", "--output-len"):
        assert flag in out


def test_generate_with_a_checkpoint(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "--max-tokens", "5", "--temperature", "0", "Hello"])
    assert code == 0
    assert capsys.readouterr().out.startswith("Hello")


def test_generate_stream_prints_the_same_text(tiny_llama, capsys):
    main(["generate", "--model", str(tiny_llama), "--max-tokens", "8", "--temperature", "0", "Hello"])
    plain = capsys.readouterr().out
    main(
        [
            "generate",
            "--model",
            str(tiny_llama),
            "--max-tokens",
            "8",
            "--temperature",
            "0",
            "--stream",
            "Hello",
        ]
    )
    assert capsys.readouterr().out == plain


def test_bad_arguments_exit_with_a_message(tiny_llama, capsys):
    code = main(["generate", "--model", str(tiny_llama), "--top-p", "0", "Hello"])
    assert code == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    assert main(["generate", "--model", "/does/not/exist", "x"]) == 2


def test_generate_with_constraints(tiny_llama, tmp_path, capsys):
    model = ["generate", "--model", str(tiny_llama), "--seed", "1"]
    assert main([*model, "--choice", "yes", "--choice", "no", "Is it?"]) == 0
    assert capsys.readouterr().out.strip() in ("yes", "no")
    assert main([*model, "--regex", "[0-9]{4}", "Year:"]) == 0
    assert len(capsys.readouterr().out.strip()) == 4
    schema = tmp_path / "schema.json"
    schema.write_text(
        '{"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], '
        '"additionalProperties": false}'
    )
    assert main([*model, "--json-schema", str(schema), "Out:"]) == 0
    assert capsys.readouterr().out.strip() in ('{"n": 1}', '{"n": 2}')
    grammar = tmp_path / "g.gbnf"
    grammar.write_text('root ::= "A" | "B"')
    assert main([*model, "--grammar", str(grammar), "Out:"]) == 0
    assert capsys.readouterr().out.strip() in ("A", "B")


def test_bad_constraint_is_reported(tiny_llama, capsys):
    assert main(["generate", "--model", str(tiny_llama), "--regex", "[", "x"]) == 1
    assert "invalid regex" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_llama), "--regex", "a", "--choice", "b", "x"]) == 2
    assert "at most one output constraint" in capsys.readouterr().err


def test_bench_throughput_with_only_a_config_measures_real_rates(tiny_llama, tmp_path, capsys):
    """A user's clone has no shared tokenizer: prompts come from the config's vocabulary, and every
    rate printed was measured (weft generated every token it was timed for); two dtypes in one run,
    each with its weight bytes, and the plot of both."""
    out, plot = tmp_path / "result.json", tmp_path / "decode.png"
    args = ["--batch-sizes", "1,2", "--prompt-len", "8", "--output-len", "6", "--repeats", "1"]
    config = str(tiny_llama / "config.json")
    dtypes = ["--dtype", "float32,bfloat16", "--plot", str(plot)]
    code = main(
        ["bench", "throughput", "--config", config, *args, *dtypes, "--no-transformers", "--json", str(out)]
    )
    assert code == 0
    import json

    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["float32", "bfloat16"]
    assert runs["bfloat16"]["weight_bytes"] < 0.6 * runs["float32"]["weight_bytes"]
    for run in runs.values():
        results = run["results"]
        assert [r["batch"] for r in results] == [1, 2]
        for r in results:
            assert 1 < r["weft_decode_tps"] < 1e6 and 1 < r["weft_prefill_tps"] < 1e7
    assert plot.read_bytes().startswith(b"\x89PNG")
    assert "bfloat16 weights, float32 activations" in capsys.readouterr().out


def test_bench_throughput_model_errors_say_what_to_do(tiny_llama, tmp_path, capsys):
    """--model that is not there, and --model with the tensor-parallel bench (which builds its own
    random model): each a clear error, exit 2, before anything is measured."""
    assert main(["bench", "throughput", "--model", str(tmp_path / "nothing.gguf")]) == 2
    assert "no such checkpoint (--model)" in capsys.readouterr().err
    assert main(["bench", "throughput", "--model", str(tiny_llama), "--tensor-parallel-size", "2"]) == 2
    assert "drop --model" in capsys.readouterr().err


def test_bench_overhead_measures_every_phase(tmp_path):
    """The overhead benchmark runs end to end (on the bundled tokenizer, for speed) and reports a
    host time and every phase of the step for each case."""
    from weft.bench.overhead import DEVICE_PHASES, HOST_PHASES
    from weft.engine.default_model import bundled_model_path

    out = tmp_path / "overhead.json"
    args = ["--tokenizer", str(bundled_model_path()), "--batch-sizes", "1,4", "--steps", "3"]
    args += ["--repeats", "2"]  # each case twice, the better run kept
    code = main(["bench", "overhead", *args, "--workloads", "greedy,json,top-5,n=4", "--json", str(out)])
    assert code == 0
    import json

    results = json.loads(out.read_text())["results"]
    assert [(r["batch"], r["workload"]) for r in results][:4] == [
        (1, "greedy"),
        (1, "json"),
        (1, "top-5"),
        (1, "n=4"),
    ]
    for r in results:
        assert r["host_s"] > 0 and r["rows_per_step"] >= 1
        assert set(HOST_PHASES + DEVICE_PHASES) <= set(r["phases"])
        assert all(v >= 0 for v in r["phases"].values())
    assert any(r["phases"]["mask start"] > 0 for r in results if r["workload"] == "json")
    assert any(r["phases"]["logprobs"] > 0 for r in results if r["workload"] == "top-5")


def test_generate_prints_logprob_tables(tiny_llama, capsys):
    args = ["generate", "--model", str(tiny_llama), "--max-tokens", "3", "--temperature", "0", "Hello"]
    assert main([*args, "--logprobs", "2", "--prompt-logprobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "prompt tokens: probability, rank, alternatives" in out
    generated = out.split("generated tokens: probability, rank, alternatives")[1].strip().splitlines()
    rows = [line for line in generated if line.startswith("| ") and not line.startswith("| #")]
    assert len(rows) == 3 and all(row.split(" | ")[3] == "1" for row in rows)  # greedy: rank 1


def test_bench_logprobs_runs_every_mode(tiny_llama, tmp_path):
    out = tmp_path / "logprobs.json"
    args = ["--config", str(tiny_llama / "config.json"), "--batch-sizes", "1,2", "--output-len", "4"]
    assert main(["bench", "logprobs", *args, "--prompt-len", "16", "--repeats", "1", "--json", str(out)]) == 0
    import json

    results = json.loads(out.read_text())
    assert [r["batch"] for r in results["decode"]] == [1, 2]
    for r in results["decode"]:
        assert all(r[f"tps_{mode}"] > 0 for mode in ("off", "0", "5", "20"))
    assert results["prefill_s"] > 0 and results["prefill_prompt_logprobs_s"] > 0


def test_generate_beam_search_prints_the_beams_best_first(tiny_llama, capsys):
    from weft import LLM, BeamSearchParams

    code = main(["generate", "--model", str(tiny_llama), "--beam-width", "3", "--max-tokens", "6", "Hello"])
    assert code == 0
    out = capsys.readouterr().out
    headers = [line for line in out.splitlines() if line.startswith("--- beam")]
    assert len(headers) == 3
    scores = [float(h.split("score ")[1].split(",")[0]) for h in headers]
    assert scores == sorted(scores, reverse=True)
    (expected,) = LLM(str(tiny_llama), show_progress=False).beam_search(
        "Hello", BeamSearchParams(beam_width=3, max_tokens=6)
    )
    assert f"score {expected.sequences[0].score:.4f}" in headers[0]


def test_score_prints_each_option_most_probable_first(tiny_llama, capsys):
    code = main(["score", "--model", str(tiny_llama), "Hello", "--option", " speak", "--option", " we"])
    assert code == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| '")]
    assert len(rows) == 2
    logprobs = [float(row.split("|")[2]) for row in rows]
    assert logprobs == sorted(logprobs, reverse=True) and all(lp < 0 for lp in logprobs)


def test_score_needs_an_option(capsys):
    try:
        code = main(["score", "Hello"])
    except SystemExit as exited:  # argparse's own refusal
        code = exited.code
    assert code not in (0, None) and "--option" in capsys.readouterr().err


def test_generate_marks_forced_tokens_in_the_logprob_table(tiny_llama, capsys):
    args = ["generate", "--model", str(tiny_llama), "--max-tokens", "60", "--temperature", "0", "Hello"]
    assert main([*args, "--regex", "(alpha|omega) then a forced tail", "--logprobs", "1"]) == 0
    out = capsys.readouterr().out
    generated = out.split("generated tokens: probability, rank, alternatives")[1].strip().splitlines()
    rows = [line for line in generated if line.startswith("| ") and not line.startswith("| #")]
    assert rows[-1].split(" | ")[1].endswith("(forced)")
    assert not rows[0].split(" | ")[1].endswith("(forced)")  # the first token is sampled


def test_bench_sampling_compares_both_kernel_sets(tmp_path):
    import json

    out = tmp_path / "sampling.json"
    args = ["--batch-sizes", "1,3", "--vocab", "300", "--repeats", "1", "--json", str(out)]
    assert main(["bench", "sampling", *args]) == 0
    results = json.loads(out.read_text())
    assert len(results) == 2 * 7 and all(r["same_tokens"] for r in results)
    assert all(r["tensor_ops_ms"] > 0 and r["kernel_set_ms"] > 0 for r in results)


def _subcommand(parser, name):
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    return commands.choices[name]


def test_every_engine_option_is_a_command_line_option_of_serve_generate_and_score():
    """The engine's options are said once (EngineArgs); serve, generate and score read them back
    into the same EngineArgs, field by field."""
    from dataclasses import fields

    from weft.engine.args import EngineArgs, engine_options

    parser = build_parser()
    argv = [
        "--model", "m", "--dtype", "bfloat16", "--max-num-seqs", "3", "--kv-cache-memory-gb", "0.5",
        "--no-enable-prefix-caching", "--async-scheduling", "--matmul-precision", "float32",
    ]  # fmt: skip
    expected = {
        "model": "m", "dtype": "bfloat16", "max_num_seqs": 3, "kv_cache_memory_gb": 0.5,
        "enable_prefix_caching": False, "async_scheduling": True, "matmul_precision": "float32",
    }  # fmt: skip
    commands = (("serve", [], ()), ("generate", ["p"], ("seed",)), ("score", ["p"], ("seed",)))
    for command, head, exclude in commands:
        tail = ["--option", "x"] if command == "score" else []
        args = parser.parse_args([command, *head, *argv, *tail])
        options = engine_options(args, exclude)
        cli_names = {f.name for f in fields(EngineArgs) if "help" in f.metadata} - set(exclude)
        assert set(options) == cli_names
        for name, value in expected.items():
            assert options[name] == value, (command, name)
        defaults = EngineArgs(**{n: v for n, v in options.items() if n not in expected})
        assert defaults == EngineArgs()  # every other option keeps EngineArgs' default
        help_text = _subcommand(parser, command).format_help()
        for name in cli_names:
            assert "--" + name.replace("_", "-") in help_text


def test_llm_rejects_an_unknown_engine_option_and_lists_the_known_ones():
    import pytest

    from weft import LLM

    with pytest.raises(TypeError, match=r"gpu_memory_utilization.*max_num_seqs"):
        LLM(gpu_memory_utilization=0.9)


def test_bench_speculative_runs_every_workload_with_identical_tokens(tmp_path):
    """`weft bench speculative` end to end on the bundled model: every workload and the oracles, the
    tokens with speculation on equal to those without it, and the oracles' drafts all accepted; the
    copy prompts show the passage again from a line's start (never cut inside a word)."""
    import json

    from conftest import shared_data

    from weft.bench.speculative import _line_start, _requests

    shared_data("corpora/tinyshakespeare.txt")  # the workloads' prompts (skips where it is absent)
    out = tmp_path / "speculative.json"
    args = ["--batch-sizes", "2", "--repeats", "1", "--max-tokens", "12", "--oracle-ks", "2"]
    bundled = ["--model", "bundled", "--oracle-configs", ""]
    assert main(["bench", "speculative", *args, *bundled, "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    workloads = ["copy", "json", "open", "oracle", "json-oracle", "json-chained"]
    assert [r["workload"] for r in results] == workloads
    assert all(r["identical"] and r["tps_off"] > 0 and r["tps_on"] > 0 for r in results)
    assert [r["acceptance"] for r in results[3:]] == [1.0] * 3  # the oracles' drafts: all accepted
    assert [_line_start(text, 8) for text in ("ab\ncd\nefgh", "abcdefghij", "abcdefgh\nij")] == [6, 8, 8]
    assert all(prompt.endswith("\n") for prompt, _ in _requests("copy", 4, 8))


def test_bench_throughput_pairs_each_weft_run_with_the_reference_run_after_it(capsys):
    """Beside the best run of each engine, the decode ratio of each weft run over the reference run
    that followed it, and their median: where the machine's memory speed moves between runs, the best
    runs of the two engines may come from different speeds."""
    from weft.bench.throughput import _print_paired_ratios
    from weft.bench.timing import Timing

    ours = [Timing(0.1, 1.1), Timing(0.1, 2.1), Timing(0.1, 1.6)]  # 1.0, 2.0, 1.5 s of decode
    theirs = [Timing(0.2, 1.7), Timing(0.2, 2.2), Timing(0.2, 3.2)]  # 1.5, 2.0, 3.0 s
    ratios = Timing.paired_decode_ratios(ours, theirs, batch=1, output_len=11)
    assert ratios == pytest.approx([1.5, 1.0, 2.0])
    _print_paired_ratios([{"batch": 1, "decode_ratios": ratios}, {"batch": 8}], "llama.cpp")
    out = capsys.readouterr().out
    assert "each weft run / the llama.cpp run after it" in out
    assert "batch 1: 1.50, 1.00, 2.00 (median 1.50)" in out and "batch 8" not in out
