"""The body-size ladder at smoke size through the real Envoy and router, in every variant,
and its verdict on made-up cells."""

from __future__ import annotations

import json

import pytest

from extproc.bench import bodies
from extproc.bench.bodies import MAX_BODY, BodyOptions, MiB, body_of_size, cell_holds

pytestmark = pytest.mark.envoy

OPTIONS = {"refuse_bound_s": 2.0, "drip_pieces": 16, "drip_pause_s": 0.02}


def cell(size: int, *results: dict, upload: str = "fixed") -> dict:
    return {"size": size, "upload": upload, "results": list(results)}


def described(cell: dict) -> str:
    """A cell and each of its requests' ends, whole (pytest cuts a dict's repr short)."""
    where = f"{cell['mode']} {cell['body_mode']} {cell['size']} B {cell['upload']}"
    return f"{where}: {cell['results']}"


def test_bodies_are_valid_chat_completions_of_exactly_their_size():
    assert body_of_size(0) == b""
    for size in (300, 64 * 1024, 3 * MiB):
        body = body_of_size(size)
        assert len(body) == size
        assert json.loads(body)["messages"][0]["content"][1]["type"] == "image_url"


def test_a_cell_holds_only_if_small_bodies_arrive_and_large_ones_get_the_routers_413():
    delivered = {"outcome": "delivered", "s": 0.1}
    routers_413 = {"outcome": "refused", "router": True, "s": 0.5}
    assert cell_holds(cell(MAX_BODY, delivered, delivered), MAX_BODY, OPTIONS)
    assert not cell_holds(
        cell(MAX_BODY, delivered, {"outcome": "hung", "s": 30}), MAX_BODY, OPTIONS
    )
    # The upstream's own 413 for a body the router should have passed is a failure.
    assert not cell_holds(cell(MAX_BODY, {**routers_413, "router": False}), MAX_BODY, OPTIONS)
    assert cell_holds(cell(MAX_BODY + 1, routers_413), MAX_BODY, OPTIONS)
    assert not cell_holds(cell(MAX_BODY + 1, delivered), MAX_BODY, OPTIONS)
    # Override-host fails open when the answer to that large a message comes too late:
    # the body arrives whole, which is allowed there and only there.
    over = cell(MAX_BODY + 1, delivered)
    assert cell_holds(over | {"mode": "override-host"}, MAX_BODY, OPTIONS)
    assert not cell_holds(over | {"mode": "original-dst"}, MAX_BODY, OPTIONS)
    # Original-dst fails closed instead: Envoy's 504 at its message_timeout, promptly,
    # and there only; any other failure, or a late one, does not hold.
    closed = cell(MAX_BODY + 1, {"outcome": "failed", "status": 504, "s": 0.65})
    assert cell_holds(closed | {"mode": "original-dst"}, MAX_BODY, OPTIONS)
    assert not cell_holds(closed | {"mode": "override-host"}, MAX_BODY, OPTIONS)
    reset = cell(MAX_BODY + 1, {"outcome": "failed", "error": "RemoteProtocolError", "s": 0})
    assert not cell_holds(reset | {"mode": "original-dst"}, MAX_BODY, OPTIONS)
    late = cell(MAX_BODY + 1, {"outcome": "failed", "status": 504, "s": 2.2})
    assert not cell_holds(late | {"mode": "original-dst"}, MAX_BODY, OPTIONS)
    hung = cell(MAX_BODY + 1, {"outcome": "hung", "s": 30})
    assert not cell_holds(hung | {"mode": "override-host"}, MAX_BODY, OPTIONS)
    assert not cell_holds(cell(MAX_BODY + 1, {**routers_413, "router": False}), MAX_BODY, OPTIONS)
    slow = {**routers_413, "s": 2.2}  # not at once...
    assert not cell_holds(cell(MAX_BODY + 1, slow), MAX_BODY, OPTIONS)
    # ...unless the client dripped it that slowly (16 pauses of 20 ms).
    assert cell_holds(cell(MAX_BODY + 1, slow, upload="slow-drip"), MAX_BODY, OPTIONS)


@pytest.mark.timeout(300)
def test_a_small_ladder_holds_in_every_variant_and_renders_from_the_stored_run(tmp_path):
    options = BodyOptions(
        sizes=(0, 64 * 1024, 9 * MiB, MAX_BODY + MiB), repeats=1, out_dir=tmp_path
    )
    data = bodies.run(options)
    assert {(c["mode"], c["body_mode"]) for c in data["cells"]} == set(bodies.VARIANTS)
    for result in data["cells"]:
        assert cell_holds(result, MAX_BODY, data["options"]), described(result)
    assert bodies.holds(data)
    rendered = (tmp_path / "bodies.md").read_text()
    assert "**Held:** all 48 requests ended as they should; none hung." in rendered
    stored = json.loads((tmp_path / "bodies.json").read_text())
    assert bodies.render(stored) == rendered
