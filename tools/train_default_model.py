"""Train weft's bundled default model: a small Llama on Tiny Shakespeare, on CPU.

Steps, in order:
  1. read the corpus and split it: the first 90% trains, the last 10% validates;
  2. train a byte-level BPE tokenizer (the `tokenizers` library) on the training text;
  3. train a small `LlamaForCausalLM` (Hugging Face `transformers`) with AdamW and a cosine
     schedule, seeded, evaluating on the held-out text as it goes;
  4. save a standard checkpoint directory in float16 (config.json, model.safetensors,
     tokenizer.json, tokenizer_config.json with a chat template, generation_config.json)
     and a `training.json` report (validation loss and perplexity, time, sizes).

The shipped model, which copies from its prompt, comes from two runs (about an hour on 2 CPU
cores): a model of `--shape 8,192,6,3,512` from scratch with copy rows, then long copy spans from
that checkpoint, saved with `--store-kv-heads 6`. The commands are in docs/default_model.md,
"Reproduce". Without options the script trains the model shipped before it (4 layers of 256,
Shakespeare alone, about 20 minutes):

    python tools/train_default_model.py --out /tmp/plain

The copying experiments of docs/default_model.md run from the checkpoint before them (`--init`).
`--init` starts from a checkpoint's tokenizer and weights. The final report adds the loss of a
span's second showing (`second_showing_losses`) and the characters for which greedy continuations
follow a held-out passage (`copied_characters`). `--copy-corpus` repeats passages of another text
in the copy rows (read, never predicted, on their first showing), and `--induction-short-steps`
draws short induction spans first.

`transformers` is needed here (it is a test/dev dependency of weft), never at run time.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CORPUS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "corpora" / "tinyshakespeare.txt"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass
class TrainConfig:
    seed: int = 1234
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    seq_len: int = 256
    batch_size: int = 24
    max_steps: int = 700
    lr: float = 2e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 20
    # The copying experiment (docs/default_model.md; off for the shipped model): a share of rows
    # that need copying from the context (`CopyTasks`), and each step, beside the batch, short rows
    # of random tokens repeated (`CopyTasks.induction`), the plainest copying signal
    copy_share: float = 0.0
    induction_rows: int = 0
    induction_len: int = 64
    induction_span: int = 20  # the repeated random spans are 6 to this many tokens long (exclusive)
    # if > 0: half the induction rows draw their tokens from a random alphabet of this to 8 times
    # this many tokens, so that a token recurs within its span and only the tokens before it say
    # where the copy goes on (a one-token match loops back; what greedy copies of text did)
    induction_alphabet: int = 0
    # share of each copy passage's words replaced by random ones, so that memory of the training
    # text cannot predict its second showing: only copying can
    word_swap: float = 0.0
    word_swap_min: float | None = None  # if set, each passage's swap rate is drawn from [this, word_swap]
    passage_share: float = 0.5  # of the copy rows, the share of passages (the rest: records)
    # of the record rows, the share of word lists instead (`words: a b c` then `["a", "b", "c"]`):
    # many words each a row, each tokenized after a space in the line and after a quote in the JSON
    list_share: float = 0.0
    # of the passages, the share drawn from `copy_corpus` (another text, never trained on as
    # language: only the second showing of its passages counts in the loss), natural text that
    # memory of the training text cannot predict
    copy_corpus: str | None = None
    copy_corpus_share: float = 0.0
    # the first this many steps draw induction spans of 6-19 tokens (the copying heads form on
    # short spans first), the later ones spans up to `induction_span`
    induction_short_steps: int = 0
    # start from this checkpoint (its tokenizer and weights) instead of from scratch
    init: str | None = None
    # which checkpoint is kept: "val" the best held-out loss; "copy" the best held-out copy rate
    # among those whose held-out loss is within `max_val_rise` of the starting checkpoint's
    select: str = "val"
    max_val_rise: float = 0.04


def train_tokenizer(text: str, vocab_size: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text[i : i + 10_000] for i in range(0, len(text), 10_000)], trainer)
    return tok


def build_model(cfg: TrainConfig):  # -> transformers.LlamaForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def batches(
    data: torch.Tensor, cfg: TrainConfig, gen: torch.Generator, copies: CopyTasks | None = None
) -> torch.Tensor:
    """[B, S+1] training rows: windows of the text, and a `copy_share` of rows that copy. A row's
    tokens marked `IGNORED` (below 0) are read as `tokens[i] + IGNORED` and not predicted."""
    num_copy = round(cfg.batch_size * cfg.copy_share) if copies is not None else 0
    starts = torch.randint(0, data.numel() - cfg.seq_len - 1, (cfg.batch_size - num_copy,), generator=gen)
    rows = [data[s : s + cfg.seq_len + 1] for s in starts.tolist()]
    if copies is not None:
        rows += [copies.row(cfg.seq_len + 1, gen) for _ in range(num_copy)]
    return torch.stack(rows)


IGNORED = -(1 << 20)  # added to a token that is read but not predicted (see `batches`)


class CopyTasks:
    """Training rows that can only be predicted by copying from earlier in the row, so that the
    model learns to continue a passage it has just been shown and to put a record's facts into
    JSON (what speculative decoding and extraction under a schema need), half of each:
      - a passage of the text, a blank line, and the same passage again (repeated to fill the row);
      - records (`name: ...`, `age: ...`, `home: ...`) each followed by the same facts as JSON in
        weft's style (`{"name": "...", "age": 7, "home": "..."}`), the names the text's speakers;
    and, in a batch of their own each step, short rows of random tokens repeated (`induction`)."""

    def __init__(
        self,
        data: torch.Tensor,
        text: str,
        tok,  # tokenizers.Tokenizer
        word_swap: float = 0.0,
        passages: float = 0.5,
        word_swap_min: float | None = None,
        other: str | None = None,
        other_share: float = 0.0,
        lists: float = 0.0,
    ) -> None:
        self.data, self.text, self.tok, self.word_swap, self.passages = data, text, tok, word_swap, passages
        self.lists = lists
        self.other, self.other_share = other, other_share
        self.word_swap_min = word_swap if word_swap_min is None else word_swap_min
        self.vocab_size = tok.get_vocab_size()
        self.separator = torch.tensor(tok.encode("\n\n").ids, dtype=torch.long)
        self.names = sorted(set(re.findall(r"^([A-Z][A-Za-z ]+):$", text, flags=re.MULTILINE)))
        self.words = sorted({w for w in re.findall(r"\b[a-z]{4,9}\b", text)})
        self.single_names = [name.title() for name in self.names if " " not in name]  # for word lists

    def row(self, length: int, gen: torch.Generator) -> torch.Tensor:
        if torch.rand((), generator=gen).item() < self.passages:
            return self._passage(length, gen)[:length]
        make = self._word_lists if torch.rand((), generator=gen).item() < self.lists else self._records
        return make(length, gen)[:length]

    def induction(
        self, num_rows: int, length: int, gen: torch.Generator, longest: int = 20, alphabet: int = 0
    ) -> torch.Tensor:
        """[num_rows, length] rows of random tokens (6-19 of them), a blank line, the same tokens
        again, and so on: nothing but copying predicts them. Without these, 1,000 steps of the
        other rows taught the model the records' JSON layout but not to copy a single value;
        with them the copying heads form after ~450 steps (measured: the loss of such rows falls
        from 8.3 to the floor of their first, unpredictable tokens). `alphabet` > 0: the odd rows'
        tokens come from a random alphabet of `alphabet` to 8 * `alphabet` tokens."""
        rows = []
        for i in range(num_rows):
            span = int(torch.randint(6, longest, (), generator=gen))
            tokens = torch.randint(len(SPECIAL_TOKENS), self.vocab_size, (span,), generator=gen)
            if alphabet > 0 and i % 2 == 1:
                size = int(torch.randint(alphabet, 8 * alphabet + 1, (), generator=gen))
                letters = torch.randperm(self.vocab_size - len(SPECIAL_TOKENS), generator=gen)[:size]
                tokens = letters[torch.randint(size, (span,), generator=gen)] + len(SPECIAL_TOKENS)
            rows.append(self._repeated(tokens, tokens, length)[:length])
        return torch.stack(rows)

    def _passage(self, length: int, gen: torch.Generator) -> torch.Tensor:
        if self.other is not None and torch.rand((), generator=gen).item() < self.other_share:
            return self._other_passage(length, gen)
        if self.word_swap > 0:
            passage = self._swapped_passage(gen)
        else:
            span = int(torch.randint(24, 120, (), generator=gen))
            start = int(torch.randint(0, self.data.numel() - span, (), generator=gen))
            passage = self.data[start : start + span]
        return self._repeated(passage, passage, length)

    def _repeated(self, first: torch.Tensor, passage: torch.Tensor, length: int) -> torch.Tensor:
        """`first`, then `passage` again after a blank line, as often as it takes to reach `length`
        tokens (`first` is `passage` itself, or marked to be read and not predicted)."""
        pieces, total = [first], first.numel()
        while total < length:
            pieces += [self.separator, passage]
            total += self.separator.numel() + passage.numel()
        return torch.cat(pieces)

    def _other_passage(self, length: int, gen: torch.Generator) -> torch.Tensor:
        """A passage of the other corpus from a line's start, shown again and again; its first
        showing is read, not predicted (marked `IGNORED`): the model learns to copy that text, not
        to write it."""
        assert self.other is not None
        span = int(torch.randint(100, 500, (), generator=gen))
        start = int(torch.randint(0, len(self.other) - span, (), generator=gen))
        start = self.other.find("\n", start) + 1
        passage = torch.tensor(self.tok.encode(self.other[start : start + span]).ids, dtype=torch.long)
        return self._repeated(passage + IGNORED, passage, length)

    def _swapped_passage(self, gen: torch.Generator) -> torch.Tensor:
        """A passage of the text from a line's start, `word_swap` of its words replaced by random
        words of the text (capitalised where the word was): text the model has not memorised."""
        span = int(torch.randint(100, 500, (), generator=gen))
        start = int(torch.randint(0, len(self.text) - span, (), generator=gen))
        start = self.text.find("\n", start) + 1
        passage = self.text[start : start + span]
        low = self.word_swap_min
        rate = low + (self.word_swap - low) * torch.rand((), generator=gen).item()
        draws = torch.rand(len(passage), generator=gen).tolist()
        picks = torch.randint(len(self.words), (len(passage),), generator=gen).tolist()

        def swap(match: re.Match) -> str:
            i = match.start()
            if draws[i] >= rate or match.group(0).isupper():  # speakers' names stay
                return match.group(0)
            word = self.words[picks[i]]
            return word.title() if match.group(0)[0].isupper() else word

        return torch.tensor(self.tok.encode(re.sub(r"[A-Za-z]+", swap, passage)).ids, dtype=torch.long)

    def _word_lists(self, length: int, gen: torch.Generator) -> torch.Tensor:
        """Lines of 3-8 words (the speakers' names and words of the text), each followed by the same
        words as a JSON list: a word after a space in the line is other tokens than the same word
        after a quote, the mapping a record's values need on their way into JSON, many times a row."""
        ids: list[int] = []
        while len(ids) < length:
            count = int(torch.randint(3, 9, (), generator=gen))
            words = []
            for _ in range(count):
                pool = self.single_names if torch.rand((), generator=gen).item() < 0.5 else self.words
                words.append(pool[int(torch.randint(len(pool), (), generator=gen))])
            ids += self.tok.encode("words: " + " ".join(words) + "\n" + json.dumps(words) + "\n\n").ids
        return torch.tensor(ids, dtype=torch.long)

    def _records(self, length: int, gen: torch.Generator) -> torch.Tensor:
        ids: list[int] = []
        while len(ids) < length:
            name = self.names[int(torch.randint(len(self.names), (), generator=gen))].title()
            if self.word_swap > 0 and torch.rand((), generator=gen).item() < 0.5:
                name = self.words[int(torch.randint(len(self.words), (), generator=gen))].title()
            home = self.words[int(torch.randint(len(self.words), (), generator=gen))]
            age = int(torch.randint(1, 100, (), generator=gen))
            record = f"name: {name}\nage: {age}\nhome: {home}\n"
            record += json.dumps({"name": name, "age": age, "home": home}) + "\n\n"
            ids += self.tok.encode(record).ids
        return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def passage_continuations(model, tok, text: str, num: int, new_tokens: int) -> list[tuple[str, str]]:
    """For `num` held-out passages, each shown, then a blank line and its first lines again (cut at
    a line's end, so that the tokens at the cut are the passage's own): the greedy continuation of
    `new_tokens` tokens, and the rest of the passage that a copy would write."""
    model.eval()
    pairs = []
    for i in range(num):
        passage = text[i * 2000 : i * 2000 + 300]
        shown = passage.index("\n", 60) + 1
        prompt = tok.encode(passage + "\n\n" + passage[:shown]).ids
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        pairs.append((tok.decode(out[0, len(prompt) :].tolist()), passage[shown:]))
    model.train()
    return pairs


def copy_rate(model, tok, text: str, num: int = 40, new_tokens: int = 24) -> float:
    """The share of held-out passages whose greedy continuation follows the passage for
    `new_tokens` tokens (`passage_continuations`)."""
    pairs = passage_continuations(model, tok, text, num, new_tokens)
    return sum(bool(tail) and rest.startswith(tail) for tail, rest in pairs) / num


def copied_characters(model, tok, text: str, num: int = 40, new_tokens: int = 64) -> float:
    """The mean number of characters for which the greedy continuation follows the passage before
    it first leaves it: a finer probe than whole 24-token copies (a model that does not copy scores
    about 1, one that copies every passage about 230)."""
    matched = 0
    for tail, rest in passage_continuations(model, tok, text, num, new_tokens):
        same = [a == b for a, b in zip(tail, rest, strict=False)]
        matched += same.index(False) if False in same else len(same)
    return matched / num


@torch.no_grad()
def second_showing_losses(model, tok, text: str, separator: list[int]) -> dict[str, float]:
    """Mean next-token loss over the second showing of a span shown twice (a blank line between):
    random tokens 10, 20, 40 and 80 long (how far back the copying reaches), and held-out passages
    of about 75 tokens (whether it copies text like its corpus), with the first showing's loss
    beside them. A model that copies gets near 0 on every second showing."""
    model.eval()
    gen = torch.Generator().manual_seed(3)
    spans = {
        f"random_{n}": torch.randint(len(SPECIAL_TOKENS), tok.get_vocab_size(), (n,), generator=gen)
        for n in (10, 20, 40, 80)
    }
    spans["heldout"] = torch.tensor(tok.encode(text[5000:5300]).ids)
    losses = {}
    for name, span in spans.items():
        row = torch.cat([span, torch.tensor(separator), span])
        logits = model(input_ids=row[None, :-1]).logits[0]  # [S, V]
        each = torch.nn.functional.cross_entropy(logits.float(), row[1:], reduction="none")  # [S]
        losses[name] = round(each[span.numel() + len(separator) :].mean().item(), 3)
        if name == "heldout":
            losses["heldout_first"] = round(each[: span.numel() - 1].mean().item(), 3)
    model.train()
    return losses


def next_token_loss(model, rows: torch.Tensor) -> torch.Tensor:
    ignored = rows < 0  # [B, S+1]: read, not predicted
    tokens = torch.where(ignored, rows - IGNORED, rows)
    targets = tokens[:, 1:].masked_fill(ignored[:, 1:], -100)  # cross_entropy's ignore_index
    logits = model(input_ids=tokens[:, :-1]).logits  # [B, S, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig) -> float:
    """Mean next-token loss over non-overlapping windows of the held-out text."""
    model.eval()
    num_windows = min(cfg.eval_batches * cfg.batch_size, (data.numel() - 1) // cfg.seq_len)
    windows = data[: num_windows * cfg.seq_len + 1]
    total, count = 0.0, 0
    for i in range(0, num_windows, cfg.batch_size):
        idx = torch.arange(i, min(i + cfg.batch_size, num_windows))
        rows = torch.stack([windows[j * cfg.seq_len : (j + 1) * cfg.seq_len + 1] for j in idx.tolist()])
        total += next_token_loss(model, rows).item() * rows.shape[0]
        count += rows.shape[0]
    model.train()
    return total / count


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def store_kv_heads(model, num_kv_heads: int) -> None:
    """Give `model` `num_kv_heads` KV heads (a multiple of its own) computing exactly what it
    computes: each KV head repeated for the query heads that share it, so that the heads divide
    over more tensor-parallel ranks (3 KV heads do not split over 2)."""
    config = model.config
    old, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    if num_kv_heads % old or config.num_attention_heads % num_kv_heads:
        raise SystemExit(
            f"--store-kv-heads {num_kv_heads}: give a multiple of the model's {old} KV heads that "
            f"divides its {config.num_attention_heads} query heads"
        )
    repeat = num_kv_heads // old
    for layer in model.model.layers:
        for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            weight = proj.weight.data.view(old, head_dim, -1)  # [kv, head_dim, hidden]
            widened = weight.repeat_interleave(repeat, dim=0).reshape(num_kv_heads * head_dim, -1)
            proj.weight = torch.nn.Parameter(widened)
            proj.out_features = widened.shape[0]
        layer.self_attn.num_key_value_groups = config.num_attention_heads // num_kv_heads
    config.num_key_value_heads = num_kv_heads


def save(model, tok, out: Path, report: dict) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0).save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")


def load_tokenizer(path: str):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def load_model(path: str):  # -> transformers.LlamaForCausalLM
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).train()


