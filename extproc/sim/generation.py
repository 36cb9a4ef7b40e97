"""When each output token of a simulated request is due: fixed delays, or the engine model.

A handler starts a `Generation`, awaits `next_token()` per streamed token (or `next_token()`
then `rest()` for a whole response), reads `cached` once the first token is out, and always
calls `close()`, which also runs when a client abort cancels the handler.

`end_step`, called where an engine step ends (each step of the engine model; a request's
start and its end under fixed timing), is where the instance publishes the KV-cache events
the step recorded (events.py); a no-op without events.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol

import structlog

from extproc.sim.cache import CacheResult, PrefixCache
from extproc.sim.engine import Engine, EngineRequest
from extproc.sim.metrics import SimMetrics

log = structlog.get_logger(__name__)


def _no_step_end() -> None:
    pass


class Generation(Protocol):
    @property
    def cached(self) -> CacheResult:
        """Prompt and cache-hit tokens; final once the first token is out."""
        ...

    async def next_token(self) -> None: ...

    async def rest(self) -> None:
        """Wait for every token not yet waited for."""
        ...

    def close(self) -> None: ...


def _cached(request: EngineRequest) -> CacheResult:
    return CacheResult(request.prompt_tokens, request.hit_tokens)


async def _pause(delay_s: float) -> None:
    # Skipping zero delays keeps the fast path free of scheduler round trips.
    if delay_s > 0:
        await asyncio.sleep(delay_s)


class FixedGeneration:
    """The first token after ttft, each further one after itl; the cache is hit at once."""

    def __init__(
        self,
        cache: PrefixCache,
        metrics: SimMetrics,
        prompt: str,
        max_tokens: int,
        ttft_s: float,
        itl_s: float,
        output: str = "",
        salt: str | None = None,
        end_step: Callable[[], None] = _no_step_end,
    ) -> None:
        self._metrics = metrics
        self._left = max_tokens
        self._started = False
        self._ttft_s = ttft_s
        self._itl_s = itl_s
        metrics.request_started()
        self.cached = cache.lookup_and_insert(prompt, salt)
        end_step()
        metrics.prompt_processed(self.cached)
        self._cache = cache
        self._prompt = prompt
        self._output = output
        self._salt = salt
        self._end_step = end_step

    async def next_token(self) -> None:
        await _pause(self._itl_s if self._started else self._ttft_s)
        self._started = True
        self._left -= 1
        self._metrics.tokens_generated(1)

    async def rest(self) -> None:
        left, self._left = self._left, 0
        # One sleep for the lot, as fixed timing always did.
        await _pause(self._itl_s * left)
        self._metrics.tokens_generated(left)

    def close(self) -> None:
        # What was generated stays cached, as in vLLM: all of it once the request is done.
        done = len(self._output) if self._left == 0 else 0
        if done:
            self._cache.insert_output(self._prompt, self._output[:done], self._salt)
            self._end_step()
        self._metrics.request_ended()


class ModelledGeneration:
    """Tokens as the instance's engine model emits them."""

    def __init__(self, driver: EngineDriver, request: EngineRequest) -> None:
        self._driver = driver
        self._request = request
        self._tokens: asyncio.Queue[None] = asyncio.Queue()
        self._taken = 0

    @property
    def cached(self) -> CacheResult:
        return _cached(self._request)

    def deliver(self) -> None:
        self._tokens.put_nowait(None)

    async def next_token(self) -> None:
        await self._tokens.get()
        self._taken += 1

    async def rest(self) -> None:
        for _ in range(self._request.max_tokens - self._taken):
            await self.next_token()

    def close(self) -> None:
        self._driver.forget(self._request)


class EngineDriver:
    """Runs one instance's engine in real time: one step loop, tokens to waiting handlers."""

    def __init__(
        self, engine: Engine, metrics: SimMetrics, end_step: Callable[[], None] = _no_step_end
    ) -> None:
        self.engine = engine
        self._metrics = metrics
        self._end_step = end_step
        self._generations: dict[EngineRequest, ModelledGeneration] = {}
        self._wakeup = asyncio.Event()
        metrics.follow_engine(lambda: engine.num_running, lambda: engine.num_waiting)

    def start(
        self, prompt: str, max_tokens: int, output: str = "", salt: str | None = None
    ) -> ModelledGeneration:
        """Submit a request now that will generate ``output``; ValueError when it could never
        fit the KV cache."""
        now = asyncio.get_running_loop().time()
        request = self.engine.submit(prompt, max_tokens, now, output, salt)
        generation = ModelledGeneration(self, request)
        self._generations[request] = generation
        self._wakeup.set()
        return generation

    def forget(self, request: EngineRequest) -> None:
        """The handler is done: abort the request if unfinished, freeing its blocks and slot."""
        self._generations.pop(request, None)
        if not request.finished:
            self.engine.abort(request)
            self._wakeup.set()  # freed room may let a waiting request in

    async def run(self) -> None:
        """The step loop; runs until cancelled when the instance shuts down."""
        loop = asyncio.get_running_loop()
        clock = loop.time()
        while True:  # one engine step, or one idle wait, per pass
            batch = self.engine.schedule(clock)
            if batch is None:
                # What aborts changed since the last step goes out before the engine idles.
                self._end_step()
                await self._idle(loop)
                clock = loop.time()
                continue
            for request in batch.admitted:
                self._metrics.prompt_processed(_cached(request))
            await asyncio.sleep(max(0.0, batch.ends_at - loop.time()))
            emitted = self.engine.complete(batch)
            self._end_step()
            self._metrics.tokens_generated(len(emitted))
            for request in emitted:
                generation = self._generations.get(request)
                if generation is not None:
                    generation.deliver()
            # The model's clock, not the wall's: a late wake-up must not slow the engine.
            clock = batch.ends_at

    async def _idle(self, loop: asyncio.AbstractEventLoop) -> None:
        # No await since schedule() returned None, so no submit can have been missed.
        self._wakeup.clear()
        ready_at = self.engine.next_ready_at()
        delay = None if ready_at is None else max(0.0, ready_at - loop.time())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._wakeup.wait()


def log_driver_exit(task: asyncio.Task[None]) -> None:
    """Done-callback: a step loop that dies would stall every request on its instance."""
    if not task.cancelled() and task.exception() is not None:
        log.error("sim.engine_failed", error=repr(task.exception()))
