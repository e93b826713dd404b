#!/usr/bin/env bash
# Install weft (editable) with optional extras: `bash scripts/install.sh` or `bash scripts/install.sh test`.
#
# The test extra installs the versions locked in constraints/test.txt (scripts/lock.sh regenerates
# it; WEFT_NO_LOCK=1 installs the newest versions the bounds allow instead), so that the suite runs
# against the versions it was last proven with.
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
lock=()
if [[ "$extras" == *test* && "${WEFT_NO_LOCK:-0}" != 1 ]]; then
    lock=(-c constraints/test.txt)
fi
python -m pip install -q -e ".${extras:+[$extras]}" "${lock[@]}"
