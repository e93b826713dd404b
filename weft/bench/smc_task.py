"""SMC tasks with an exact answer: a choice of options after a prompt.

`exact_choice_distributions` computes, by teacher forcing every tokenization the choice grammar
allows, the model's own distribution over the options conditioned on the language (each option
weighed as SMC weighs it with `end_of_text=False`: its tokens' probability, ending where the
grammar ends) and the distribution masking alone samples. The tests (tests/test_smc.py) and
`weft bench parallel` compare SMC against both, on the bundled model (`BUNDLED_TASK`) and on the
default model (`DEFAULT_TASK`, a chat turn whose options start like answers the model prefers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

NAMES = ["ROMEO", "JULIET", "KING HENRY", "QUEEN MARGARET", "FIRST CITIZEN", "ROXQ", "KIZZ", "JUXX"]
PROMPT = "\n\n"


@dataclass(frozen=True)
class ChoiceTask:
    name: str
    prompt: str  # the text before the choice; with `chat`, the user's turn
    options: list[str]
    chat: bool = False  # the prompt is a user turn of the model's chat template

    def prompt_ids(self, llm: Any) -> list[int]:
        """The prompt's token ids, as `llm` encodes them."""
        if self.chat:
            return llm.render_chat([{"role": "user", "content": self.prompt}])
        return llm.tokenizer.encode(self.prompt)


BUNDLED_TASK = ChoiceTask("bundled model: a name after a blank line", PROMPT, NAMES)
# Two options open with the model's favourite first words ("Blue", "Yellow") and end in ones it
# would not write: masking takes them as often as the first words (TV 0.41 to the target).
DEFAULT_TASK = ChoiceTask(
    "default model: 'Name a color.'",
    "Name a color.",
    ["Blue whale", "Red", "Green", "Yellow submarine"],
    True,
)


def load_reference(path: Path) -> Any:
    """transformers' float32 model of a checkpoint directory or a GGUF file (dequantized)."""
    import torch
    import transformers

    if path.is_file():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def exact_choice_distributions(
    path: Path, prompt: str | list[int], options: list[str], cut: float = 1e-10, tokenizer: Any = None
) -> tuple[dict[str, float], dict[str, float], float]:
    """(target, masking, log of the language's probability) over `options` after `prompt` (text,
    or token ids), the model (transformers, float32 logits, float64 log-softmax; `load_reference`)
    teacher-forced over every token path the grammar allows, one batched forward per depth.
    Branches below `cut` under both the model and masking are dropped (their mass bounds the
    error). `tokenizer`: weft's, where `path` is a GGUF file (else the checkpoint's own)."""
    import torch

    from weft.params import structured_spec
    from weft.structured.llguidance_backend import LLGuidanceBackend
    from weft.tokenizer import Tokenizer

    tok = tokenizer if tokenizer is not None else Tokenizer.from_dir(path)
    model = load_reference(path)
    vocab = model.config.vocab_size
    backend = LLGuidanceBackend(tok.tokenizer.to_str(), vocab, [0])
    spec = structured_spec(choice=options)
    assert spec is not None
    root = backend.new_matcher(backend.compile(spec))
    frontier: list[tuple[list[int], Any, float, float]] = [([], root, 0.0, 0.0)]
    prompt_ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    model_mass: dict[str, float] = {}
    masking_mass: dict[str, float] = {}
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    while frontier:
        with torch.no_grad():
            batch = torch.tensor([prompt_ids + tokens for tokens, *_ in frontier])
            logp = torch.log_softmax(model(batch).logits[:, -1].double(), dim=-1)  # [F, V]
        grown = []
        for (tokens, matcher, lp, lm), row in zip(frontier, logp, strict=True):
            if matcher.is_finished:
                text = tok.decode(tokens)
                model_mass[text] = model_mass.get(text, 0.0) + math.exp(lp)
                masking_mass[text] = masking_mass.get(text, 0.0) + math.exp(lm)
                continue
            bitmask.zero_()
            backend.fill_bitmask([(matcher, 0, [])], bitmask)
            allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
            mass = torch.logsumexp(row[allowed], 0).item()
            for t in allowed:
                child_lp, child_lm = lp + row[t].item(), lm + row[t].item() - mass
                if child_lp < math.log(cut) and child_lm < math.log(cut):
                    continue
                child = matcher.fork()
                if child.consume([t]):
                    grown.append(([*tokens, t], child, child_lp, child_lm))
        frontier = grown
    total = sum(model_mass.values())
    return {k: v / total for k, v in model_mass.items()}, dict(masking_mass), math.log(total)


def pooled(outputs: list[Any]) -> tuple[dict[str, float], float]:
    """Independent SMC runs of weighted particles (RequestOutputs, one run each) pooled: each
    particle weighed by its normalized weight times its run's estimate of the language's
    probability (a run that found little counts little); and the log of the mean estimate."""
    mass: dict[str, float] = {}
    for out in outputs:
        assert out.smc is not None and len(out.smc) == 1
        for c in out.outputs:
            mass[c.text] = mass.get(c.text, 0.0) + math.exp(c.log_weight + out.smc[0].log_marginal)
    total = sum(mass.values())
    return {k: v / total for k, v in mass.items()}, math.log(total / len(outputs))


def total_variation(p: dict[str, float], q: dict[str, float]) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))
