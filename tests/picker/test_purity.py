"""The decision core stays pure: it must not pull in grpc or any I/O layer."""

import subprocess
import sys

PICKER = (
    "extproc.picker.decide, extproc.picker.keys, extproc.picker.placement, extproc.picker.hosts"
)


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


def test_picker_imports_no_grpc_and_no_adapter():
    assert _imported(PICKER, ("grpc", "aiohttp", "asyncio", "socket", "random")) == "[]"


def test_config_imports_no_grpc_and_no_adapter():
    # pydantic itself imports socket and random (for its own types), so the config schema
    # is held to no network stack, event loop or adapter.
    assert _imported("extproc.config", ("grpc", "aiohttp", "asyncio")) == "[]"
