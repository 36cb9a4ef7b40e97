"""The decision core stays pure: it must not pull in grpc or any I/O layer."""

import subprocess
import sys


def test_picker_imports_no_grpc_and_no_adapter():
    code = (
        "import sys, extproc.picker.decide, extproc.picker.keys, extproc.picker.placement, "
        "extproc.picker.hosts, extproc.config; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'aiohttp', 'asyncio', 'socket', 'random') or m.startswith('extproc.adapter')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
