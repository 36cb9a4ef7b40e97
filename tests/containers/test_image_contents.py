"""What the images hold: the runtime, not the benchmark harness (.dockerignore leaves out
extproc/bench and extproc/cli/bench), and a CLI that says so when asked to benchmark."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from .containers import LABEL, ImageTags

# Every file of the installed distribution (its RECORD), and every module file under the
# installed package's directory, as paths relative to site-packages.
LIST_INSTALLED = """
import importlib.metadata, json, pathlib, extproc
package = pathlib.Path(extproc.__file__).parent
print(json.dumps({
    "record": sorted(str(f) for f in importlib.metadata.files("envoy-prefix-router")),
    "on_disk": sorted(
        str(p.relative_to(package.parent)) for p in package.rglob("*") if p.is_file()
    ),
}))
"""
HARNESS = ("extproc/bench/", "extproc/cli/bench/")
MISSING_HARNESS = (
    "prefix-router: bench: the benchmark harness (extproc.bench) is not installed in this "
    "image; run it from a source checkout: pip install -e '.[bench]'\n"
)


@dataclass(frozen=True)
class Ran:
    code: int
    out: str
    err: str


def run_in(docker, image: str, command: list[str], entrypoint: list[str] | None = None) -> Ran:
    """Run ``command`` in a fresh container of ``image`` (no network) to its end."""
    container = docker.containers.run(
        image,
        command,
        entrypoint=entrypoint,
        detach=True,
        network_mode="none",
        labels={LABEL: "image-contents"},
    )
    try:
        code = container.wait(timeout=120)["StatusCode"]
        out = container.logs(stdout=True, stderr=False).decode()
        err = container.logs(stdout=False, stderr=True).decode()
    finally:
        container.remove(force=True)
    return Ran(code, out, err)


def installed(docker, image: str) -> dict[str, list[str]]:
    ran = run_in(docker, image, ["-c", LIST_INSTALLED], entrypoint=["python3"])
    assert ran.code == 0, ran.err
    return json.loads(ran.out)


@pytest.mark.parametrize("which", ["router", "sim"])
def test_the_images_install_the_runtime_and_no_harness(docker, images: ImageTags, which):
    files = installed(docker, getattr(images, which))
    for listing in ("record", "on_disk"):
        paths = files[listing]
        assert not [path for path in paths if path.startswith(HARNESS)], listing
        for module in ("adapter/service.py", "control/service.py", "sim/server.py"):
            assert f"extproc/{module}" in paths, (listing, module)
        assert "extproc/reporting.py" in paths  # replay --out renders through it
        assert "extproc/cli/router.py" in paths and "extproc/cli/common.py" in paths


def test_the_router_image_runs_the_router_and_refuses_bench(docker, images: ImageTags):
    config = docker.images.get(images.router).attrs["Config"]
    # The router's stage is the last one: a build without --target is the router's image.
    assert config["Cmd"] == ["router", "--config", "/etc/prefix-router/router.yaml"]
    assert config["Entrypoint"] == ["prefix-router"]
    help_text = run_in(docker, images.router, ["router", "--help"])
    assert help_text.code == 0, help_text.err
    assert help_text.out.startswith("usage: prefix-router router")
    bench = run_in(docker, images.router, ["bench", "overhead", "--quick"])
    assert (bench.code, bench.out, bench.err) == (1, "", MISSING_HARNESS)


def test_the_sim_image_still_runs_the_simulator(docker, images: ImageTags):
    assert docker.images.get(images.sim).attrs["Config"]["Cmd"][0] == "sim"
    ran = run_in(docker, images.sim, ["sim", "--help"])
    assert ran.code == 0, ran.err
    assert ran.out.startswith("usage: prefix-router sim")
