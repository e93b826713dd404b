"""User-facing sampling parameters, validated on construction."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

# A third-party logits processor: (token ids so far, logits [V]) -> logits [V].
LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]


class OutputKind(StrEnum):
    """What each `RequestOutput` of a request carries."""

    CUMULATIVE = "cumulative"  # all text and tokens so far
    DELTA = "delta"  # only what is new since the last output
    FINAL_ONLY = "final_only"  # one output, when the request finishes


class StructuredKind(StrEnum):
    JSON_SCHEMA = "json_schema"
    REGEX = "regex"
    LARK = "lark"
    GBNF = "gbnf"
    CHOICE = "choice"


class GrammarSyntax(StrEnum):
    AUTO = "auto"  # GBNF when the text uses `::=`, otherwise Lark
    LARK = "lark"
    GBNF = "gbnf"


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """One output constraint, normalised: `value` is the schema as JSON text, the regex, the grammar
    text, or the JSON list of choices. Hashable, so compiled grammars can be cached by it."""

    kind: StructuredKind
    value: str


def structured_spec(
    json_schema: Any = None,
    json_object: bool = False,
    regex: str | None = None,
    grammar: str | None = None,
    grammar_syntax: GrammarSyntax | str = GrammarSyntax.AUTO,
    choice: Sequence[str] | None = None,
) -> StructuredSpec | None:
    """The one constraint among the given ones, or None. Raises ValueError when several are given."""
    given = [
        name
        for name, value in (
            ("json_schema", json_schema),
            ("json_object", json_object or None),
            ("regex", regex),
            ("grammar", grammar),
            ("choice", choice),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(f"SamplingParams takes at most one output constraint, got {', '.join(given)}")
    if json_schema is not None:
        return StructuredSpec(StructuredKind.JSON_SCHEMA, _schema_text(json_schema))
    if json_object:
        return StructuredSpec(StructuredKind.JSON_SCHEMA, '{"type": "object"}')
    if regex is not None:
        _check(_text(regex), "regex", regex, "must be a non-empty string of valid Unicode")
        return StructuredSpec(StructuredKind.REGEX, regex)
    if grammar is not None:
        _check(
            _text(grammar) and grammar.strip() != "",
            "grammar",
            grammar,
            "must be a non-empty string",
        )
        return StructuredSpec(_grammar_kind(grammar, GrammarSyntax(grammar_syntax)), grammar)
    if choice is not None:
        _check(isinstance(choice, list | tuple), "choice", choice, "must be a list of strings")
        options = list(choice)
        _check(
            bool(options) and all(_text(c) for c in options),
            "choice",
            choice,
            "must be a non-empty list of non-empty strings",
        )
        return StructuredSpec(StructuredKind.CHOICE, json.dumps(options))
    return None


def _grammar_kind(grammar: str, syntax: GrammarSyntax) -> StructuredKind:
    if syntax == GrammarSyntax.GBNF or (syntax == GrammarSyntax.AUTO and "::=" in grammar):
        return StructuredKind.GBNF
    return StructuredKind.LARK


def _schema_text(schema: Any) -> str:
    """A JSON Schema given as a dict, a JSON string or a Pydantic model class, as JSON text."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"SamplingParams.json_schema is not valid JSON: {exc}") from None
    _check(
        isinstance(schema, dict | bool),
        "json_schema",
        type(schema).__name__,
        "must be a dict, a JSON string or a Pydantic model class",
    )
    try:
        return json.dumps(schema)  # key order kept: it is the order of the generated properties
    except (TypeError, ValueError) as exc:
        raise ValueError(f"SamplingParams.json_schema cannot be written as JSON: {exc}") from None


class LogprobsMode(StrEnum):
    """Which distribution `logprobs` report.

    RAW: the model's own distribution, log_softmax of the logits as the model produced them.
    PROCESSED: the distribution actually sampled from, after the grammar mask, logits processors,
    penalties and temperature (and top-k/top-p/min-p filtering, which sets filtered tokens to -inf).
    MASKED: the RAW values, not renormalised, of the tokens that could be sampled, and -inf for the
    others (those the grammar, a logits processor, a min_tokens ban or a filter excluded). Beam
    search ranks by these, as transformers does (its logits processors act on log-softmax scores).
    """

    RAW = "raw"
    PROCESSED = "processed"
    MASKED = "masked"


