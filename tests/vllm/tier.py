"""What the real-vLLM tier runs in CI: the report's scenarios but many-documents, with
two router workers (the stored report, docs/benchmarks/real-vllm-cpu.md, has
many-documents and four workers too; each path here adds about 30 s of CI)."""

from __future__ import annotations

TIER_SCENARIOS = ("documents", "rag", "conversations")
TIER_WORKERS = (2,)
