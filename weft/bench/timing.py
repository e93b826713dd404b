"""One timed run of a batch, as every throughput benchmark reports it (weft's and its references')."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Timing:
    prefill_s: float
    total_s: float
    kv_bytes: int | None = None  # the KV memory the run used: weft's blocks held at most, llama.cpp's cache
    kv_decode_bytes: int | None = None  # weft's blocks held at most once every prompt was in

    def prefill_tps(self, batch: int, prompt_len: int) -> float:
        return batch * prompt_len / self.prefill_s

    def decode_tps(self, batch: int, output_len: int) -> float:
        return batch * (output_len - 1) / max(self.total_s - self.prefill_s, 1e-9)

    @staticmethod
    def best(runs: list[Timing]) -> Timing:
        """The fastest prefill and the fastest decode (total - prefill) of several runs."""
        prefill = min(r.prefill_s for r in runs)
        kv_bytes = max((r.kv_bytes for r in runs if r.kv_bytes is not None), default=None)
        decode = max((r.kv_decode_bytes for r in runs if r.kv_decode_bytes is not None), default=None)
        return Timing(prefill, prefill + min(r.total_s - r.prefill_s for r in runs), kv_bytes, decode)

    @staticmethod
    def paired_decode_ratios(
        ours: list[Timing], theirs: list[Timing], batch: int, output_len: int
    ) -> list[float]:
        """Each of our runs' decode tokens/s over that of the run of theirs right after it: on a machine
        whose memory speed moves from second to second, a pair's two runs share one speed more often
        than the best of each engine's runs do."""
        pairs = zip(ours, theirs, strict=True)
        return [o.decode_tps(batch, output_len) / t.decode_tps(batch, output_len) for o, t in pairs]
