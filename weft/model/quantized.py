"""Quantized matrices kept in their blocks (GGUF's Q8_0, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL and IQ4_XS) on their way from the file to the panels of weft's CPU kernels
(`weft/native/quant.cpp`; products in `qdot.cpp` with int8 activations, or exactly in `linear.cpp`).

A matrix arrives as `QuantizedRows`: its kind and its rows of blocks, uint8 [N, K / block *
block bytes], under its Hugging Face name. The loader fuses q/k/v and gate/up by concatenating rows
(`cat_rows`), checks shapes by the logical [N, K], and packs every one into panels before the
weights are assigned: dot panels (int8 tensors) for int8 products, or the exact panels (uint8) for
float32 ones (`pack(dot=...)`; Q4_0 and Q5_0 have dot panels of their own, and exact ones as Q8_0;
Q4_1 and Q5_1 have dot panels of their own, and for exact products are dequantized to float32).
Q2_K and Q3_K have dot panels of their own (3.1 and 3.6 bits a weight); IQ4_NL and IQ4_XS too (Q4_0's
blocks whose nibbles index the IQ4 levels; the IQ4_XS sub-block scales rounded to float16 on the
way, `REWRITTEN`), and MXFP4 (gpt-oss's experts: the same nibbles under E8M0 exponents, 4.25 bits a
weight as in the file). For exact products Q3_K goes into Q6_K's exact panels, IQ4_NL into Q8_0's
and MXFP4 into Q5_0's (and so Q8_0's), rewritten exactly (weft/native/rewrite.cpp); Q2_K and IQ4_XS
are dequantized.
A fusion whose parts differ in kind (Q4_K_M gives attn_v and ffn_down Q6_K in some layers, Q4_K
elsewhere) is `MixedRows`: the kernel sets that multiply blocks as they are (CUDA) take it whole,
and weft's CPU dot products take it in parts of one kind each, each in its kind's own dot panels
(`in_own_layouts`, a `PartedRows`: a Q5_K q|k beside a Q6_K v is 5.6 bits a weight there, 7.1 in
the Q6_K layout with mins that holds every k-quant, and its tile is faster); for exact products,
float32. Q4_0 and Q5_0 parts fused with Q8_0 ones (Q4_K_M's
fallbacks where the input features are not a multiple of 256) become Q8_0 blocks, exactly. Parts no
one layout holds (IQ4_XS files' q and k with a Q5_K v) are `PartedRows`: each part in its own dot
panels, one flat tensor that `Linear.parts` multiplies part by part. Nothing above `weft/model` sees
the formats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from weft.kernels import GGUF_BLOCKS, BlockPart, PanelPart
from weft.model.gguf_file import release_pages
from weft.model.layers import FileWeight
from weft.model.mxfp4 import mxfp4_as_q5_0

BLOCKS = GGUF_BLOCKS  # kind -> (input features per block, bytes per block in the file)
LEGACY = ("q4_0", "q5_0")  # blocks of 32 with their own dot panels, exact products as Q8_0
# Kinds no exact quantized panel holds (Q4_1 and Q5_1's d * q + m, Q5_K's fifth bits, Q2_K's mins
# per 16, IQ4_XS's scales per 32): dot panels only, and for float32 products the exact
# dequantization.
NO_EXACT_PANELS = ("q4_1", "q5_1", "q2_k", "q5_k", "iq4_xs")
# Kinds packed as another kind's blocks (weft/native/rewrite.cpp): exactly, but IQ4_XS's scales
REWRITTEN = {"q3_k": "q6_k", "iq4_nl": "q8_0", "iq4_xs": "iq4_nl", "mxfp4": "q5_0"}
# IQ4 dot panels: Q4_0's blocks (the same file layout), 4 to a block of 128 features (IQ4_NL) or 8 to
# a super-block of 256 (IQ4_XS), panels.h
IQ4_DOT_BLOCKS = {"iq4_nl": 4, "iq4_xs": 8}
Q4_0_DOT_BLOCK = 576  # bytes of a Q4_0 dot panel block (panels.h: kQ4_0DotBlockBytes)


@dataclass(frozen=True, slots=True)
class QuantizedRows:
    """A matrix in GGUF blocks: `rows` uint8 [N, K / block * block bytes] of kind `kind`."""

    kind: str
    rows: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:  # the [N, K] it stands for
        block, size = BLOCKS[self.kind]
        return self.rows.shape[0], self.rows.shape[1] // size * block

    def dequantize(self) -> torch.Tensor:  # float32 [N, K], exactly gguf's dequantization
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.rows.numpy(), GGMLQuantizationType[self.kind.upper()])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def pack(self, dot: bool = False, mins: bool = False) -> torch.Tensor:
        """The kind's panels (weft/native/panels.h): exact ones (uint8), or with `dot` dot panels
        (int8; with `mins`, a k-quant matrix in the Q6_K layout with mins, which holds them all)."""
        return self._dot_panels(mins) if dot else self._exact_panels()

    def _exact_panels(self) -> torch.Tensor:
        """Q4_0 and Q5_0 go into Q8_0's exact panels, Q3_K into Q6_K's and IQ4_NL into Q8_0's, exactly;
        Q4_1, Q5_1, Q2_K, Q5_K and IQ4_XS have none (`exact_panels`): the loader dequantizes them."""
        if self.kind in LEGACY:
            return as_q8_0(self).pack()
        if not self.exact_panels:
            raise ValueError(f"{self.kind} has no exact quantized panels; dequantize it for float32 products")
        if self.kind in REWRITTEN:
            return self.rewritten().pack()
        return cast(torch.Tensor, getattr(torch.ops.weft, f"pack_{self.kind}")(self.rows))

    def _dot_panels(self, mins: bool) -> torch.Tensor:
        """Every kind has dot panels of its own (with `mins`, the k-quants go into the Q6_K layout
        with mins, Q3_K as Q6_K blocks); IQ4_NL's where its input features are not whole blocks of
        128 are Q8_0's."""
        if self.kind in IQ4_DOT_BLOCKS:
            if self.shape[1] % (32 * IQ4_DOT_BLOCKS[self.kind]):
                return self.rewritten().pack(dot=True)
            return self._iq4_dot_panels()
        if self.kind == "q3_k" and mins:
            return self.rewritten().pack(dot=True, mins=True)
        return cast(torch.Tensor, torch.ops.weft.pack_dot(self.rows, self.kind, mins))

    def _iq4_dot_panels(self) -> torch.Tensor:  # int8 [P, K / (32 * blocks), blocks * 576]
        nl = self.rewritten() if self.kind == "iq4_xs" else self
        panels = torch.ops.weft.pack_dot(nl.rows, "q4_0", False)  # IQ4_NL's blocks are Q4_0's layout
        return panels.view(panels.shape[0], -1, IQ4_DOT_BLOCKS[self.kind] * Q4_0_DOT_BLOCK)

    def rewritten(self) -> QuantizedRows:
        """Q3_K, IQ4_NL, IQ4_XS or MXFP4 rows as the rows of the kind they are packed as for exact
        products (`REWRITTEN`; MXFP4's also by numpy where weft's kernels are not built, bit for bit
        the same)."""
        if self.kind == "mxfp4" and not hasattr(torch.ops.weft, "rewrite_blocks"):
            return QuantizedRows("q5_0", torch.from_numpy(mxfp4_as_q5_0(self.rows.numpy())))
        return QuantizedRows(REWRITTEN[self.kind], torch.ops.weft.rewrite_blocks(self.rows, self.kind))

    @property
    def exact_panels(self) -> bool:  # whether float32 products have panels of this kind (or Q8_0's)
        return self.kind not in NO_EXACT_PANELS

    @property
    def kinds(self) -> tuple[str, ...]:
        return (self.kind,)

    @property
    def label(self) -> str:  # how llm.kernels names the panels
        return self.kind


