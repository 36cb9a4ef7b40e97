"""What serving one bench request does to a simulated instance's prefix cache, as the
simulator does it: the chat prompt is looked up, then its blocks and those of the reply it
generates are cached (vLLM keeps generated blocks too, so a conversation's next turn hits
them). Shared by the offline placement model and the hit-rate ceiling."""

from __future__ import annotations

from extproc.bench.workloads import BenchRequest
from extproc.sim.cache import CacheResult, PrefixCache
from extproc.sim.options import SimOptions
from extproc.sim.prompt import prompt_text
from extproc.sim.responses import reply_text


def prompt_of(request: BenchRequest) -> str:
    """The prompt text the simulated model sees for ``request``."""
    return prompt_text("chat", request.body)


def output_tokens(request: BenchRequest) -> int:
    """How many tokens the simulator generates for ``request`` (it always hits max_tokens)."""
    return int(request.body.get("max_tokens", SimOptions.default_max_tokens))


def reply_of(request: BenchRequest, chars_per_token: int) -> str:
    """The reply the simulator generates for ``request``."""
    return reply_text(output_tokens(request), chars_per_token)


def serve(cache: PrefixCache, request: BenchRequest) -> CacheResult:
    """Look ``request``'s prompt up in ``cache``, then cache what serving it computes."""
    prompt = prompt_of(request)
    result = cache.lookup_and_insert(prompt)
    cache.insert_output(prompt, reply_of(request, cache.chars_per_token))
    return result
