"""Simulated vLLM backend: prefix cache, OpenAI endpoints and vLLM metrics."""
