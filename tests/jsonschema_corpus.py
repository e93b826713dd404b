"""A fixed sample of JSONSchemaBench schemas from ../shared/data, and validation of outputs."""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema


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
    try:
        instance = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    return None if error is None else error.message
