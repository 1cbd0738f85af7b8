"""On-disk home of generated kernel modules, named by a hash of their source.

Triton's ``@jit`` needs source on disk; a person debugging opens the file there. Generating the
source is cheap (milliseconds), so the source itself is the cache key: the module file is written
only when missing or different (a corrupt file is simply rewritten), and Triton's own disk cache,
keyed by the same source, skips recompilation in a second process.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    d = os.environ.get("FLASHLIGHT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "flashlight")
    path = Path(d)
    path.mkdir(parents=True, exist_ok=True)
    return path


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def load_module(name: str, source: str):
    """Import the kernel module ``name`` whose text is ``source``; returns (module, path)."""
    path = cache_dir() / f"{name}.py"
    try:
        current = path.read_text()
    except (OSError, UnicodeDecodeError):
        current = None
    if current != source:
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    modname = f"flashlight_kernels.{name}"
    if modname in sys.modules:
        return sys.modules[modname], path
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[modname] = mod
    return mod, path
