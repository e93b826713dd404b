"""User-facing sampling parameters, validated on construction."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import attrs
import torch

from weft.schema_objects import JsonSchemaMode, apply_mode

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
    owner: str = "SamplingParams",
    json_schema_mode: JsonSchemaMode = JsonSchemaMode.CLOSED,
) -> StructuredSpec | None:
    """The one constraint among the given ones, or None. Raises ValueError, naming `owner`'s field,
    when several are given or one is malformed."""
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
        raise ValueError(f"{owner} takes at most one output constraint, got {', '.join(given)}")
    if json_schema is not None:
        return StructuredSpec(StructuredKind.JSON_SCHEMA, _schema_text(json_schema, owner, json_schema_mode))
    if json_object:
        return StructuredSpec(StructuredKind.JSON_SCHEMA, '{"type": "object"}')
    if regex is not None:
        _check(_text(regex), owner, "regex", regex, "must be a non-empty string of valid Unicode")
        return StructuredSpec(StructuredKind.REGEX, regex)
    if grammar is not None:
        _check(
            _text(grammar) and grammar.strip() != "",
            owner,
            "grammar",
            grammar,
            "must be a non-empty string",
        )
        return StructuredSpec(_grammar_kind(grammar, GrammarSyntax(grammar_syntax)), grammar)
    if choice is not None:
        _check(isinstance(choice, list | tuple), owner, "choice", choice, "must be a list of strings")
        options = list(choice)
        _check(
            bool(options) and all(_text(c) for c in options),
            owner,
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


def _schema_text(schema: Any, owner: str, mode: JsonSchemaMode) -> str:
    """A JSON Schema given as a dict, a JSON string or a Pydantic model class, as JSON text, its
    objects closed as `mode` says (weft/schema_objects.py)."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ParamError(owner, "json_schema", f"is not valid JSON: {exc}") from None
    _check(
        isinstance(schema, dict | bool),
        owner,
        "json_schema",
        type(schema).__name__,
        "must be a dict, a JSON string or a Pydantic model class",
    )
    try:
        # key order kept: it is the order of the generated properties
        return json.dumps(apply_mode(schema, mode))
    except (TypeError, ValueError) as exc:
        raise ParamError(owner, "json_schema", f"cannot be written as JSON: {exc}") from None


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


class Resampling(StrEnum):
    """How SMC draws the particles that survive a resampling step (`SMCParams.resampling`)."""

    SYSTEMATIC = "systematic"  # one uniform draw, N evenly spaced points: the least added noise
    STRATIFIED = "stratified"  # one uniform draw in each of N equal strata
    MULTINOMIAL = "multinomial"  # N independent draws


class SMCOutput(StrEnum):
    """What an SMC run returns (`SMCParams.output`)."""

    SAMPLE = "sample"  # one particle, drawn in proportion to its weight
    WEIGHTED = "weighted"  # every particle, with its normalized weight


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # seeds are int64 (sample i of n uses seed + i)


class ParamError(ValueError):
    """A bad parameter: `field` (of `owner`, "" where a converter cannot tell) and what is wrong
    with it. The server names its own field in its place (weft/server/protocol.py)."""

    def __init__(self, owner: str, field: str, detail: str) -> None:
        super().__init__(f"{owner}.{field} {detail}" if owner else f"{field} {detail}")
        self.field, self.detail = field, detail


def _check(ok: bool, owner: str, name: str, value: object, rule: str) -> None:
    if not ok:
        shown = repr(value)
        raise ParamError(owner, name, f"{rule}, got {shown[:80]}{'...' if len(shown) > 80 else ''}")


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


