import pytest

from extproc.bench.wrk import parse

OUTPUT = """Running 2s test @ http://127.0.0.1:1/v1/chat/completions
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     9.79ms    3.00ms  40.00ms   80.00%
  Latency Distribution
     50%    9.79ms
     75%   12.00ms
     90%  850.00us
     99%    1.20s
  3002 requests in 2.00s, 1.00MB read
  Socket errors: connect 0, read 1, write 0, timeout 2
  Non-2xx or 3xx responses: 4
Requests/sec:   1501.00
Transfer/sec:      0.50MB
"""


def test_parse_reads_percentiles_in_any_unit_and_counts_errors():
    result = parse(OUTPUT)
    assert result.p50_ms == pytest.approx(9.79)
    assert result.p90_ms == pytest.approx(0.85)
    assert result.p99_ms == pytest.approx(1200.0)
    assert result.requests_per_s == pytest.approx(1501.0)
    assert result.requests == 3002
    assert result.errors == 7


def test_parse_rejects_output_without_a_report():
    with pytest.raises(ValueError, match="unparseable"):
        parse("wrk: connection refused")
