"""What the real-vLLM tier runs in CI: the report's scenarios but many-documents (the
stored report, docs/benchmarks/real-vllm-cpu.md, has it), at every router worker count."""

from __future__ import annotations

TIER_SCENARIOS = ("documents", "rag", "conversations")
TIER_WORKERS = (2, 4)
