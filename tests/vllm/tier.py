"""What the real-vLLM tier runs in CI: the report's scenarios but many-documents, with
two router workers, and RANDOM on documents alone (the stored report,
docs/benchmarks/real-vllm-cpu.md, has many-documents, four workers and RANDOM on every
scenario too; each path here adds about 40 s of CI, both cores busy throughout)."""

from __future__ import annotations

TIER_SCENARIOS = ("documents", "rag", "conversations")
TIER_WORKERS = (2,)
TIER_RANDOM = ("documents",)