class ChoiceSelection(StrEnum):
    """How a `choice` constraint picks its option.

    GREEDY: decode token by token under the choice grammar (each token the most likely allowed one,
    or sampled), as for any other constraint.
    EXACT: score every option exactly (the total logprob of its tokens after the prompt, in one
    batched pass over the options' token trie) and return the most probable ones, best first.
    """

    GREEDY = "greedy"
    EXACT = "exact"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request. Every field is checked here; a bad value raises `ValueError`
    that names the field.

    `temperature=0` is greedy decoding. `top_k=0` (or -1) and `top_p=1` disable those filters.
    `seed` makes a request reproducible whatever else runs in the same batch. `best_of=m` samples
    m completions sharing the prompt and returns the `n` with the highest cumulative logprob.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    prompt_logprobs: int | None = None
    output_kind: OutputKind = OutputKind.CUMULATIVE
    logits_processors: Sequence[LogitsProcessor] = field(default=())
    json_schema: Any = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    grammar_syntax: GrammarSyntax = GrammarSyntax.AUTO
    choice: Sequence[str] | None = None
    choice_selection: ChoiceSelection = ChoiceSelection.GREEDY
    fast_forward: bool = True
    structured: StructuredSpec | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._check_numbers()
        self._check_lengths()
        self._normalize()

    def _check_numbers(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        _check(
            self.best_of is None or (_is_int(self.best_of) and self.best_of >= self.n),
            "best_of",
            self.best_of,
            f"must be None or an integer >= n ({self.n})",
        )
        _check(
            _real(self.temperature) and self.temperature >= 0.0,
            "temperature",
            self.temperature,
            "must be a finite number >= 0 (0 means greedy)",
        )
        _check(_real(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            _is_int(self.top_k) and self.top_k >= -1,
            "top_k",
            self.top_k,
            "must be -1 or 0 (disabled) or a positive count",
        )
        _check(_real(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(
            _real(self.repetition_penalty) and self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "must be a finite number > 0",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_real(value) and -2.0 <= value <= 2.0, name, value, "must be in [-2, 2]")
        _check(
            self.seed is None
            or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX - self.num_samples),
            "seed",
            self.seed,
            f"must be None or an integer in [{SEED_MIN}, {SEED_MAX} - best_of]",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and value >= 0),
                name,
                value,
                "must be None or an integer >= 0",
            )
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "json_object",
            "fast_forward",
        ):
            _check(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be True or False")

    def _check_lengths(self) -> None:
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "must be None or an integer >= 1",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "must be an integer >= 0",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"must be <= max_tokens ({self.max_tokens})",
        )

    def _normalize(self) -> None:
        for name in FLOAT_FIELDS:
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logits_processors", _processors(self.logits_processors))
        object.__setattr__(self, "logprobs_mode", _enum(LogprobsMode, self.logprobs_mode, "logprobs_mode"))
        object.__setattr__(self, "output_kind", _enum(OutputKind, self.output_kind, "output_kind"))
        object.__setattr__(
            self, "grammar_syntax", _enum(GrammarSyntax, self.grammar_syntax, "grammar_syntax")
        )
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        spec = structured_spec(
            self.json_schema, self.json_object, self.regex, self.grammar, self.grammar_syntax, self.choice
        )
        object.__setattr__(self, "structured", spec)
        selection = _enum(ChoiceSelection, self.choice_selection, "choice_selection")
        object.__setattr__(self, "choice_selection", selection)
        _check(
            selection == ChoiceSelection.GREEDY or self.choice is not None,
            "choice_selection",
            selection.value,
            "'exact' needs a `choice` list to select from",
        )

    @property
    def num_samples(self) -> int:
        """How many sequences the request runs: `best_of`, or `n`."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def exact_choice(self) -> bool:
        return self.choice_selection == ChoiceSelection.EXACT

    @property
    def stop_strings(self) -> tuple[str, ...]:
        assert isinstance(self.stop, tuple)
        return self.stop

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        values = {name: getattr(self, name) for name, f in self.__dataclass_fields__.items() if f.init}
        values.update(changes)
        return SamplingParams(**values)


FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # seeds are int64 (sample i of n uses seed + i)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        shown = repr(value)
        raise ValueError(f"SamplingParams.{name} {rule}, got {shown[:80]}{'...' if len(shown) > 80 else ''}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    """A finite int or float (not a bool, not NaN or +-inf, not an int too large for a float)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _text(value: object) -> bool:
    """A non-empty string that is valid Unicode (no lone surrogates)."""
    if not isinstance(value, str) or not value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    _check(isinstance(stop, list | tuple), "stop", stop, "must be a string or a list of strings")
    assert isinstance(stop, list | tuple)
    for s in stop:
        _check(_text(s), "stop", s, "entries must be non-empty strings of valid Unicode")
    return tuple(stop)


def _token_ids(ids: object, name: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    _check(isinstance(ids, list | tuple), name, ids, "must be a list of token ids")
    assert isinstance(ids, list | tuple)
    for t in ids:
        _check(_is_int(t) and 0 <= t <= SEED_MAX, name, t, "entries must be integers >= 0")
    return tuple(ids)


def _processors(fns: object) -> tuple[LogitsProcessor, ...]:
    _check(isinstance(fns, list | tuple), "logits_processors", fns, "must be a list of callables")
    assert isinstance(fns, list | tuple)
    for fn in fns:
        _check(
            callable(fn), "logits_processors", fn, "entries must be callables (token_ids, logits) -> logits"
        )
    return tuple(fns)


def _enum(kind: type[StrEnum], value: object, name: str) -> Any:
    try:
        return kind(value) if isinstance(value, str) else kind[""]
    except (ValueError, KeyError):
        allowed = ", ".join(repr(k.value) for k in kind)
        _check(False, name, value, f"must be one of {allowed}")


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """Beam search: keep the `beam_width` most probable partial sequences, extend each by its most
    probable tokens, and return the `beam_width` best finished ones, best first.

    Scores follow transformers: the sum of the generated tokens' logprobs divided by
    `generated_length ** length_penalty` (> 0 favours longer sequences). `early_stopping`: True
    stops once `beam_width` sequences have finished; False stops when the best running beam,
    scored at its current length, cannot beat the worst finished one; "never" scores it at
    `max_tokens` when `length_penalty > 0` (the exact stopping rule). `beam_width=1` is greedy
    decoding, stopping at the first EOS, as in transformers. A constraint (json_schema,
    regex, grammar, choice, as in `SamplingParams`) holds for every beam: each beam has its own
    grammar state, forked from its parent's.
    """

    beam_width: int
    max_tokens: int = 16
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    json_schema: Any = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    grammar_syntax: GrammarSyntax = GrammarSyntax.AUTO
    choice: Sequence[str] | None = None

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, value: object, rule: str) -> None:
            if not ok:
                raise ValueError(f"BeamSearchParams.{name} {rule}, got {value!r}")

        check(
            _is_int(self.beam_width) and self.beam_width >= 1, "beam_width", self.beam_width, "must be >= 1"
        )
        check(_real(self.length_penalty), "length_penalty", self.length_penalty, "must be a finite number")
        check(
            self.early_stopping in (True, False, "never"),
            "early_stopping",
            self.early_stopping,
            "must be True, False or 'never'",
        )
        try:
            self.sampling_params(2)
        except ValueError as exc:
            raise ValueError(str(exc).replace("SamplingParams.", "BeamSearchParams.", 1)) from None

    def sampling_params(self, num_candidates: int) -> SamplingParams:
        """The parameters of each beam: greedy, with the top `num_candidates` logprobs of the tokens
        it may take (MASKED: the model's logprobs where the constraint allows), every token sampled
        (no fast-forward: a forced token's logprob counts in the score too)."""
        return SamplingParams(
            temperature=0.0,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logprobs=num_candidates,
            logprobs_mode=LogprobsMode.MASKED,
            output_kind=OutputKind.FINAL_ONLY,
            json_schema=self.json_schema,
            json_object=self.json_object,
            regex=self.regex,
            grammar=self.grammar,
            grammar_syntax=self.grammar_syntax,
            choice=self.choice,
            fast_forward=False,
        )
