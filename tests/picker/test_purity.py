"""The decision core stays pure: it must not pull in grpc or any I/O layer.

Every module of ``extproc.picker`` is held to it, found by walking the package: a module
added there is covered without being named here.
"""

import json
import subprocess
import sys
from pathlib import Path

import extproc

PICKER_DIR = Path(extproc.__file__).parent / "picker"

# Each module is imported in turn in a fresh interpreter, and charged with whatever it
# brought into sys.modules (a module an earlier one imported is charged to that one).
_WALK = """
import importlib, json, pkgutil, sys

roots = tuple(sys.argv[1].split(","))

def forbidden():
    return {m for m in sys.modules
            if m.split(".")[0] in roots or m.startswith("extproc.adapter")}

# The package (with extproc's own __init__) is charged with everything loaded so far.
package = importlib.import_module("extproc.picker")
report = {"extproc.picker": sorted(forbidden())}
names = sorted(m.name for m in pkgutil.walk_packages(package.__path__, "extproc.picker."))
for name in names:
    before = forbidden()
    importlib.import_module(name)
    report[name] = sorted(forbidden() - before)
print(json.dumps(report))
"""


def _imported_by_each(roots: tuple[str, ...]) -> dict[str, list[str]]:
    """For each module of extproc.picker, the forbidden modules importing it added."""
    result = subprocess.run(
        [sys.executable, "-c", _WALK, ",".join(roots)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout)


def _imported(modules: str, roots: tuple[str, ...]) -> str:
    code = (
        f"import sys, {modules}; "
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r} "
        "or m.startswith('extproc.adapter')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    return result.stdout.strip()


def test_every_picker_module_imports_no_grpc_no_io_and_no_adapter():
    report = _imported_by_each(("grpc", "aiohttp", "asyncio", "socket", "random"))
    # The walk found every module in the package's directory, the package itself too.
    on_disk = {f"extproc.picker.{p.stem}" for p in PICKER_DIR.glob("*.py")}
    on_disk = {"extproc.picker" if m.endswith(".__init__") else m for m in on_disk}
    assert on_disk <= set(report), sorted(on_disk - set(report))
    assert {name: added for name, added in report.items() if added} == {}


def test_config_imports_no_grpc_and_no_adapter():
    # pydantic itself imports socket and random (for its own types), so the config schema
    # is held to no network stack, event loop or adapter.
    assert _imported("extproc.config", ("grpc", "aiohttp", "asyncio")) == "[]"
