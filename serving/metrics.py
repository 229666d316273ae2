"""``/metrics``: the Prometheus exposition of one server, through ``prometheus_client``.

Every server has its own ``CollectorRegistry`` (never the library's global one), so that
several servers can live in one process (tests). It holds:

- ``EngineCollector``: the engine's counters and gauges (``serving.outputs.EngineMetrics``,
  read at scrape time from the ``AsyncEngine``'s latest snapshot), which features are on,
  the dcp degree and whether the engine still serves;
- two histograms the ``AsyncEngine`` observes as tokens arrive: time to first token and
  time per output token.

Names (prefix ``glmjax_``): every ``EngineMetrics`` field, counters with ``_total``
(``glmjax_requests_added_total``) and gauges without (``glmjax_running``);
``glmjax_feature_enabled{feature=...}``, ``glmjax_dcp``, ``glmjax_engine_healthy``;
speculative decoding: ``glmjax_speculative_tokens``, the counters
``glmjax_spec_{verified_decodes,draft_tokens,accepted_tokens}_total`` and the derived
``glmjax_spec_acceptance_rate`` and ``glmjax_spec_tokens_per_step``;
``glmjax_backend_compiles_total`` and ``glmjax_backend_compile_seconds_total`` (XLA
compiles since the server started serving);
``glmjax_time_to_first_token_seconds`` and ``glmjax_time_per_output_token_seconds``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.outputs import EngineMetrics

if TYPE_CHECKING:
    from serving.async_engine import AsyncEngine

PREFIX = "glmjax"
# Buckets in seconds: first tokens include queueing and, for a new batch shape, a compile.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

# EngineMetrics fields that are levels now; every other field counts since start.
GAUGES = frozenset(
    {
        "running",
        "waiting",
        "kv_blocks_total",
        "kv_blocks_used",
        "kv_blocks_cached",
        "state_slots_total",
        "state_slots_used",
        "state_slots_retained",
    }
)
HELP = {
    "requests_added": "requests the engine accepted",
    "requests_finished": "requests that finished (stop, length or abort)",
    "requests_aborted": "requests aborted (client gone, shutdown)",
    "requests_failed": "requests failed by a step that raised (the others went on)",
    "step_failures": "engine steps that raised",
    "engine_resets": "restarts from empty caches after a failed step had consumed them",
    "prompt_tokens": "prompt tokens of accepted requests",
    "cached_prompt_tokens": "prompt tokens served by the prefix cache at first admission",
    "generated_tokens": "tokens generated",
    "preemptions": "requests preempted (recomputed later through the prefix cache)",
    "kv_block_copies": "copy-on-write KV block copies",
    "steps": "engine steps run",
    "device_wait_seconds": "seconds the engine waited for the device's results (the rest "
                           "of its time is the host's: near zero, the host sets the pace)",
    "prefix_cache_lookups": "prefix-cache lookups",
    "prefix_cache_hits": "prefix-cache lookups that resumed from a retained state",
    "kv_block_evictions": "cached KV blocks evicted",
    "state_slot_evictions": "retained KDA states evicted",
    "running": "requests running",
    "waiting": "requests waiting for admission",
    "kv_blocks_total": "KV block ids",
    "kv_blocks_used": "KV blocks referenced by requests",
    "kv_blocks_cached": "KV blocks held only by the prefix cache",
    "state_slots_total": "KDA state slots",
    "state_slots_used": "KDA state slots referenced by requests",
    "state_slots_retained": "KDA state slots holding retained states",
    "spec_verified_decodes": "decodes that verified MTP drafts (speculative decoding)",
    "spec_draft_tokens": "MTP drafts verified",
    "spec_accepted_tokens": "MTP drafts accepted",
}


def latency_histograms() -> tuple[Histogram, Histogram]:
    """(time to first token, time per output token), registered nowhere yet:
    ``server_registry`` adds them to the server's registry."""
    return (
        Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "seconds from arrival to the first generated token",
            buckets=TTFT_BUCKETS,
            registry=None,
        ),
        Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "seconds per generated token after the first",
            buckets=TPOT_BUCKETS,
            registry=None,
        ),
    )


class EngineCollector(Collector):
    """The engine's counters and gauges at scrape time (see the module docstring)."""

    def __init__(self, async_engine: AsyncEngine):
        self._engine = async_engine

    def collect(self):
        snapshot = self._engine.metrics()
        for field in dataclasses.fields(EngineMetrics):
            name, value = field.name, getattr(snapshot, field.name)
            # A field added without a HELP entry is still exported, under its own name.
            doc = HELP.get(name, name.replace("_", " "))
            family = GaugeMetricFamily if name in GAUGES else CounterMetricFamily
            yield family(f"{PREFIX}_{name}", doc, value=value)
        config = self._engine.engine.config
        features = GaugeMetricFamily(
            f"{PREFIX}_feature_enabled", "1 when a scheduling feature is on", labels=["feature"]
        )
        features.add_metric(["prefill_coalescing"], int(config.coalesce))
        features.add_metric(["prefix_caching"], int(config.prefix_caching))
        features.add_metric(["speculative_decoding"], int(config.speculative_tokens > 0))
        yield features
        yield GaugeMetricFamily(f"{PREFIX}_speculative_tokens", "MTP drafts per decode (0: "
                                "off)", value=config.speculative_tokens)
        yield GaugeMetricFamily(f"{PREFIX}_spec_acceptance_rate", "MTP drafts accepted / "
                                "verified since start", value=snapshot.spec_acceptance_rate)
        yield GaugeMetricFamily(f"{PREFIX}_spec_tokens_per_step", "tokens a decode that "
                                "verified drafts gained per step, on average since start",
                                value=snapshot.spec_tokens_per_step)
        yield GaugeMetricFamily(f"{PREFIX}_dcp", "decode-context-parallel ranks", value=config.dcp)
        compiles = self._engine.compiles
        yield CounterMetricFamily(f"{PREFIX}_backend_compiles", "XLA compiles while serving "
                                  "(0 after start-up when every shape was precompiled)",
                                  value=compiles.count)
        yield CounterMetricFamily(f"{PREFIX}_backend_compile_seconds",
                                  "seconds of XLA compiles while serving", value=compiles.seconds)
        yield GaugeMetricFamily(
            f"{PREFIX}_engine_healthy",
            "1 while the engine serves, 0 after it failed",
            value=int(self._engine.error is None),
        )


def server_registry(async_engine: AsyncEngine) -> CollectorRegistry:
    """A new registry with the engine's collector and its two latency histograms."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(async_engine))
    registry.register(async_engine.ttft)
    registry.register(async_engine.time_per_output_token)
    return registry


def exposition(registry: CollectorRegistry) -> str:
    """The Prometheus text format (version 0.0.4) of everything in ``registry``."""
    return generate_latest(registry).decode()
