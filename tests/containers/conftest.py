"""The container tier: our images, built on a local base, run by testcontainers.

CI installs Docker and starts dockerd with its bridge off; nothing here skips there.
Elsewhere the tier runs when a Docker engine answers and the images can be built.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# The reaper image cannot be pulled here; every test stops what it starts instead.
os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from .containers import LABEL, ContainerStack, ImageTags, docker_client

ROOT = Path(__file__).resolve().parents[2]
TAG = "local"


def _need(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the container tier must run in CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker():
    try:
        client = docker_client()
        client.ping()
    except Exception as error:  # the docker SDK raises several unrelated types here
        _need(f"no Docker engine: {error}")
    yield client
    # Every container a test started carries LABEL; none may outlive the session.
    left = client.containers.list(all=True, filters={"label": LABEL})
    for container in left:
        container.remove(force=True)
    assert not left, f"containers left running: {[c.name for c in left]}"


@pytest.fixture(scope="session")
def images(docker) -> ImageTags:
    """Builds (or refreshes from cache) the three project images on the local base."""
    result = subprocess.run(
        [str(ROOT / "docker" / "build-local.sh"), TAG],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode != 0:
        message = f"docker/build-local.sh failed:\n{result.stdout}\n{result.stderr}"
        _need(message)  # e.g. no debootstrap, or not root
    return ImageTags.for_tag(TAG)


@pytest.fixture(scope="module")
def stack(docker, images, tmp_path_factory) -> Iterator[ContainerStack]:
    with ContainerStack(images, tmp_path_factory.mktemp("containers")) as running:
        yield running
