"""Run a benchmark module of this tree against the flashlight package of another checkout:

    python scripts/with_tree.py .s29 benchmarks.shifts [args...]

The other tree's ``flashlight`` is imported first; example modules it lacks come from this
tree's ``flashlight/examples`` (the programs stay the same on both sides of an A/B)."""
import importlib
import importlib.util
import runpy
import sys
from pathlib import Path

here = Path(__file__).resolve().parents[1]
tree, module, *args = sys.argv[1:]
sys.path.insert(0, str(Path(tree).resolve()))
import flashlight  # noqa: E402
import flashlight.examples  # noqa: E402

sys.path.pop(0)
sys.path.insert(0, str(here))
for path in sorted((here / "flashlight" / "examples").glob("*.py")):
    name = f"flashlight.examples.{path.stem}"
    if path.stem != "__init__" and not (Path(flashlight.examples.__file__).parent / path.name).exists():
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        setattr(flashlight.examples, path.stem, mod)
print(f"flashlight from {Path(flashlight.__file__).parent}", flush=True)
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__")
