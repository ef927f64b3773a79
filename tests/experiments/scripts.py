"""Load an experiments/ script as a module (they are scripts, not a package)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str):
    """experiments/<name>.py as a module, with experiments/ on sys.path as when it runs as
    `python experiments/<name>.py` (a script imports its neighbours by name)."""
    here = str(ROOT / "experiments")
    if here not in sys.path:
        sys.path.append(here)
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
