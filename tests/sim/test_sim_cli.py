"""`prefix-router sim`: its flags reach SimOptions, and --timing model runs the engine model."""

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from extproc import cli
from extproc.sim import server as sim_server
from extproc.sim.options import SimOptions
from extproc.stack.processes import free_port, tcp_open, wait_until

HOST = "127.0.0.1"


def parsed_options(monkeypatch: pytest.MonkeyPatch, *flags: str) -> SimOptions:
    seen: list[SimOptions] = []
    monkeypatch.setattr(sim_server, "run", lambda addresses, options: seen.append(options))
    assert cli.main(["sim", "--address", f"{HOST}:8000", *flags]) == 0
    [options] = seen
    return options


def test_defaults_keep_fixed_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parsed_options(monkeypatch) == SimOptions()
    options = parsed_options(monkeypatch, "--ttft-ms", "20", "--itl-ms", "5")
    assert (options.timing, options.ttft_ms, options.itl_ms) == ("fixed", 20.0, 5.0)


def test_model_flags_reach_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    options = parsed_options(
        monkeypatch,
        *("--timing", "model", "--time-scale", "0.1", "--prefill-ms-per-token", "0.05"),
        *("--decode-ms-per-token", "30", "--step-overhead-ms", "2"),
        *("--request-overhead-ms", "10", "--max-batched-tokens", "4096"),
        *("--attention-ms-per-kv-token", "0.001"),
        *("--max-num-seqs", "64", "--block-size", "32", "--capacity-blocks", "500"),
    )
    assert options == SimOptions(
        timing="model",
        time_scale=0.1,
        prefill_ms_per_token=0.05,
        decode_ms_per_token=30.0,
        step_overhead_ms=2.0,
        request_overhead_ms=10.0,
        attention_ms_per_kv_token=0.001,
        max_batched_tokens=4096,
        max_num_seqs=64,
        block_size_tokens=32,
        capacity_blocks=500,
    )
    assert parsed_options(monkeypatch, "--timing", "model") == SimOptions(timing="model")


def test_kv_event_flags_reach_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = parsed_options(monkeypatch)
    assert (defaults.kv_events, defaults.kv_events_port, defaults.kv_events_replay_port) == (
        False,
        5557,
        5558,
    )
    options = parsed_options(
        monkeypatch, "--kv-events", "--kv-events-port", "0", "--kv-events-replay-port", "7000"
    )
    assert options == SimOptions(kv_events=True, kv_events_port=0, kv_events_replay_port=7000)
    assert parsed_options(monkeypatch, "--kv-events", "--no-kv-events").kv_events is False


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--timing", "model", "--ttft-ms", "5"), "--ttft-ms applies to --timing fixed"),
        (("--max-num-seqs", "4"), "--max-num-seqs applies to --timing model"),
        (("--timing", "model", "--time-scale", "-1"), "time_scale"),
        (("--kv-events-port", "70000"), "kv_events_port must be an integer from 0 to 65535"),
        (("--kv-events-replay-port", "5557"), "must differ"),
    ],
)
def test_bad_flag_combinations_exit_2(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...],
    message: str,
) -> None:
    monkeypatch.setattr(sim_server, "run", lambda *_: pytest.fail("must not start"))
    assert cli.main(["sim", "--address", f"{HOST}:8000", *flags]) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err


@contextlib.contextmanager
def sim_process(*flags: str) -> Iterator[str]:
    port = free_port(HOST)
    command = [sys.executable, "-m", "extproc", "sim", "--address", f"{HOST}:{port}", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:

        def accepting() -> bool:
            assert proc.poll() is None, "the simulator exited"
            return tcp_open(HOST, port)

        wait_until(accepting, 20, "the simulator to accept a connection")
        yield f"http://{HOST}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def streamed_ttft(client: httpx.Client, base: str, prompt: str) -> float:
    body = {"prompt": prompt, "max_tokens": 2, "stream": True}
    began = time.monotonic()
    with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        next(chunks)
        ttft = time.monotonic() - began
        for _ in chunks:  # the rest of the stream, bounded by max_tokens
            pass
    return ttft


def test_timing_model_through_the_cli_streams_at_the_scaled_ttft() -> None:
    scale = 0.5
    defaults = SimOptions(timing="model")
    overhead_ms = defaults.request_overhead_ms + defaults.step_overhead_ms
    uncached_s = (overhead_ms + defaults.prefill_ms_per_token * 8000) / 1000 * scale
    cached_s = (overhead_ms + defaults.decode_ms_per_token) / 1000 * scale
    prompt = "c" * (8000 * 4)
    with (
        sim_process("--timing", "model", "--time-scale", str(scale)) as base,
        httpx.Client(timeout=30) as client,
    ):
        first = streamed_ttft(client, base, prompt)
        second = streamed_ttft(client, base, prompt)
        assert client.post(f"{base}/reset_prefix_cache").status_code == 200
        third = streamed_ttft(client, base, prompt)
    slack_s = 0.08  # a subprocess on a busy machine; latency only ever adds
    assert uncached_s * 0.98 <= first <= uncached_s + slack_s
    assert cached_s * 0.98 <= second <= cached_s + slack_s
    assert uncached_s * 0.98 <= third <= uncached_s + slack_s
