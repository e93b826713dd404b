#!/usr/bin/env bash
# weft's CUDA checks in one run, sized for a short lease of one GPU (about 9 minutes at most on an
# H100/H200, every step's limit added up): the CUDA tests; `weft bench throughput` (bfloat16 against
# transformers; a random-block Q4_K_M file of the same shape, and its batch 1 again with float
# products, WEFT_GEMV_ACTIVATIONS=float); where a decode step's time goes kernel by kernel
# (benchmarks/step_profile.py, both files, batch 1 and 64, greedy and top-5 logprobs); the quantized
# kernels' tiles (benchmarks/quant_tiles.py); `weft bench structured`, `weft bench logprobs` and
# `weft bench overhead` on the device. With GPU_CHECK_STATIC=1, transformers with a static cache
# and torch.compile too (about 90 s more). Each step has its own time limit and its output goes to
# $OUT (default: gpu-out/): one log per step and the summary gpu_check.md (11 files: what a lease
# brings back). Step limits are from the first run on an H200 (2026-11-28) and estimates since.
#
#   bash benchmarks/gpu_check.sh
#
# Where the machine lacks weft's dependencies and its data: wheels in .whl/ (installed to
# /tmp/site) and a copy of what the run reads from ../shared/data in .gpu/data (copied there;
# `bash benchmarks/gpu_data.sh` makes it, about 26 MB).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
report="$OUT/gpu_check.md"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONPATH="${PYTHONPATH:-$PWD}"
if [ -d .gpu/data ] && [ ! -d ../shared/data ]; then mkdir -p ../shared && cp -r .gpu/data ../shared/data; fi
CONFIG=../shared/data/configs/llama-3.2-1b/config.json
started=$(date +%s)

step() {  # step NAME SECONDS COMMAND...: run it with a limit, log it, note it in the report
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "## $name (exit $rc, $(( $(date +%s) - t0 )) s)" >>"$report"
    echo '```' >>"$report"
    grep -E '^\||a step \(wall\)|passed|failed|error|Error|streams|weft bench|what ran|weft:|overhead|cost|done|GB/s' "$OUT/$name.log" | tail -60 >>"$report"
    echo '```' >>"$report"
}

{
    echo "# weft gpu_check ($(date -u +%F))"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    git log -1 --oneline 2>/dev/null || true
} >"$report" 2>&1

step tests 150 python3 -m pytest -q -p no:cacheprovider tests/test_triton_quant.py tests/test_triton_step_kernels.py \
    tests/test_gguf.py::test_triton_half_precision_decode_rows_meet_k_quants_as_int8 \
    tests/test_gguf.py::test_triton_kernels_multiply_the_blocks_as_the_file_stores_them tests/test_triton.py \
    tests/test_graphs.py tests/test_step_uploads.py tests/test_model_parity.py tests/test_sliding_window.py
step throughput-bf16 100 python3 -m weft bench throughput --device cuda --config "$CONFIG" --dtype bfloat16 \
    --batch-sizes 1,16,64,256 --prompt-len 128 --output-len 128 --repeats 1
step throughput-q4_k_m 50 python3 -m weft bench throughput --device cuda --config "$CONFIG" --dtype bfloat16 \
    --gguf-type q4_k_m --no-reference --batch-sizes 1,16,64,256 --prompt-len 128 --output-len 128 --repeats 1
WEFT_GEMV_ACTIVATIONS=float step throughput-q4_k_m-float 30 python3 -m weft bench throughput --device cuda \
    --config "$CONFIG" --dtype bfloat16 --gguf-type q4_k_m --no-reference --batch-sizes 1 --prompt-len 128 \
    --output-len 128 --repeats 1
step profile-bf16 40 python3 benchmarks/step_profile.py --device cuda --config "$CONFIG" --batch-sizes 1,64 \
    --logprobs 0,5
step profile-q4_k_m 25 python3 benchmarks/step_profile.py --device cuda --config "$CONFIG" --gguf-type q4_k_m \
    --batch-sizes 1,64
step quant-tiles 45 python3 benchmarks/quant_tiles.py
step structured 40 python3 -m weft bench structured --device cuda --batch-sizes 1,64 --output-len 64 \
    --repeats 1 --no-transformers
step logprobs 50 python3 -m weft bench logprobs --device cuda --config "$CONFIG" --batch-sizes 1,64 \
    --output-len 64 --repeats 1
step overhead 20 python3 -m weft bench overhead --device cuda --batch-sizes 1,32,256 --workloads greedy,json,top-5
echo "total $(( $(date +%s) - started )) s" >>"$report"
if [ "${GPU_CHECK_STATIC:-0}" = 1 ]; then  # transformers' best settings: about 90 s more (its compiles)
    step throughput-static 90 python3 -m weft bench throughput --device cuda --config "$CONFIG" \
        --dtype bfloat16 --batch-sizes 1,256 --prompt-len 128 --output-len 128 --repeats 1 --static-cache
fi
cat "$report"
