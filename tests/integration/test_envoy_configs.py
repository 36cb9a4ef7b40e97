"""The shipped bootstraps match the generator and load into the real Envoy binary."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from extproc.stack.bootstrap import MODES, BootstrapParams, render
from extproc.stack.local import envoy_binary

ENVOY_DIR = Path(__file__).resolve().parents[2] / "envoy"


@pytest.mark.parametrize("mode", MODES)
def test_shipped_file_is_the_generators_output(mode):
    shipped = (ENVOY_DIR / f"{mode}.yaml").read_text()
    assert shipped == render(BootstrapParams(mode=mode)), (
        f"envoy/{mode}.yaml is stale: prefix-router envoy-config --mode {mode} > envoy/{mode}.yaml"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("upstream_host_header", [True, False])
def test_bootstrap_validates_in_envoy(tmp_path, mode, upstream_host_header):
    path = tmp_path / "bootstrap.yaml"
    path.write_text(render(BootstrapParams(mode=mode, upstream_host_header=upstream_host_header)))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout + result.stderr
    assert ("x-upstream-host" in path.read_text()) is upstream_host_header


def test_original_dst_strips_client_routing_headers_before_ext_proc():
    text = render(BootstrapParams(mode="original-dst"))
    strip = text.index("envoy.filters.http.header_mutation")
    ext_proc = text.index("envoy.filters.http.ext_proc")
    assert strip < ext_proc
    assert "remove: x-target-host" in text
    assert "failure_mode_allow: false" in text
