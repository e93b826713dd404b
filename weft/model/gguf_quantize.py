"""`weft quantize IN.gguf OUT.gguf --type q8_0`: a GGUF file rewritten with its matrices in another
quantized type, as llama.cpp's quantizer writes one: every key of the input (the configuration, the
tokenizer, the chat template) copied, general.file_type set to the new type, each 2-D weight whose
rows are whole blocks quantized (from its dequantized values; llama.cpp's reference rounding,
`weft/model/quantize.py`; with q4_k the token embedding and rows that are not whole super-blocks in
Q8_0), the rest (norms, rope factors) kept as they are. llama.cpp loads the result like a file of its
own quantizer.

Steps: open the input (weft/model/gguf_checkpoint.py checks its architecture and tensor types),
copy the keys, then quantize and write tensor by tensor, with a progress bar.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from weft.model.gguf_checkpoint import GgufCheckpoint, GgufError
from weft.model.quantize import QUANTIZATIONS, check_quantization, quantize_rows
from weft.native import kernels_available

# general.file_type of each type (llama.cpp's llama_ftype: what its quantizer writes)
FILE_TYPES = {"q8_0": 7, "q4_k": 14}  # MOSTLY_Q8_0, MOSTLY_Q4_K_S
_SKIPPED_KEYS = ("general.architecture", "general.file_type")  # written anew


def quantize_gguf(source: Path, target: Path, kind: str, show_progress: bool = True) -> int:
    """Write `target`: `source` with its matrices in `kind` blocks. Returns how many it quantized."""
    import gguf

    kind = check_quantization(kind) or QUANTIZATIONS[0]
    if kind == "q4_k" and not kernels_available():
        raise GgufError("--type q4_k quantizes with weft's CPU kernels, which are not available here")
    if source.resolve() == target.resolve():
        raise GgufError(f"{target}: the output would overwrite the input; name another file")
    checkpoint = GgufCheckpoint(source)
    writer = gguf.GGUFWriter(str(target), checkpoint.arch)
    for key, field in checkpoint.reader.fields.items():
        if not key.startswith(_SKIPPED_KEYS):
            _copy_field(writer, key, field)
    writer.add_file_type(FILE_TYPES[kind])
    quantized = 0
    desc = f"Quantizing to {kind.upper()}"
    for tensor in tqdm(checkpoint.reader.tensors, desc=desc, unit="tensor", disable=not show_progress):
        array, qtype, requantized = _converted(checkpoint, tensor, kind)
        quantized += requantized
        writer.add_tensor(tensor.name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return quantized


def _copy_field(writer: Any, key: str, field: Any) -> None:
    """One key-value pair, its type (and an array's element type) as in the input."""
    import gguf

    types = field.types
    if types[0] == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(key, field.contents(), types[0], sub_type=types[1])
    else:
        writer.add_key_value(key, field.contents(), types[0])


def _converted(checkpoint: GgufCheckpoint, tensor: Any, kind: str) -> tuple[np.ndarray, Any, bool]:
    """A tensor as written, its type, and whether it was quantized: a matrix of whole blocks becomes
    its rows of blocks, anything else stays as stored."""
    import gguf

    shape = [int(n) for n in reversed(tensor.shape)]  # numpy order: [rows, features]
    if len(shape) == 2 and shape[1] % 32 == 0:
        values = checkpoint.dequantized(tensor).reshape(shape)
        blocks = quantize_rows(values, "q8_0" if tensor.name == "token_embd.weight" else kind)
        return blocks.rows.numpy(), gguf.GGMLQuantizationType[blocks.kind.upper()], True
    return np.asarray(tensor.data), tensor.tensor_type, False


__all__ = ["FILE_TYPES", "quantize_gguf"]
