"""Timing model of one vLLM instance: continuous batching over a prefix-cached, paged KV cache.

Pure and deterministic: the caller passes the clock in (seconds, any origin) and sleeps the
durations it gets back; nothing here awaits or reads a clock. `server.py` drives it.

One engine step, after vLLM V1's scheduler:

1. Running requests, in admission order, take one token each if decoding, or the next
   chunk of their uncached prompt (chunked prefill), while the step's token budget
   (`max_batched_tokens`) lasts.
2. Waiting requests join first come, first served, while budget and sequence slots
   (`max_num_seqs`) last and their KV blocks fit. A head that does not fit waits and holds
   back those behind it, as in vLLM.
3. The step lasts `step_overhead_ms + max(decode_ms_per_token, prefill_ms_per_token x
   tokens) + attention_ms_per_kv_token x kv_tokens`, times `time_scale`: a forward pass
   reads all weights once, a memory-bound floor that a lone decode token pays, and spends
   compute per token, which a long prefill pays; on top, every decoding sequence reads the
   KV of its whole context (`kv_tokens` sums prompt plus output so far over the decoding
   sequences of the step). So prefill cost is proportional to the uncached tokens, batching
   pays (the weights are read once per step), but a step slows as the batch and its contexts
   grow, and an instance has a finite decode throughput: one that receives more than it
   can serve queues. Attention of prefill chunks is folded into `prefill_ms_per_token`, so
   an idle instance's TTFT (the calibration below) does not depend on this term.
4. At its end a request whose prefill completed emits its first token (its TTFT), each
   decoding request its next one; those at max_tokens finish and release their blocks.

Calibrated defaults. Reference: Llama-3.3-70B, one instance on 8xH100, as in the
PREFIX_AWARE routing benchmark of AWS's "Managed Tiered KV Cache and Intelligent Routing for
Amazon SageMaker HyperPod" (Nov 2025): TTFT about 270 ms for an uncached 8k-token prompt and
about 60 ms when that prompt is cached, on an idle instance (figures as this project reads
that benchmark; 8k is taken as 8000 tokens, one step's budget).

- `decode_ms_per_token` 25 and `step_overhead_ms` 5: 30 ms between tokens at low load,
  inside the 25-35 ms usually measured for 70B-class models on vLLM. The overhead is the
  per-step CPU work (scheduling, sampling, output processing) V1 keeps to a few ms.
- `request_overhead_ms` 30: a cached 8k prompt still runs one forward pass, since vLLM
  recomputes its last block: 5 + 25 = 30 ms of engine time. The other 30 ms of the published
  60 ms is per-request work outside the engine (HTTP, chat template, tokenising 8k tokens,
  IPC to the engine core, streaming back, the network). It delays entry to the queue but
  occupies no step.
- `prefill_ms_per_token` 0.0294: (270 - 30 - 5) ms / 8000 tokens. About 34k tokens/s,
  i.e. 4.8 PFLOP/s at 2 x 70e9 FLOP per token across 8 H100s: ~60 % of dense BF16 peak,
  plausible for large prefills.
- `attention_ms_per_kv_token` 2e-5: Llama-3.3-70B keeps 320 KiB of KV per token in BF16
  (80 layers x 8 KV heads x 128 dims x K and V x 2 bytes), and a decode step reads all of
  it for every sequence. At ~16 TB/s (60 % of 8 x 3.35 TB/s of H100 HBM) that is 2e-5 ms per
  context token: 0.16 ms per step for each decoding sequence of an 8k-token context, so 64
  such sequences stretch a 30 ms step to ~40 ms, the rise of inter-token latency with
  concurrency that vLLM benchmarks show.
- `max_batched_tokens` 8192 and `max_num_seqs` 256: vLLM's online-serving token budget and
  its long-standing sequence limit (recent releases allow 1024 sequences on 80 GB GPUs).
- KV capacity (SimOptions, 10,000 blocks of 16 tokens): about 20 8k prompts. Deliberately
  small; a real instance holds ~1.2M tokens (320 KiB per token in BF16, ~400 GB free), and
  a smaller cache lets fleet benchmarks with modest working sets reach eviction.

`time_scale` multiplies every modelled duration (steps and the request overhead): 0.1 runs
ten times faster than real time, to fit long scenarios into short benchmarks. To keep the
same modelled load, multiply arrival rates by 1/time_scale; divide measured latencies by
time_scale to compare with the reference. Below ~0.1, event-loop jitter (about a
millisecond per step on a small machine) starts to show against 3 ms steps.

Generated output is prefix-cached as in vLLM: when a request ends, the full blocks of its
prompt plus the output it computed (every token but the last sampled one) stay cached, so
the next turn of a conversation, which resends the reply, hits them.

Simplifications: no preemption (a request reserves blocks for prompt + max_tokens when
admitted, so it never runs out mid-decode); a prompt's new blocks become hits for later
requests from admission on (V1 registers them when it schedules them), its output's blocks
only once it ends.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from extproc.sim.cache import PrefixCache

RequestState = Literal["arriving", "waiting", "running", "finished", "aborted"]


def _require_duration(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _require_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Cost and capacity knobs of the model; see the module docstring for the defaults."""

    prefill_ms_per_token: float = 0.0294
    decode_ms_per_token: float = 25.0
    step_overhead_ms: float = 5.0
    request_overhead_ms: float = 30.0
    attention_ms_per_kv_token: float = 2e-5
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in (
            "prefill_ms_per_token",
            "decode_ms_per_token",
            "step_overhead_ms",
            "request_overhead_ms",
            "attention_ms_per_kv_token",
            "time_scale",
        ):
            _require_duration(name, getattr(self, name))
        for name in ("max_batched_tokens", "max_num_seqs"):
            _require_count(name, getattr(self, name))

    def step_seconds(self, tokens: int, kv_tokens: int = 0) -> float:
        """Wall time of one step computing `tokens` tokens (prefill chunks and decodes) whose
        decoding sequences hold `kv_tokens` tokens of context between them."""
        forward_ms = max(self.decode_ms_per_token, self.prefill_ms_per_token * tokens)
        attention_ms = self.attention_ms_per_kv_token * kv_tokens
        return (self.step_overhead_ms + forward_ms + attention_ms) * self.time_scale / 1000

    @property
    def request_overhead_s(self) -> float:
        return self.request_overhead_ms * self.time_scale / 1000