class StackedRows:
    """Matrices stacked by rows (a fusion's parts, each in blocks): the [N, K] they stand for and
    their values."""

    __slots__ = ()
    parts: tuple[QuantizedRows | MixedRows, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def dequantize(self) -> torch.Tensor:  # float32 [N, K]
        return torch.cat([p.dequantize() for p in self.parts])


@dataclass(frozen=True, slots=True)
class MixedRows(StackedRows):
    """A fused matrix whose parts are Q2_K, Q3_K, Q4_K, Q5_K and Q6_K (`cat_rows`), each of a multiple
    of 32 rows."""

    parts: tuple[QuantizedRows, ...]

    def pack(self, dot: bool = True) -> torch.Tensor:
        """Dot panels in the Q6_K layout with mins, part by part (no panel straddles two parts).
        Exact panels do not mix kinds: for float32 products the loader dequantizes the matrix."""
        if not dot:
            raise ValueError("exact quantized panels hold one kind; dequantize a mixed fusion instead")
        return torch.cat([p.pack(dot=True, mins=True) for p in self.parts])

    def in_own_layouts(self) -> PartedRows:
        """The fusion in parts of one kind each, every part in its kind's own dot panels (a Q5_K
        part in 5.6 bits a weight instead of the layout with mins' 7.1, and its faster tile)."""
        runs: list[list[QuantizedRows]] = []
        for part in self.parts:
            if runs and runs[-1][-1].kind == part.kind:
                runs[-1].append(part)
            else:
                runs.append([part])
        return PartedRows(tuple(_joined(run) for run in runs))

    @property
    def kinds(self) -> tuple[str, ...]:  # each kind once, in the parts' order
        return tuple(dict.fromkeys(p.kind for p in self.parts))

    @property
    def label(self) -> str:
        return "+".join(self.kinds)


@dataclass(frozen=True, slots=True)
class PartedRows(StackedRows):
    """A fused matrix whose parts no one dot layout holds (an IQ4_XS q/k with a Q5_K v, as llama.cpp
    quantizes attn_v where many query heads share a KV head), each of a multiple of 32 rows: each
    part in its own dot panels, one flat int8 tensor, each part's product into its columns of the
    output (`Linear.parts`). Exact products dequantize it."""

    parts: tuple[QuantizedRows | MixedRows, ...]

    def pack(self) -> tuple[torch.Tensor, tuple[PanelPart, ...]]:
        """The parts' dot panels, flat int8, and where each lies."""
        panels = [p.pack(dot=True) for p in self.parts]
        layout, out_start, start = [], 0, 0
        for part, packed in zip(self.parts, panels, strict=True):
            shape = cast(tuple[int, int, int], tuple(packed.shape))
            layout.append(PanelPart(out_start, part.shape[0], start, shape))
            out_start, start = out_start + part.shape[0], start + packed.numel()
        return torch.cat([p.reshape(-1) for p in panels]), tuple(layout)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for p in self.parts for k in p.kinds))

    @property
    def label(self) -> str:
        return "+".join(self.kinds)


