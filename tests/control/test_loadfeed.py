import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping

import httpx
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler
from hypothesis import given
from hypothesis import strategies as st

from extproc.control.loadfeed import (
    LoadFeedError,
    LoadFeedPolicy,
    LoadScraper,
    parse_vllm_metrics,
    scrape,
)
from extproc.control.model import HostLoad
from extproc.errors import RouterError
from extproc.http_client import host_client
from extproc.sim.server import SimOptions, serve
from extproc.stack.processes import free_port

# Loopback addresses of their own keep these tests clear of other suites' ports.
SIM_HOST = "127.0.0.41"
OTHER_HOST = "127.0.0.42"

# Shaped like vLLM V1's /metrics: two models on one engine plus a second engine, HELP and
# TYPE lines, `_created` samples, and histograms and metrics the feed ignores.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_running{engine="0",model_name="sql-lora"} 1.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 4.0
vllm:num_requests_waiting{engine="0",model_name="sql-lora"} 0.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.42
vllm:kv_cache_usage_perc{engine="0",model_name="sql-lora"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.75
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1000.0
vllm:prefix_cache_queries_total{engine="0",model_name="sql-lora"} 200.0
vllm:prefix_cache_queries_total{engine="1",model_name="meta-llama/Llama-3.1-8B"} 300.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.7e+09
vllm:prefix_cache_queries_created{engine="0",model_name="sql-lora"} 1.7e+09
vllm:prefix_cache_queries_created{engine="1",model_name="meta-llama/Llama-3.1-8B"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="sql-lora"} 16.0
vllm:prefix_cache_hits_total{engine="1",model_name="meta-llama/Llama-3.1-8B"} 64.0
# HELP vllm:prefix_cache_hits_created Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.7e+09
vllm:prefix_cache_hits_created{engine="0",model_name="sql-lora"} 1.7e+09
vllm:prefix_cache_hits_created{engine="1",model_name="meta-llama/Llama-3.1-8B"} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="sql-lora"} 5.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="sql-lora"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="sql-lora"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="sql-lora"} 0.9
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="sql-lora"} 9999.0
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
"""


@contextlib.asynccontextmanager
async def simulator(host: str) -> AsyncIterator[str]:
    port = free_port(host)
    ready = asyncio.Event()
    server = asyncio.create_task(serve([(host, port)], SimOptions(), ready))
    try:
        async with asyncio.timeout(10):
            await ready.wait()
        yield f"{host}:{port}"
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


@contextlib.asynccontextmanager
async def metrics_server(host: str, answer: Handler) -> AsyncIterator[str]:
    """A host whose /metrics is `answer`."""
    app = web.Application()
    app.router.add_get("/metrics", answer)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    port = free_port(host)
    try:
        await web.TCPSite(runner, host, port).start()
        yield f"{host}:{port}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def hung_metrics_server(host: str) -> AsyncIterator[str]:
    """A host whose /metrics never answers until the test is done with it."""
    release = asyncio.Event()

    async def hang(_: web.Request) -> web.Response:
        async with asyncio.timeout(10):
            await release.wait()
        return web.Response(text="")

    try:
        async with metrics_server(host, hang) as address:
            yield address
    finally:
        release.set()


async def send_chat(client: httpx.AsyncClient, address: str, content: str) -> None:
    body = {"model": "sim-model", "messages": [{"role": "user", "content": content}]}
    response = await client.post(f"http://{address}/v1/chat/completions", json=body)
    assert response.status_code == 200


# --- policy ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"interval_s": 0}, "interval_s"),
        ({"interval_s": float("nan")}, "interval_s"),
        ({"timeout_s": "0.1"}, "timeout_s"),
        ({"interval_s": 0.1, "timeout_s": 0.2}, "timeout_s"),
    ],
)
def test_policy_rejects_out_of_range_values(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}=.*allowed"):
        LoadFeedPolicy(**overrides)


# --- parsing --------------------------------------------------------------------------


def test_parse_sums_label_sets_and_takes_the_max_kv_usage() -> None:
    load = parse_vllm_metrics(VLLM_METRICS, scraped_at=12.5)
    assert load == HostLoad(
        running=6.0,
        waiting=5.0,
        kv_cache_usage=0.75,
        prefix_cache_queries=1500.0,
        prefix_cache_hits=720.0,
        scraped_at=12.5,
    )
    assert load.outstanding == 11.0


def test_parse_accepts_counters_without_type_lines_or_total_suffix() -> None:
    untyped = 'vllm:prefix_cache_queries_total{model_name="a"} 10\nvllm:prefix_cache_hits 4\n'
    load = parse_vllm_metrics(untyped, scraped_at=0.0)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (10.0, 4.0)


def test_missing_metrics_count_as_zero() -> None:
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2\n"
    assert parse_vllm_metrics(text, scraped_at=1.0) == HostLoad(running=2.0, scraped_at=1.0)
    assert parse_vllm_metrics("", scraped_at=1.0) == HostLoad(scraped_at=1.0)


@pytest.mark.parametrize(
    "text",
    [
        "<html>502 Bad Gateway</html>",
        'vllm:num_requests_running{model_name="a} 1\n',
        "vllm:num_requests_running one\n",
        "vllm:num_requests_running NaN\n",
    ],
)
def test_malformed_text_raises_load_feed_error(text: str) -> None:
    with pytest.raises(LoadFeedError) as caught:
        parse_vllm_metrics(text, scraped_at=0.0)
    assert isinstance(caught.value, RouterError)
    assert str(caught.value)


@given(st.text(max_size=200))
def test_parse_never_fails_with_anything_but_load_feed_error(text: str) -> None:
    with contextlib.suppress(LoadFeedError):
        parse_vllm_metrics(text, scraped_at=0.0)


# --- scraping -------------------------------------------------------------------------


async def test_scrape_of_a_simulator_sees_prefix_cache_hits() -> None:
    # Two identical prompts of several whole cache blocks: the second one hits.
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    async with simulator(SIM_HOST) as address, host_client() as client:
        for _ in range(2):
            await send_chat(client, address, prompt)
        load = await scrape(client, address, timeout_s=2, clock=lambda: 42.0)
    assert load.prefix_cache_hits > 0
    assert load.prefix_cache_queries > load.prefix_cache_hits
    assert 0 < load.kv_cache_usage <= 1
    assert load.running == 0
    assert load.scraped_at == 42.0


async def test_scrape_of_a_dead_host_raises_load_feed_error() -> None:
    async with host_client() as client:
        with pytest.raises(LoadFeedError, match="metrics failed: ConnectError"):
            await scrape(client, f"{OTHER_HOST}:{free_port(OTHER_HOST)}", timeout_s=1)


async def test_scrape_needs_a_2xx_answer() -> None:
    async def unavailable(_: web.Request) -> web.Response:
        return web.Response(status=503, text=VLLM_METRICS)

    async with metrics_server(SIM_HOST, unavailable) as address, host_client() as client:
        with pytest.raises(LoadFeedError, match="/metrics answered HTTP 503"):
            await scrape(client, address, timeout_s=2)


async def test_scrape_follows_no_redirect() -> None:
    async def elsewhere(_: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("/metrics/")

    async with metrics_server(SIM_HOST, elsewhere) as address, host_client() as client:
        with pytest.raises(LoadFeedError, match="/metrics answered HTTP 301"):
            await scrape(client, address, timeout_s=2)


@pytest.mark.parametrize(
    ("body", "charset"),
    [
        # Valid text but for one byte, in a comment the parser would skip.
        (b"# HELP \xff\n" + VLLM_METRICS.encode(), None),
        (b"vllm:num_requests_running 1\n\xe9\n", "utf-8"),
    ],
)
async def test_a_body_that_is_not_text_of_its_charset_raises_load_feed_error(
    body: bytes, charset: str | None
) -> None:
    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=body, content_type="text/plain", charset=charset)

    async with metrics_server(SIM_HOST, answer) as address, host_client() as client:
        with pytest.raises(LoadFeedError, match="UnicodeDecodeError"):
            await scrape(client, address, timeout_s=2)


async def test_a_body_in_the_charset_it_names_is_read() -> None:
    async def latin1(_: web.Request) -> web.Response:
        text = "# HELP vllm:num_requests_running caf\u00e9\nvllm:num_requests_running 2\n"
        return web.Response(
            body=text.encode("latin-1"), content_type="text/plain", charset="latin-1"
        )

    async with metrics_server(SIM_HOST, latin1) as address, host_client() as client:
        assert (await scrape(client, address, timeout_s=2)).running == 2.0


async def test_a_timed_out_scrape_says_so() -> None:
    async with hung_metrics_server(OTHER_HOST) as hung, host_client() as client:
        with pytest.raises(LoadFeedError, match=r"timed out after 0\.1 s"):
            await scrape(client, hung, timeout_s=0.1)


async def test_scrape_once_leaves_out_and_counts_a_dead_host() -> None:
    scraper = LoadScraper(LoadFeedPolicy(timeout_s=0.2))
    dead = f"{OTHER_HOST}:{free_port(OTHER_HOST)}"
    async with simulator(SIM_HOST) as address:
        loads = await scraper.scrape_once([address, dead])
    assert set(loads) == {address}
    assert scraper.failures == 1


async def test_a_hung_host_costs_only_its_own_timeout() -> None:
    policy = LoadFeedPolicy(interval_s=0.25, timeout_s=0.2)
    scraper = LoadScraper(policy)
    async with simulator(SIM_HOST) as address, hung_metrics_server(OTHER_HOST) as hung:
        started = time.monotonic()
        loads = await scraper.scrape_once([hung, address])
        elapsed = time.monotonic() - started
    assert set(loads) == {address}
    assert scraper.failures == 1
    assert elapsed < policy.timeout_s + 0.3


async def test_run_feeds_each_round_and_stops_promptly() -> None:
    ticks = iter(range(1000))
    scraper = LoadScraper(LoadFeedPolicy(interval_s=0.2, timeout_s=0.2), clock=lambda: next(ticks))
    rounds: list[Mapping[str, HostLoad]] = []
    stop = asyncio.Event()

    def on_loads(loads: Mapping[str, HostLoad]) -> None:
        rounds.append(loads)
        if len(rounds) == 3:
            stop.set()

    async with simulator(SIM_HOST) as address:
        async with asyncio.timeout(5):
            await scraper.run(lambda: [address], on_loads, stop)
    assert len(rounds) == 3
    assert all(set(loads) == {address} for loads in rounds)
    # Each round is stamped by the injected clock.
    assert [loads[address].scraped_at for loads in rounds] == [0, 1, 2]


async def test_run_scrapes_a_host_over_one_connection_round_after_round() -> None:
    connections: set[object] = set()

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        connections.add(request.transport.get_extra_info("peername"))
        return web.Response(text=VLLM_METRICS)

    scraper = LoadScraper(LoadFeedPolicy(interval_s=0.05, timeout_s=0.05))
    rounds: list[Mapping[str, HostLoad]] = []
    stop = asyncio.Event()

    def on_loads(loads: Mapping[str, HostLoad]) -> None:
        rounds.append(loads)
        if len(rounds) == 3:
            stop.set()

    async with metrics_server(SIM_HOST, answer) as address:
        async with asyncio.timeout(5):
            await scraper.run(lambda: [address], on_loads, stop)
    assert all(loads[address].running == 6.0 for loads in rounds)
    assert len(connections) == 1


async def test_run_closes_its_client() -> None:
    clients: list[httpx.AsyncClient] = []

    def factory() -> httpx.AsyncClient:
        clients.append(host_client())
        return clients[-1]

    stop = asyncio.Event()
    scraper = LoadScraper(LoadFeedPolicy(), client_factory=factory)
    await scraper.run(lambda: [], lambda _: stop.set(), stop)
    assert len(clients) == 1
    assert clients[0].is_closed


async def test_run_stops_during_a_long_interval() -> None:
    scraper = LoadScraper(LoadFeedPolicy(interval_s=30, timeout_s=0.2))
    fed = asyncio.Event()
    stop = asyncio.Event()
    runner = asyncio.create_task(scraper.run(lambda: [], lambda _: fed.set(), stop))
    async with asyncio.timeout(5):
        await fed.wait()
    stop.set()
    started = time.monotonic()
    async with asyncio.timeout(5):
        await runner
    assert time.monotonic() - started < 0.5


def test_cache_config_info_gives_the_kv_cache_size_summed_over_engines():
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
        'num_gpu_blocks="1700",num_gpu_blocks_override="None"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1300"} 1.0\n'
    )
    assert parse_vllm_metrics(text, 0.0).cache_capacity_tokens == (1700 + 1300) * 16


def test_a_cache_config_without_a_block_count_is_unknown_not_an_error():
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert parse_vllm_metrics(text, 0.0).cache_capacity_tokens == 0.0
    assert parse_vllm_metrics("", 0.0).cache_capacity_tokens == 0.0
