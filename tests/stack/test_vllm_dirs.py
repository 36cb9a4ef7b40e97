"""start_vllm's work directories: vLLM binds Unix sockets there, whose paths hold at most
107 bytes, so a directory too long for them is refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.stack.processes import StackError
from extproc.stack.vllm import MAX_INSTANCE_DIR, VllmOptions, start_vllm


def test_a_work_directory_too_long_for_vllms_sockets_is_refused_naming_it(tmp_path: Path):
    work = tmp_path / ("w" * MAX_INSTANCE_DIR)
    options = VllmOptions(model_dir=tmp_path / "model")
    with pytest.raises(StackError, match=f"{work}/0 is longer than {MAX_INSTANCE_DIR}"):
        # No vLLM is needed: the refusal comes before any process starts.
        start_vllm("/nonexistent/python", options, [("127.0.0.21", 8200)], work)
    assert not work.exists()