# The kinds `file_linear` multiplies in the file's own blocks (weft/native/file_dot.cpp), and its
# code for each.
FILE_KINDS = {"q4_k": 0, "q6_k": 1}


@dataclass(frozen=True, slots=True)
class FileRows(StackedRows):
    """A matrix multiplied in the GGUF file's own blocks, read from its pages every step
    (`Linear.file`; a mixture of experts' experts with `expert_weights="file"`): its parts, views
    of the file's mapping stacked by rows (a fused gate|up's gate and up), each of a kind in
    `FILE_KINDS`. Nothing is packed or copied; the products are the dot panels' bit for bit."""

    parts: tuple[QuantizedRows, ...]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.kind for p in self.parts))

    @property
    def label(self) -> str:
        return "+".join(self.kinds) + " (file)"

    def file_weight(self) -> FileWeight:
        """The parts as `Linear.file` holds them."""
        return FileWeight(tuple(p.rows for p in self.parts), tuple(FILE_KINDS[p.kind] for p in self.parts))

    @staticmethod
    def holds(weight: object) -> bool:
        """Whether a weight read from a file can be multiplied in its blocks."""
        return isinstance(weight, QuantizedRows) and weight.kind in FILE_KINDS


Weight = torch.Tensor | QuantizedRows | MixedRows | PartedRows | FileRows