# Validators: each checks one field's value after its converter ran and names the field and its class.
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _rule(ok: Callable[[Any], bool], rule: str) -> Validator:
    def validate(owner: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        _check(ok(value), type(owner).__name__, attribute.name, value, rule)

    return validate


def _int_at_least(low: int, *, optional: bool = False) -> Validator:
    rule = f"must be {'None or ' if optional else ''}an integer >= {low}"
    return _rule(lambda v: (optional and v is None) or (_is_int(v) and v >= low), rule)


def _number(ok: Callable[[float], bool], rule: str) -> Validator:
    return _rule(lambda v: _real(v) and ok(v), rule)


def _each(ok: Callable[[Any], bool], rule: str) -> Validator:
    """For a tuple field: every entry passes `ok` (the first that does not is named)."""

    def validate(owner: Any, attribute: attrs.Attribute[Any], values: tuple[Any, ...]) -> None:
        for value in values:
            _check(ok(value), type(owner).__name__, attribute.name, value, rule)

    return validate


_FLAG = _rule(lambda v: isinstance(v, bool), "must be True or False")

# Converters: each turns what a user may pass into the type the field stores. A value of a wrong type
# is passed on unchanged (or wrapped in a tuple) for the field's validator to name.


def _float(value: float) -> float:
    return float(value) if _real(value) else value


def _top_k(value: int) -> int:
    return 0 if _is_int(value) and value == -1 else value


def _strings(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """None, one string, or a list of strings."""
    if value is None:
        return ()
    items: Sequence[Any] = value if isinstance(value, list | tuple) else [value]
    return tuple(items)


def _token_ids(value: Sequence[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    _check(isinstance(value, list | tuple), "", "stop_token_ids", value, "must be a list of token ids")
    return tuple(value)


def _processors(value: Sequence[LogitsProcessor]) -> tuple[LogitsProcessor, ...]:
    _check(isinstance(value, list | tuple), "", "logits_processors", value, "must be a list of callables")
    return tuple(value)


def _enum(kind: type[StrEnum], value: object, name: str) -> Any:
    try:
        return kind(value) if isinstance(value, str) else kind[""]
    except (ValueError, KeyError):
        allowed = ", ".join(repr(k.value) for k in kind)
        _check(False, "", name, value, f"must be one of {allowed}")


def _logprobs_mode(value: LogprobsMode | str) -> LogprobsMode:
    return _enum(LogprobsMode, value, "logprobs_mode")


def _output_kind(value: OutputKind | str) -> OutputKind:
    return _enum(OutputKind, value, "output_kind")


def _grammar_syntax(value: GrammarSyntax | str) -> GrammarSyntax:
    return _enum(GrammarSyntax, value, "grammar_syntax")


def _choice_selection(value: ChoiceSelection | str) -> ChoiceSelection:
    return _enum(ChoiceSelection, value, "choice_selection")


def _json_schema_mode(value: JsonSchemaMode | str) -> JsonSchemaMode:
    return _enum(JsonSchemaMode, value, "json_schema_mode")


def _resampling(value: Resampling | str) -> Resampling:
    return _enum(Resampling, value, "resampling")


def _smc_output(value: SMCOutput | str) -> SMCOutput:
    return _enum(SMCOutput, value, "output")


@attrs.frozen(kw_only=True)
class SMCParams:
    """Sequential Monte Carlo over grammar-constrained particles (`weft/engine/smc.py`).

    Masking the logits to a constraint renormalizes at every step, which samples the strings of
    the language in other proportions than the model gives them. SMC runs `num_particles`
    particles, weighs each by the probability mass the constraint kept at each of its steps, and
    resamples them when the effective sample size of the live ones falls below `ess_threshold`
    times their number; its output follows the model's own distribution (at the sampling
    temperature) conditioned on the language, the more exactly the more particles.
    `output`: "sample" returns one particle drawn in proportion to its weight, "weighted" every
    particle with its normalized weight. `end_of_text`: True weighs each particle by the model's
    probability of ending the text where the language ends too (the target is the model's whole
    output conditioned on being a string of the language; one more step per particle); False ends
    a particle where its grammar ends, as weft's constrained outputs do (the target is then the
    model's output up to that point: right for a base model whose text goes on after it)."""

    num_particles: int = attrs.field(default=16, validator=_int_at_least(1))
    ess_threshold: float = attrs.field(
        default=0.5, converter=_float, validator=_number(lambda t: 0.0 <= t <= 1.0, "must be in [0, 1]")
    )
    resampling: Resampling = attrs.field(default=Resampling.SYSTEMATIC, converter=_resampling)
    output: SMCOutput = attrs.field(default=SMCOutput.SAMPLE, converter=_smc_output)
    end_of_text: bool = attrs.field(default=True, validator=_FLAG)


def _smc(value: SMCParams | dict[str, Any] | None) -> SMCParams | None:
    """`smc` as an `SMCParams` or a dict of its fields (an unknown key is an error naming it)."""
    if not isinstance(value, dict):
        return value
    known = [a.name for a in attrs.fields(SMCParams)]
    unknown = [key for key in value if key not in known]
    if unknown:
        raise ParamError("", "smc", f"has no field {unknown[0]!r}; it takes {', '.join(known)}")
    return SMCParams(**value)


def _structured(rules: OutputRules) -> StructuredSpec | None:
    return structured_spec(
        rules.json_schema,
        rules.json_object,
        rules.regex,
        rules.grammar,
        rules.grammar_syntax,
        rules.choice,
        owner=type(rules).__name__,
        json_schema_mode=rules.json_schema_mode,
    )


@attrs.frozen(kw_only=True)
class OutputRules:
    """What ends a completion and what it may contain: the fields `SamplingParams` and
    `BeamSearchParams` share. `structured` is the one output constraint, normalised.

    `json_schema_mode`: "closed" (default) closes the objects of `json_schema` that do not say
    `additionalProperties` (no keys beyond their `properties`), "strict" is OpenAI's strict mode
    (every object closed, every property required), "open" keeps JSON Schema's meaning."""

    ignore_eos: bool = attrs.field(default=False, validator=_FLAG)
    stop: tuple[str, ...] = attrs.field(
        default=None,
        converter=_strings,
        validator=_each(_text, "entries must be non-empty strings of valid Unicode"),
    )
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=None,
        converter=_token_ids,
        validator=_each(lambda t: _is_int(t) and 0 <= t <= SEED_MAX, "entries must be integers >= 0"),
    )
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_FLAG)
    skip_special_tokens: bool = attrs.field(default=True, validator=_FLAG)
    json_schema: Any = None
    json_object: bool = attrs.field(default=False, validator=_FLAG)
    regex: str | None = None
    grammar: str | None = None
    grammar_syntax: GrammarSyntax = attrs.field(default=GrammarSyntax.AUTO, converter=_grammar_syntax)
    choice: Sequence[str] | None = None
    # what a json_schema's objects may hold beyond their properties (weft/schema_objects.py)
    json_schema_mode: JsonSchemaMode = attrs.field(default=JsonSchemaMode.CLOSED, converter=_json_schema_mode)
    structured: StructuredSpec | None = attrs.field(
        init=False, repr=False, default=attrs.Factory(_structured, takes_self=True)
    )


@attrs.frozen
class SamplingParams(OutputRules):
    """How to sample one request. Every field is checked here; a bad value raises `ValueError`
    that names the field.

    `temperature=0` is greedy decoding. `top_k=0` (or -1) and `top_p=1` disable those filters.
    `seed` makes a request reproducible whatever else runs in the same batch. `best_of=m` samples
    m completions sharing the prompt and returns the `n` with the highest cumulative logprob.
    `stop` and `stop_token_ids` take one value or a list; they are stored as tuples.
    """

    n: int = attrs.field(default=1, validator=_int_at_least(1))
    best_of: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    temperature: float = attrs.field(
        default=1.0,
        converter=_float,
        validator=_number(lambda t: t >= 0.0, "must be a finite number >= 0 (0 means greedy)"),
    )
    top_p: float = attrs.field(
        default=1.0, converter=_float, validator=_number(lambda p: 0.0 < p <= 1.0, "must be in (0, 1]")
    )
    top_k: int = attrs.field(
        default=0,
        converter=_top_k,
        validator=_rule(lambda k: _is_int(k) and k >= 0, "must be -1 or 0 (disabled) or a positive count"),
    )
    min_p: float = attrs.field(
        default=0.0, converter=_float, validator=_number(lambda p: 0.0 <= p <= 1.0, "must be in [0, 1]")
    )
    repetition_penalty: float = attrs.field(
        default=1.0, converter=_float, validator=_number(lambda p: p > 0.0, "must be a finite number > 0")
    )
    presence_penalty: float = attrs.field(
        default=0.0, converter=_float, validator=_number(lambda p: -2.0 <= p <= 2.0, "must be in [-2, 2]")
    )
    frequency_penalty: float = attrs.field(
        default=0.0, converter=_float, validator=_number(lambda p: -2.0 <= p <= 2.0, "must be in [-2, 2]")
    )
    seed: int | None = None  # checked with best_of in __attrs_post_init__
    max_tokens: int | None = attrs.field(default=16, validator=_int_at_least(1, optional=True))
    min_tokens: int = attrs.field(default=0, validator=_int_at_least(0))
    logprobs: int | None = attrs.field(default=None, validator=_int_at_least(0, optional=True))
    logprobs_mode: LogprobsMode = attrs.field(default=LogprobsMode.RAW, converter=_logprobs_mode)
    prompt_logprobs: int | None = attrs.field(default=None, validator=_int_at_least(0, optional=True))
    output_kind: OutputKind = attrs.field(default=OutputKind.CUMULATIVE, converter=_output_kind)
    logits_processors: tuple[LogitsProcessor, ...] = attrs.field(
        default=(),
        converter=_processors,
        validator=_each(callable, "entries must be callables (token_ids, logits) -> logits"),
    )
    choice_selection: ChoiceSelection = attrs.field(
        default=ChoiceSelection.GREEDY, converter=_choice_selection
    )
    fast_forward: bool = attrs.field(default=True, validator=_FLAG)
    # False: this request never drafts, even where the engine speculates (`speculative_config`)
    speculative: bool = attrs.field(default=True, validator=_FLAG)
    # Sequential Monte Carlo over `num_particles` particles (`SMCParams`); needs a constraint
    smc: SMCParams | None = attrs.field(
        default=None,
        converter=_smc,
        validator=_rule(
            lambda v: v is None or isinstance(v, SMCParams), "must be None, an SMCParams or a dict"
        ),
    )

    def __attrs_post_init__(self) -> None:
        """The rules that tie two fields together."""
        owner = "SamplingParams"
        _check(
            self.best_of is None or self.best_of >= self.n,
            owner,
            "best_of",
            self.best_of,
            f"must be None or an integer >= n ({self.n})",
        )
        _check(
            self.seed is None
            or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX - self.num_samples),
            owner,
            "seed",
            self.seed,
            f"must be None or an integer in [{SEED_MIN}, {SEED_MAX} - best_of]",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            owner,
            "min_tokens",
            self.min_tokens,
            f"must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            self.choice_selection == ChoiceSelection.GREEDY or self.choice is not None,
            owner,
            "choice_selection",
            self.choice_selection.value,
            "'exact' needs a `choice` list to select from",
        )
        if self.smc is not None:
            _check_smc(self)

    @property
    def num_samples(self) -> int:
        """How many sequences the request runs: `best_of`, or `n`."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def exact_choice(self) -> bool:
        return self.choice_selection == ChoiceSelection.EXACT

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        return attrs.evolve(self, **changes)


def _check_smc(params: SamplingParams) -> None:
    """What SMC needs: a constraint to weigh against, and a proposal that is the masked model at the
    sampling temperature (whatever else changes the distribution it could not weigh)."""
    owner = "SamplingParams"
    _check(
        params.structured is not None and not params.exact_choice,
        owner,
        "smc",
        "no constraint",
        "needs an output constraint (json_schema, json_object, regex, grammar or choice) to weigh against",
    )
    _check(params.temperature > 0.0, owner, "temperature", 0.0, "must be > 0 with smc (particles sample)")
    unweighable = {
        "best_of": params.best_of is not None,
        "top_k": params.top_k != 0,
        "top_p": params.top_p != 1.0,
        "min_p": params.min_p != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "logits_processors": bool(params.logits_processors),
        "min_tokens": params.min_tokens != 0,
        "stop": bool(params.stop),
        "stop_token_ids": bool(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
    }
    for name, given in unweighable.items():
        _check(
            not given,
            owner,
            name,
            getattr(params, name),
            "cannot be used with smc: particles are weighed against the model's distribution at the "
            "temperature, under the constraint alone, and end at its end (leave it unset)",
        )
    _check(
        params.logprobs_mode == LogprobsMode.RAW,
        owner,
        "logprobs_mode",
        params.logprobs_mode.value,
        "must be 'raw' with smc (its logprobs are the model's at the sampling temperature)",
    )


FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@attrs.frozen
class BeamSearchParams(OutputRules):
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

    beam_width: int = attrs.field(validator=_int_at_least(1))
    max_tokens: int = attrs.field(default=16, validator=_int_at_least(1))
    length_penalty: float = attrs.field(
        default=1.0, converter=_float, validator=_number(lambda _: True, "must be a finite number")
    )
    early_stopping: bool | str = attrs.field(
        default=False,
        validator=_rule(lambda v: v in (True, False, "never"), "must be True, False or 'never'"),
    )

    def sampling_params(self, num_candidates: int) -> SamplingParams:
        """The parameters of each beam: greedy, with the top `num_candidates` logprobs of the tokens
        it may take (MASKED: the model's logprobs where the constraint allows), every token sampled
        (no fast-forward: a forced token's logprob counts in the score too)."""
        shared = {a.name: getattr(self, a.name) for a in attrs.fields(OutputRules) if a.init}
        return SamplingParams(
            **shared,
            temperature=0.0,
            max_tokens=self.max_tokens,
            logprobs=num_candidates,
            logprobs_mode=LogprobsMode.MASKED,
            output_kind=OutputKind.FINAL_ONLY,
            fast_forward=False,
        )
