"""A fixed sample of JSONSchemaBench schemas from ../shared/data, validation of outputs against them,
and `weft bench jsonschema`: coverage (schemas compiled) and compliance (valid outputs) per subset.

Validation uses `jsonschema` (a test dependency): Draft 2020-12 with format checking, as in the
JSONSchemaBench paper.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "jsonschema" / "jsonschemabench"


@dataclass(frozen=True)
class SchemaCase:
    subset: str
    case_id: str
    schema: dict[str, Any]


def load_sample(folder: Path, per_subset: int) -> list[SchemaCase]:
    """The first `per_subset` schemas of every subset (files sorted by name): a fixed sample."""
    cases = []
    for path in sorted(folder.glob("*.jsonl.gz")):
        subset = path.name.removesuffix(".jsonl.gz")
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in list(f)[:per_subset]:
                record = json.loads(line)
                if isinstance(record["schema"], dict):
                    cases.append(SchemaCase(subset, str(record["id"]), record["schema"]))
    return cases


def validation_error(schema: dict[str, Any], text: str) -> str | None:
    """None if `text` is JSON valid under `schema` (Draft 2020-12, formats checked), else why not."""
    import jsonschema

    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    return None if error is None else error.message


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--per-subset", type=int, default=30, help="schemas per subset (default: 30)")
    p.add_argument("--max-tokens", type=int, default=256, help="new tokens per output (default: 256)")
    p.add_argument("--folder", type=Path, default=CORPUS, help="folder of JSONSchemaBench .jsonl.gz files")


def run(args: argparse.Namespace) -> int:
    from weft import LLM, SamplingParams

    cases = load_sample(args.folder, args.per_subset)
    llm = LLM(args.model, max_num_seqs=64, show_progress=False)
    params = [
        SamplingParams(json_schema=c.schema, max_tokens=args.max_tokens, temperature=0.8, seed=i)
        for i, c in enumerate(cases)
    ]
    print(
        f"weft bench jsonschema: {len(cases)} schemas, {len({c.subset for c in cases})} subsets", flush=True
    )
    outputs = llm.generate(["Return the JSON object:"] * len(cases), params)
    table: dict[str, Counter[str]] = {}
    for case, out in zip(cases, outputs, strict=True):
        result = out.outputs[0]
        row = table.setdefault(case.subset, Counter())
        row["total"] += 1
        row[result.finish_reason or "?"] += 1
        if result.finish_reason == "stop":
            row["valid" if validation_error(case.schema, result.text) is None else "invalid"] += 1
    _print(table)
    return 0


def _print(table: dict[str, Counter[str]]) -> None:
    print("\n| subset | schemas | compiled | coverage | finished (stop) | valid | compliance |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    total: Counter[str] = Counter()
    for subset, row in [*sorted(table.items()), ("all", total)]:
        if subset != "all":
            total.update(row)
        compiled = row["total"] - row["error"]
        compliance = f"{100 * row['valid'] / row['stop']:.1f}%" if row["stop"] else "-"
        print(
            f"| {subset} | {row['total']} | {compiled} | {100 * compiled / row['total']:.1f}% "
            f"| {row['stop']} | {row['valid']} | {compliance} |"
        )