def as_q8_0(matrix: QuantizedRows) -> QuantizedRows:
    """Q4_0, Q5_0 or IQ4_NL rows of blocks [N, K / 32 * 18 or 22] as Q8_0 ones, exactly: each block's
    weights are d * (q - 8) or d * (q - 16), and q - 8 or q - 16 is an int8 under the same float16 d
    (8.5 bits a weight instead of 4.5 or 5.5); IQ4_NL's d * level, its levels int8. Q8_0 rows come
    back as they are."""
    if matrix.kind == "q8_0":
        return matrix
    if matrix.kind == "iq4_nl":
        return matrix.rewritten()
    size = BLOCKS[matrix.kind][1]
    rows = matrix.rows.numpy()
    blocks = rows.reshape(rows.shape[0], -1, size)  # [N, K / 32, size]
    scales, packed = blocks[..., :2], blocks[..., size - 16 :]  # [N, B, 2], [N, B, 16]: low nibbles
    quants = np.concatenate([packed & 0xF, packed >> 4], axis=-1)  # [N, B, 32]: features 0-15, 16-31
    if matrix.kind == "q5_0":  # the fifth bit of feature j is bit j of a little-endian uint32
        high = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [N, B, 1]
        quants = quants | (((high >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
    centred = quants.astype(np.int16) - (8 if matrix.kind == "q4_0" else 16)  # [N, B, 32] in -16..15
    q8 = np.concatenate([scales, centred.astype(np.int8).view(np.uint8)], axis=-1)  # [N, B, 34]
    return QuantizedRows("q8_0", torch.from_numpy(q8.reshape(rows.shape[0], -1)))


def flat_blocks(weight: QuantizedRows | MixedRows) -> tuple[torch.Tensor, tuple[BlockPart, ...]]:
    """A matrix in blocks as one flat uint8 tensor and its parts (`WeightLayout.BLOCKS`: the kernel
    set multiplies the blocks as they are, on the device)."""
    matrices = weight.parts if isinstance(weight, MixedRows) else (weight,)
    parts, out_start, byte_start = [], 0, 0
    for matrix in matrices:
        rows, row_bytes = matrix.rows.shape
        parts.append(BlockPart(matrix.kind, out_start, rows, byte_start, row_bytes))
        out_start, byte_start = out_start + rows, byte_start + rows * row_bytes
    flat = (
        torch.cat([m.rows.reshape(-1) for m in matrices])
        if len(matrices) > 1
        else matrices[0].rows.reshape(-1)
    )
    return flat, tuple(parts)


def logical_shape(weight: Weight) -> tuple[int, ...]:
    return tuple(weight.shape)


def dequantized(weight: Weight) -> torch.Tensor:
    """A weight as float32 where it came in blocks (an untied embedding table, an odd fusion)."""
    if isinstance(weight, (QuantizedRows, MixedRows, PartedRows, FileRows)):
        return weight.dequantize()
    return weight


def release_read(weight: Weight) -> None:
    """Drop the pages of a GGUF file's mapping that a weight in blocks is a view of, now that it has
    been read (packed, copied, dequantized): `weft/model/gguf_file.py`. A copy, a float tensor, or
    a matrix read from the file every step (`FileRows`) is left as it is."""
    if isinstance(weight, QuantizedRows):
        release_pages(weight.rows.data_ptr(), weight.rows.numel())
    elif isinstance(weight, (MixedRows, PartedRows)):
        for part in weight.parts:
            release_read(part)


def cat_rows(parts: list[Weight]) -> Weight:
    """Matrices stacked by rows (a fused q/k/v or gate/up): in blocks when every part is of one kind,
    `MixedRows` when they are k-quant parts of whole panels, Q8_0 where Q4_0, Q5_0 or IQ4_NL parts
    meet Q8_0 ones, `PartedRows` for other kinds in whole panels, else float32."""
    blocks = [p for p in parts if isinstance(p, QuantizedRows)]
    kinds = {p.kind for p in blocks}
    if len(blocks) == len(parts) and len(kinds) > 1 and kinds <= {"q8_0", "iq4_nl", *LEGACY}:
        blocks = [as_q8_0(p) for p in blocks]  # one kind, exactly
    if len(blocks) == len(parts) and len({p.kind for p in blocks}) == 1:
        return QuantizedRows(blocks[0].kind, torch.cat([p.rows for p in blocks]))
    if len(blocks) == len(parts) and all(p.shape[0] % PANEL == 0 for p in blocks):
        if all(p.kind in MIXABLE for p in blocks):
            return MixedRows(tuple(blocks))
        return PartedRows(tuple(_runs(blocks)))
    return torch.cat([dequantized(p) for p in parts])


def _joined(run: list[QuantizedRows]) -> QuantizedRows:
    """Matrices of one kind stacked by rows (one is kept as it is: a view of the file)."""
    return run[0] if len(run) == 1 else QuantizedRows(run[0].kind, torch.cat([p.rows for p in run]))


def _runs(blocks: list[QuantizedRows]) -> list[QuantizedRows | MixedRows]:
    """Neighbouring parts of one kind as one matrix (an IQ4_XS q and k), of k-quants as a `MixedRows`."""
    runs: list[list[QuantizedRows]] = []
    for block in blocks:
        last = runs[-1][-1] if runs else None
        if last is not None and (last.kind == block.kind or {last.kind, block.kind} <= set(MIXABLE)):
            runs[-1].append(block)
        else:
            runs.append([block])
    return [cast(QuantizedRows | MixedRows, cat_rows(list(run))) for run in runs]


MIXABLE = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")  # the kinds the Q6_K dot layout with mins holds
PANEL = 32  # output columns per panel (weft/native/panels.h)

__all__ = [
    "BLOCKS",
    "LEGACY",
    "NO_EXACT_PANELS",
    "REWRITTEN",
    "MixedRows",
    "PartedRows",
    "QuantizedRows",
    "Weight",
    "as_q8_0",
    "cat_rows",
    "dequantized",
    "flat_blocks",
    "logical_shape",
    "release_read",
]
