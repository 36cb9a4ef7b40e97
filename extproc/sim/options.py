"""Options of the simulated vLLM instances; light to import, so the CLI can show defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from extproc import ports
from extproc.sim.engine import EngineConfig

Timing = Literal["fixed", "model"]
# vLLM's API server closes a connection idle this long (VLLM_HTTP_TIMEOUT_KEEP_ALIVE).
VLLM_KEEPALIVE_S = 5.0
# KV capacity when none is given: fixed timing keeps its historical size; the engine model
# holds about 20 8k-token prompts (see engine.py).
DEFAULT_CAPACITY_BLOCKS: dict[str, int] = {"fixed": 4096, "model": 10_000}
# vLLM's KV-event ports as this project runs vLLM (FIELD-NOTES: tcp://*:5557, replay 5558),
# defined once with the stack's other defaults.
KV_EVENTS_PORT = ports.KV_EVENTS
KV_EVENTS_REPLAY_PORT = ports.KV_EVENTS_REPLAY


@dataclass(frozen=True)
class SimOptions:
    """Behaviour shared by every simulated instance.

    timing "fixed" (the default) waits ttft_ms for the first token and itl_ms for each
    further one, whatever the load. timing "model" runs the engine model of engine.py,
    whose knobs are the fields from prefill_ms_per_token on; time_scale applies to both.

    kv_events publishes the cache's changes as vLLM's KV-cache events (see events.py) on
    kv_events_port, with replay on kv_events_replay_port, bound on each instance's own IP;
    0 picks a free port. Off by default: two simulators on one IP would both want the
    fixed ports, as two vLLMs on one host would (and the stacks, tests and compose file
    put several simulators on one IP).
    """

    model: str = "sim-model"
    capacity_blocks: int | None = None  # None: DEFAULT_CAPACITY_BLOCKS of the timing
    block_size_tokens: int = 16
    chars_per_token: int = 4
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    default_max_tokens: int = 16
    max_tokens_cap: int = 4096
    timing: Timing = "fixed"
    time_scale: float = EngineConfig.time_scale
    prefill_ms_per_token: float = EngineConfig.prefill_ms_per_token
    decode_ms_per_token: float = EngineConfig.decode_ms_per_token
    step_overhead_ms: float = EngineConfig.step_overhead_ms
    request_overhead_ms: float = EngineConfig.request_overhead_ms
    attention_ms_per_kv_token: float = EngineConfig.attention_ms_per_kv_token
    max_batched_tokens: int = EngineConfig.max_batched_tokens
    max_num_seqs: int = EngineConfig.max_num_seqs
    # Seconds an idle client connection stays open, as vLLM's keep-alive.
    keepalive_s: float = VLLM_KEEPALIVE_S
    kv_events: bool = False
    kv_events_port: int = KV_EVENTS_PORT
    kv_events_replay_port: int = KV_EVENTS_REPLAY_PORT

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        if self.timing not in DEFAULT_CAPACITY_BLOCKS:
            raise ValueError(f"timing must be 'fixed' or 'model', got {self.timing!r}")
        if self.capacity_blocks is None:
            # Frozen: resolve the default the one way a dataclass allows.
            object.__setattr__(self, "capacity_blocks", DEFAULT_CAPACITY_BLOCKS[self.timing])
        for name in (
            "capacity_blocks",
            "block_size_tokens",
            "chars_per_token",
            "default_max_tokens",
            "max_tokens_cap",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("ttft_ms", "itl_ms", "keepalive_s"):
            value = getattr(self, name)
            valid = isinstance(value, int | float) and not isinstance(value, bool)
            if not valid or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.kv_events, bool):
            raise ValueError(f"kv_events must be true or false, got {self.kv_events!r}")
        for name in ("kv_events_port", "kv_events_replay_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
                raise ValueError(f"{name} must be an integer from 0 to 65535, got {value!r}")
        if self.kv_events_port and self.kv_events_port == self.kv_events_replay_port:
            raise ValueError(
                f"kv_events_port and kv_events_replay_port must differ, both are "
                f"{self.kv_events_port}"
            )
        if self.timing == "model" and (self.ttft_ms or self.itl_ms):
            raise ValueError("ttft_ms and itl_ms apply to timing 'fixed' only")
        self.engine_config()  # validates the model's knobs, by name

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            prefill_ms_per_token=self.prefill_ms_per_token,
            decode_ms_per_token=self.decode_ms_per_token,
            step_overhead_ms=self.step_overhead_ms,
            request_overhead_ms=self.request_overhead_ms,
            attention_ms_per_kv_token=self.attention_ms_per_kv_token,
            max_batched_tokens=self.max_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            time_scale=self.time_scale,
        )

    def scaled_s(self, ms: float) -> float:
        """A modelled duration in ms as wall seconds, after time_scale."""
        return ms * self.time_scale / 1000
