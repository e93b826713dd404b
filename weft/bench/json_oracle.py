"""The ceiling of JSON extraction under speculation: drafts that are the model's own greedy JSON,
guessed value by value, as a field lookup guesses (`weft bench speculative --workloads json-oracle`).

A reference run without speculation writes each request's JSON under `SCHEMA`; replaying it through
the grammar marks the tokens the grammar forced. The drafter then guesses the reference's tokens up
to the next forced one (a value and what closes it), as `NgramDrafter`'s field lookup does where the
prompt states every value. Two drafters: `ValueDrafter` stops there (the forced tokens come after
the next sampled token, the next value a step later), `ChainedValueDrafter` also guesses past forced
tokens (`propose_after`, weft/speculative/forced.py), so a step may verify several values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# Five values of a record, strings cut short so that a random-weight model ends them too.
SCHEMA = {
    "type": "object",
    "properties": {
        **{key: {"type": "string", "maxLength": 6} for key in ("name", "home", "city", "role")},
        "age": {"type": "integer", "maximum": 99},
    },
    "required": ["name", "age", "home", "city", "role"],
}

Reference = tuple[list[int], frozenset[int]]  # prompt + output, and the positions the grammar forced


class ValueDrafter:
    """Guesses the reference's tokens up to the next one the grammar forced."""

    def __init__(self, references: dict[tuple[int, ...], Reference]) -> None:
        self.references = references  # prompt -> reference
        self.reference: Reference | None = None

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        if self.reference is None:
            self.reference = next(
                (ref for prompt, ref in self.references.items() if tuple(token_ids[: len(prompt)]) == prompt),
                ([], frozenset()),
            )
        tokens, n = self.reference[0], len(token_ids)
        return self._value_at(n, k) if n <= len(tokens) and tokens[n - 1] == token_ids[-1] else []

    def _value_at(self, start: int, k: int) -> list[int]:
        assert self.reference is not None
        tokens, forced = self.reference
        guessed = []
        for i in range(start, min(start + k, len(tokens))):
            if i in forced:
                break
            guessed.append(tokens[i])
        return guessed


class ChainedValueDrafter(ValueDrafter):
    """... and the next value past the tokens the grammar forces after a guess."""

    def propose_after(self, token_ids: Sequence[int], draft: list[int], k: int) -> list[int]:
        return self._value_at(len(token_ids) + len(draft), k) if self.reference else []


def references(engine: Any, outputs: list[Any]) -> dict[tuple[int, ...], Reference]:
    """Each output's prompt and tokens, and which of them the grammar forced (replayed through a
    fresh matcher of `SCHEMA`)."""
    from weft.params import StructuredKind, StructuredSpec

    grammars = engine.grammars
    grammar = grammars.backend.compile(StructuredSpec(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    refs = {}
    for out in outputs:
        tokens, prompt = out.outputs[0].token_ids, out.prompt_token_ids
        matcher, forced, i = grammars.new_matcher(grammar), set[int](), 0
        while i < len(tokens):
            run = matcher.forced_tokens()
            if run and tokens[i : i + len(run)] == run:
                forced.update(range(len(prompt) + i, len(prompt) + i + len(run)))
                matcher.consume(run)
                i += len(run)
            else:
                matcher.consume([tokens[i]])
                i += 1
        refs[tuple(prompt)] = (prompt + tokens, frozenset(forced))
    return refs