@dataclass(eq=False)
class EngineRequest:
    """One request's progress; compared by identity, so it can key a dict."""

    prompt_tokens: int
    max_tokens: int
    block_hashes: list[int]  # the prompt's full blocks: shared and prefix-cached
    private_blocks: int  # partial last block and room for the output: never shared
    ready_at: float  # when the front end hands it to the engine
    # Full blocks past the prompt's once the whole output is computed; cached at the end.
    output_hashes: list[int] = field(default_factory=list)
    # What block_hashes and output_hashes were hashed from (the prompt, then the output but
    # its last token) and the request's cache_salt: for the cache's listener.
    text: str = ""
    salt: str | None = None
    state: RequestState = "arriving"
    hit_tokens: int = 0  # known once admitted
    prefill_left: int = 0
    output_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.state == "finished"


@dataclass(frozen=True)
class Batch:
    """One scheduled step: who computes how many tokens, from when, for how long."""

    started_at: float
    duration_s: float
    work: tuple[tuple[EngineRequest, int], ...]
    admitted: tuple[EngineRequest, ...] = field(default=())

    @property
    def ends_at(self) -> float:
        return self.started_at + self.duration_s


class Engine:
    """The scheduler and cost model of one instance, over its `PrefixCache`.

    Call `schedule` and then `complete` for each step, strictly alternating.
    """

    def __init__(self, config: EngineConfig, cache: PrefixCache) -> None:
        self.config = config
        self.cache = cache
        self._arriving: deque[EngineRequest] = deque()  # in the front end, by ready_at
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []  # admission order
        self._in_flight: Batch | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def kv_usage(self) -> float:
        """vLLM's kv_cache_usage_perc: cached blocks no request holds count as free."""
        return self.cache.blocks_referenced / self.cache.capacity_blocks

    def submit(
        self,
        prompt: str,
        max_tokens: int,
        now: float,
        output: str = "",
        salt: str | None = None,
    ) -> EngineRequest:
        """Queue a request arriving at `now` that will generate `output`, its blocks hashed
        with `salt` (vLLM's cache_salt); ValueError if it could never fit the cache."""
        _require_count("max_tokens", max_tokens)
        cache = self.cache
        prompt_tokens = cache.query_tokens(prompt)
        text = cache.sequence_text(prompt, output) if output else prompt
        # The prompt's blocks are the leading ones of the whole sequence's chain.
        sequence_hashes = cache.block_hashes(text, salt)
        hashes = sequence_hashes[: len(prompt) // cache.block_chars]
        blocks = -(-(prompt_tokens + max_tokens) // cache.block_size_tokens)
        if blocks > cache.capacity_blocks:
            raise ValueError(
                f"{prompt_tokens} prompt tokens plus max_tokens {max_tokens} need {blocks} "
                f"KV blocks; this instance has {cache.capacity_blocks}"
            )
        request = EngineRequest(
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            block_hashes=hashes,
            private_blocks=blocks - len(hashes),
            ready_at=now + self.config.request_overhead_s,
            output_hashes=sequence_hashes[len(hashes) :],
            text=text,
            salt=salt,
        )
        self._arriving.append(request)
        return request

    def next_ready_at(self) -> float | None:
        """When an idle engine next has work: the next arrival's entry, if any."""
        return self._arriving[0].ready_at if self._arriving else None

    def schedule(self, now: float) -> Batch | None:
        """Plan the step starting at `now`; None when there is nothing to run."""
        if self._in_flight is not None:
            raise RuntimeError("complete the step in flight before scheduling another")
        while self._arriving and self._arriving[0].ready_at <= now:
            request = self._arriving.popleft()
            request.state = "waiting"
            self._waiting.append(request)

        budget = self.config.max_batched_tokens
        work: list[tuple[EngineRequest, int]] = []
        kv_tokens = 0  # context the decoding sequences read
        for request in self._running:
            if budget == 0:
                break
            if request.prefill_left:
                tokens = min(request.prefill_left, budget)
            else:
                tokens = 1
                kv_tokens += request.prompt_tokens + request.output_tokens
            work.append((request, tokens))
            budget -= tokens

        admitted: list[EngineRequest] = []
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            request = self._waiting[0]
            if not self._allocate(request):
                break  # the head waits for blocks; nobody overtakes it
            self._waiting.popleft()
            request.state = "running"
            self._running.append(request)
            admitted.append(request)
            tokens = min(request.prefill_left, budget)
            work.append((request, tokens))
            budget -= tokens

        if not work:
            return None
        total = self.config.max_batched_tokens - budget
        duration = self.config.step_seconds(total, kv_tokens)
        batch = Batch(now, duration, tuple(work), tuple(admitted))
        self._in_flight = batch
        return batch

    def complete(self, batch: Batch) -> list[EngineRequest]:
        """Apply a step's results; returns the requests that emitted a token in it."""
        if batch is not self._in_flight:
            raise RuntimeError("complete() takes the batch the last schedule() returned")
        self._in_flight = None
        emitted: list[EngineRequest] = []
        for request, tokens in batch.work:
            if request.state != "running":
                continue  # aborted during the step
            if request.prefill_left:
                request.prefill_left -= tokens
                if request.prefill_left:
                    continue  # more prompt chunks to go
            request.output_tokens += 1
            emitted.append(request)
            if request.output_tokens == request.max_tokens:
                self._retire(request, "finished")
        return emitted

    def abort(self, request: EngineRequest) -> None:
        """Drop a request wherever it is, releasing its blocks and slot; idempotent."""
        if request.state == "arriving":
            self._arriving.remove(request)
        elif request.state == "waiting":
            self._waiting.remove(request)
        elif request.state == "running":
            self._retire(request, "aborted")
            return
        else:
            return
        request.state = "aborted"

    def _allocate(self, request: EngineRequest) -> bool:
        block = self.cache.block_size_tokens
        cached_blocks = self.cache.cached_prefix_blocks(request.block_hashes)
        # vLLM always computes the last prompt token, so a fully cached prompt
        # recomputes its last block.
        hit_blocks = min(cached_blocks, max(0, (request.prompt_tokens - 1) // block))
        if not self.cache.acquire(
            request.block_hashes, request.private_blocks, request.text, request.salt
        ):
            return False
        request.hit_tokens = hit_blocks * block
        request.prefill_left = max(1, request.prompt_tokens - request.hit_tokens)
        return True

    def _retire(self, request: EngineRequest, state: RequestState) -> None:
        self._running.remove(request)
        # Every token but the last sampled one has its KV computed; full blocks stay cached.
        computed = 0
        if not request.prefill_left:
            computed = request.prompt_tokens + request.output_tokens - 1
        full = computed // self.cache.block_size_tokens - len(request.block_hashes)
        self.cache.release(
            request.block_hashes,
            request.private_blocks,
            request.output_hashes[: max(0, full)],
            request.text,
            request.salt,
        )
        request.state = state
