"""What a user's install holds: every module the main commands import comes from the main
dependencies (pyproject's `dependencies`, and what they bring), never from the test extra alone.

A child process blocks the import of any top-level module that is neither the standard library,
weft, nor a distribution the main dependencies reach, then imports every module of weft's
product (not its benchmarks, which import their reference engines) and runs each command's
`--help`: a module that imports a test-only package fails here instead of on a user's machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import importlib, importlib.metadata as md, pkgutil, re, sys, tomllib
from pathlib import Path

root = Path(sys.argv[1])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]

def name_of(requirement):
    return re.split(r"[ ;<>=!~\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")

def reached(requirements, seen):
    for requirement in requirements:
        if "extra ==" in requirement:
            continue
        name = name_of(requirement)
        if name in seen:
            continue
        seen.add(name)
        try:
            reached(md.requires(name) or [], seen)
        except md.PackageNotFoundError:
            pass
    return seen

distributions = reached(project["dependencies"], set())
allowed = set(sys.stdlib_module_names) | {"weft", "_distutils_hack", "__main__"}
for module, owners in md.packages_distributions().items():
    if any(owner.lower().replace("_", "-") in distributions for owner in owners):
        allowed.add(module)

class Blocker:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top not in allowed and not top.startswith("_"):
            raise ModuleNotFoundError(f"{name} is not a main dependency of weft", name=name)
        return None

sys.meta_path.insert(0, Blocker())
import weft
for info in pkgutil.walk_packages(weft.__path__, "weft."):
    if not info.name.startswith(("weft.bench", "weft.cuda")):  # benchmarks; Triton ships with CUDA torch
        importlib.import_module(info.name)
from weft.cli import main
for argv in (["--help"], ["demo", "--help"], ["serve", "--help"], ["generate", "--help"]):
    try:
        main(argv)
    except SystemExit as exit:
        assert exit.code == 0, (argv, exit.code)
print("ok")
"""


def test_the_main_commands_import_only_main_dependencies():
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(ROOT)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_readmes_names_are_exported():
    from weft import LLM, SamplingParams, SMCParams

    assert SMCParams(num_particles=4).num_particles == 4 and LLM and SamplingParams