class Keeper:
    """Which checkpoint is kept: the best held-out loss (`select="val"`), or the best held-out copy
    rate whose held-out loss rose at most `max_val_rise` over the starting checkpoint's (ties: the
    lower loss)."""

    def __init__(self, cfg: TrainConfig, start_val_loss: float | None) -> None:
        self.select = cfg.select
        self.bound = math.inf if start_val_loss is None else start_val_loss * (1 + cfg.max_val_rise)
        self.key: tuple[float, float] | None = None
        self.state: dict[str, torch.Tensor] | None = None
        self.step, self.val_loss = 0, math.inf

    def offer(self, model, step: int, val_loss: float, rate: float | None) -> None:
        if val_loss > self.bound:
            return
        key = (rate or 0.0, -val_loss) if self.select == "copy" else (0.0, -val_loss)
        if self.key is None or key > self.key:
            self.key, self.step, self.val_loss = key, step, val_loss
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _shape(text: str) -> dict[str, int]:
    """--shape's LAYERS,HIDDEN,HEADS,KV_HEADS,MLP as TrainConfig fields."""
    names = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size")
    values = [int(v) for v in text.split(",")]
    if len(values) != len(names) or values[1] % values[2] or values[2] % values[3]:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: give LAYERS,HIDDEN,HEADS,KV_HEADS,MLP, HIDDEN a multiple of HEADS "
            "and HEADS of KV_HEADS (the default is 4,256,8,4,704; the shipped model was trained as "
            "8,192,6,3,512)"
        )
    return dict(zip(names, values, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("weft/default_model"))
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--max-steps", type=int, default=TrainConfig.max_steps)
    parser.add_argument(
        "--copy-share", type=float, default=TrainConfig.copy_share, help="share of rows that copy (0: none)"
    )
    parser.add_argument(
        "--induction-rows",
        type=int,
        default=TrainConfig.induction_rows,
        help="rows of repeated random tokens per step, beside the batch (0: none)",
    )
    parser.add_argument(
        "--word-swap",
        type=float,
        default=TrainConfig.word_swap,
        help="share of copy passages' words replaced",
    )
    parser.add_argument(
        "--init", default=None, help="start from this checkpoint directory (default: scratch)"
    )
    parser.add_argument(
        "--word-swap-min",
        type=float,
        default=None,
        help="draw each passage's swap rate from [this, --word-swap] (default: always --word-swap)",
    )
    parser.add_argument(
        "--passage-share", type=float, default=TrainConfig.passage_share, help="of the copy rows: passages"
    )
    parser.add_argument(
        "--list-share", type=float, default=TrainConfig.list_share, help="of the record rows: word lists"
    )
    parser.add_argument("--induction-len", type=int, default=TrainConfig.induction_len)
    parser.add_argument("--induction-span", type=int, default=TrainConfig.induction_span)
    parser.add_argument(
        "--induction-alphabet",
        type=int,
        default=TrainConfig.induction_alphabet,
        help="half the induction rows from an alphabet of this to 8x this many tokens (0: off)",
    )
    parser.add_argument(
        "--copy-corpus", default=None, help="another text whose passages copy rows repeat (never trained on)"
    )
    parser.add_argument(
        "--copy-corpus-share", type=float, default=0.0, help="of the copy passages: from --copy-corpus"
    )
    parser.add_argument(
        "--induction-short-steps", type=int, default=0, help="steps of 6-19-token induction spans first"
    )
    parser.add_argument("--eval-every", type=int, default=TrainConfig.eval_every)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--warmup-steps", type=int, default=TrainConfig.warmup_steps)
    parser.add_argument("--select", choices=["val", "copy"], default=TrainConfig.select)
    parser.add_argument(
        "--store-kv-heads",
        type=int,
        default=0,
        help="save with this many KV heads, each trained one repeated (same outputs; 0: as trained)",
    )
    parser.add_argument(
        "--shape",
        type=_shape,
        default=None,
        help="LAYERS,HIDDEN,HEADS,KV_HEADS,MLP of a model from scratch (default: 4,256,8,4,704)",
    )
    args = parser.parse_args()
    cfg = TrainConfig(
        max_steps=args.max_steps,
        copy_share=args.copy_share,
        induction_rows=args.induction_rows,
        induction_len=args.induction_len,
        induction_span=args.induction_span,
        induction_alphabet=args.induction_alphabet,
        word_swap=args.word_swap,
        word_swap_min=args.word_swap_min,
        passage_share=args.passage_share,
        list_share=args.list_share,
        copy_corpus=args.copy_corpus,
        copy_corpus_share=args.copy_corpus_share,
        induction_short_steps=args.induction_short_steps,
        eval_every=args.eval_every,
        init=args.init,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        select=args.select,
        **(args.shape or {}),
    )
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()

    text = args.corpus.read_text(encoding="utf-8")
    split = int(len(text) * 0.9)
    tok = load_tokenizer(cfg.init) if cfg.init else train_tokenizer(text[:split], cfg.vocab_size)
    cfg.vocab_size = tok.get_vocab_size()
    train_ids = torch.tensor(tok.encode(text[:split]).ids, dtype=torch.long)
    val_ids = torch.tensor(tok.encode(text[split:]).ids, dtype=torch.long)
    print(f"corpus {len(text):,} chars; train {train_ids.numel():,} tokens, val {val_ids.numel():,} tokens")

    model = load_model(cfg.init) if cfg.init else build_model(cfg)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model: {num_params / 1e6:.2f}M parameters")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    copies = (
        CopyTasks(
            train_ids,
            text[:split],
            tok,
            cfg.word_swap,
            cfg.passage_share,
            cfg.word_swap_min,
            Path(cfg.copy_corpus).read_text(encoding="utf-8") if cfg.copy_corpus else None,
            cfg.copy_corpus_share,
            cfg.list_share,
        )
        if cfg.copy_share > 0
        else None
    )
    untrained_val_loss = evaluate(model, val_ids, cfg)
    print(f"{'starting' if cfg.init else 'untrained'} val loss {untrained_val_loss:.3f}")
    keep = Keeper(cfg, untrained_val_loss if cfg.init else None)
    history = []
    for step in range(cfg.max_steps):
        for group in optim.param_groups:
            group["lr"] = lr_at(step, cfg)
        rows = batches(train_ids, cfg, gen, copies)
        loss = next_token_loss(model, rows)
        if copies is not None and cfg.induction_rows:
            longest = 20 if step < cfg.induction_short_steps else cfg.induction_span
            repeats = copies.induction(
                cfg.induction_rows, cfg.induction_len + 1, gen, longest, cfg.induction_alphabet
            )
            loss = loss + next_token_loss(model, repeats)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.max_steps:
            val_loss = evaluate(model, val_ids, cfg)
            rate = copy_rate(model, tok, text[split:]) if cfg.select == "copy" else None
            history.append(
                {"step": step + 1, "train_loss": loss.item(), "val_loss": val_loss, "copy_rate": rate}
            )
            keep.offer(model, step + 1, val_loss, rate)
            elapsed = time.perf_counter() - started
            shown = "" if rate is None else f" copy {rate:.0%}"
            print(
                f"step {step + 1}/{cfg.max_steps} train {loss.item():.3f} val {val_loss:.3f}{shown} "
                f"({elapsed:.0f}s)",
                flush=True,
            )
    assert keep.state is not None, "no checkpoint met the selection rule: see the printed history"
    model.load_state_dict(keep.state)
    val_loss, best_step = keep.val_loss, keep.step
    held_out_copy_rate = copy_rate(model, tok, text[split:])
    print(f"held-out passages continued as shown: {held_out_copy_rate:.0%}")
    copied_chars = copied_characters(model, tok, text[split:])
    print(f"characters of a held-out passage followed before leaving it, mean: {copied_chars:.1f}")
    second_showing = second_showing_losses(model, tok, text[split:], tok.encode("\n\n").ids)
    print(f"loss of a second showing: {second_showing}")
    report = {
        "config": asdict(cfg),
        "corpus": args.corpus.name,
        "num_parameters": num_params,
        "train_tokens": train_ids.numel(),
        "val_tokens": val_ids.numel(),
        "untrained_val_loss": untrained_val_loss,
        "val_loss": val_loss,
        "best_step": best_step,
        "val_perplexity": math.exp(val_loss),
        "held_out_copy_rate": held_out_copy_rate,
        "held_out_copied_characters": round(copied_chars, 1),
        "second_showing_loss": second_showing,
        "train_seconds": round(time.perf_counter() - started, 1),
        "torch_threads": torch.get_num_threads(),
        "history": history,
    }
    if args.store_kv_heads:
        store_kv_heads(model, args.store_kv_heads)
        report["stored_kv_heads"] = args.store_kv_heads
    save(model, tok, args.out, report)
    print(json.dumps({k: v for k, v in report.items() if k != "history"}, indent=2))


if __name__ == "__main__":
    main()
