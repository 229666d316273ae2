"""The load test (``bench.load``) in CI: 16 clients against a tiny-preset server on the CPU
(a subprocess on a free loopback port, byte tokenizer, 64-token blocks, one batch shape),
mixed streaming / whole, completions / chat, shared prefixes, disconnects.

One load runs for the module; each test checks one property of its report, so that a
failure names what went wrong (the report's failures and wrong answers are in the message).
"""

import json

import pytest

# The GPU image lacks it; `make test-gpu` still collects this file.
pytest.importorskip("httpx")


from tiny_server import TINY_SERVER_ARGS, tiny_server_env

from bench.load import RunOptions, ok, run_load, table
from bench.load_workload import CHAT, WorkloadOptions, make_bodies, make_sends
from bench.local_server import LocalServer, check_loopback

WORKLOAD = WorkloadOptions(
    requests=48,
    distinct=12,
    prefixes=3,
    prefix_chars=160,  # 2 blocks of 64 tokens: cached and shared
    max_tokens=6,
    disconnect_fraction=0.2,
    seed=19,
)
OPTIONS = RunOptions(clients=16, duration_s=60, request_timeout_s=60, idle_timeout_s=20)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    log = tmp_path_factory.mktemp("load") / "server.log"
    with LocalServer(TINY_SERVER_ARGS, log, env=tiny_server_env(),
                     start_timeout_s=300) as server:
        result = run_load(server.url, WORKLOAD, OPTIONS, log_compiles=server.compiled)
        result["server_alive"] = server.alive()
        result["server_log_tail"] = server.log_tail(40)
    print(table(result))
    return result


def _details(report: dict) -> str:
    keys = ("failures", "wrong_answers", "reference_failed", "idle_gauges", "health_after")
    return json.dumps({k: report[k] for k in keys}, indent=1)[:6000]


@pytest.mark.slow
def test_the_load_exercised_what_it_should(report):
    """Not a vacuous pass: every send was made, some disconnected, the prefix cache was hit."""
    assert report["not_sent"] == 0 and report["sends"] == WORKLOAD.requests
    assert report["disconnected"] > 0
    assert report["prefix_cache_hits"] > 0
    assert report["completed"] + report["wrong"] >= WORKLOAD.requests // 2


@pytest.mark.slow
def test_nothing_failed_and_nothing_wrong(report):
    assert report["failed"] == 0, _details(report)
    assert not report["reference_failed"], _details(report)
    assert report["wrong"] == 0, _details(report)


@pytest.mark.slow
def test_back_to_idle_and_healthy(report):
    assert report["idle_after_load"], _details(report)
    assert report["health_after"]["status"] == 200, _details(report)
    assert report["server_alive"], report["server_log_tail"]
    assert ok(report)


@pytest.mark.slow
def test_no_compile_under_load(report):
    """The warm-up compiles what requests within the limits reach (issue 19, deliverable 6)."""
    assert report["compiles_during_load"] == 0, report["compiled_during_load"]


# --- pieces, without a server ---------------------------------------------------------------


def test_workload_is_reproducible_and_mixed():
    options = WorkloadOptions(requests=200, distinct=20, seed=3, disconnect_fraction=0.3)
    bodies = make_bodies(options, "m")
    sends = make_sends(options, bodies)
    assert bodies == make_bodies(options, "m") and sends == make_sends(options, bodies)
    assert {b.path for b in bodies} == {CHAT, "/v1/completions"}
    assert {s.stream for s in sends} == {True, False}
    assert {s.disconnect for s in sends} == {None, "mid-request", "mid-stream"}
    assert all(s.stream for s in sends if s.disconnect == "mid-stream")
    assert all(1 <= b.json["max_tokens"] <= options.max_tokens for b in bodies)
    assert all(b.json["temperature"] == 0 for b in bodies if b.checked)


@pytest.mark.parametrize(
    "url", ["http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1:21", "127.0.0.1:80"]
)
def test_only_loopback_urls(url):
    with pytest.raises(ValueError, match="loopback"):
        check_loopback(url)
    assert check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    "fields", [{"requests": 0}, {"stream_fraction": 1.5}, {"prefix_chars": -1}]
)
def test_bad_workload_options_are_refused(fields):
    with pytest.raises(ValueError, match=next(iter(fields))):
        WorkloadOptions(**fields)
