#!/usr/bin/env bash
# Install weft (editable) with optional extras: `bash scripts/install.sh` or `bash scripts/install.sh test`.
#
# torch: an installed torch is kept as it is (bring your own CUDA build first if you have a GPU);
# with none installed, the CPU build torch==2.13.0 is installed, which avoids pulling the CUDA stack.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if ! python -c "import torch" >/dev/null 2>&1; then
    echo "weft install: no torch found, installing the CPU build torch==2.13.0"
    python -m pip install -q torch==2.13.0
fi
python -m pip install -q -e ".${extras:+[$extras]}"
