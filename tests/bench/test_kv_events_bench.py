"""The KV-events cost benchmark, at smoke size: it mirrors every block it feeds, and its
report renders from the stored data alone."""

from __future__ import annotations

import json
from dataclasses import replace

from extproc.bench import kv_events
from extproc.bench.report import write_rendered


def test_a_smoke_run_mirrors_every_prompt_and_renders(tmp_path):
    options = replace(
        kv_events.KvEventsOptions(out_dir=None),
        iterations=20,
        ingest_prompts=6,
        ingest_prompt_chars=4096,
        rounds=1,
    )
    data = kv_events.run(options)
    by_decoder = {r["decoder"]: r for r in data["ingest"]}
    codepoints = by_decoder["simulator code points"]
    # Each prompt is its ChatML text, one token per character, cut into 16-token blocks:
    # every full engine block is stored, and the router blocks their text completes are held.
    text = len(kv_events.chatml("x" * 4096))
    assert codepoints["engine_blocks"] == 6 * (text // 16)
    assert codepoints["router_blocks"] >= 6 * (4096 // 512)
    assert by_decoder["byte-level BPE"]["router_blocks"] >= 6 * (4096 // 512)
    assert {c["mode"] for c in data["request_path"]} == {"approximate", "kv-events"}
    path = write_rendered(tmp_path, "kv-events", json.loads(json.dumps(data)))
    assert "share of a core at 100,000 blocks/s" in path.read_text()
