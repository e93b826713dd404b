#!/usr/bin/env bash
# Copies what benchmarks/gpu_check.sh reads from ../shared/data into .gpu/data (ignored by git), for a
# GPU machine that has the repository but not ../shared: the configs, the Llama 3 and SmolLM2
# tokenizers, the Q4_K_M test file with llama.cpp's records, and the JSON schemas of the structured
# bench. About 30 MB; gpu_check.sh copies it back to ../shared/data there.
#
#   bash benchmarks/gpu_data.sh
set -euo pipefail
cd "$(dirname "$0")/.."
src=../shared/data
dst=.gpu/data
rm -rf "$dst"
mkdir -p "$dst/tokenizers" "$dst/gguf" "$dst/jsonschema/jsonschemabench"
cp -r "$src/configs" "$dst/"
cp -r "$src/tokenizers/llama3" "$src/tokenizers/smollm2" "$dst/tokenizers/"
cp "$src/gguf/tiny-q4_k_m.gguf" "$src/gguf/llama_cpp_reference.json" "$src/gguf/README.md" "$dst/gguf/"
cp "$src/jsonschema/jsonschemabench/Glaiveai2K.jsonl.gz" "$dst/jsonschema/jsonschemabench/"
du -sh "$dst"
