"""serving.metrics: the exposition of an AsyncEngine over a stand-in engine, parsed back
with prometheus_client's own parser; each server has a registry of its own."""

import dataclasses
import types

import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.async_engine import AsyncEngine
from serving.metrics import GAUGES, exposition, server_registry
from serving.outputs import EngineMetrics


class _StandInEngine:
    """What the collector reads of an ``Engine``: ``metrics()`` and ``config``."""

    def __init__(self, *, prefix_caching: bool, dcp: int):
        names = [field.name for field in dataclasses.fields(EngineMetrics)]
        # Distinct values, so a field exported under another's name would show.
        self.snapshot = EngineMetrics(**{name: i + 1 for i, name in enumerate(names)})
        self.config = types.SimpleNamespace(coalesce=True, prefix_caching=prefix_caching, dcp=dcp,
                                            speculative_tokens=3)

    def metrics(self) -> EngineMetrics:
        return self.snapshot


def families(registry) -> dict:
    return {f.name: f for f in text_string_to_metric_families(exposition(registry))}


def samples(family) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}


def test_engine_counters_and_gauges_keep_their_names_and_types():
    engine = AsyncEngine(_StandInEngine(prefix_caching=True, dcp=2))
    found = families(server_registry(engine))
    for field in dataclasses.fields(EngineMetrics):
        value = getattr(engine.metrics(), field.name)
        family = found[f"glmjax_{field.name}"]
        if field.name in GAUGES:
            assert family.type == "gauge"
            assert samples(family) == {(f"glmjax_{field.name}", ()): value}
        else:
            assert family.type == "counter"
            assert samples(family) == {(f"glmjax_{field.name}_total", ()): value}
    assert samples(found["glmjax_feature_enabled"]) == {
        ("glmjax_feature_enabled", (("feature", "prefill_coalescing"),)): 1,
        ("glmjax_feature_enabled", (("feature", "prefix_caching"),)): 1,
        ("glmjax_feature_enabled", (("feature", "speculative_decoding"),)): 1,
    }
    assert samples(found["glmjax_dcp"]) == {("glmjax_dcp", ()): 2}
    snapshot = engine.metrics()
    assert samples(found["glmjax_speculative_tokens"]) == {("glmjax_speculative_tokens", ()): 3}
    rate = snapshot.spec_accepted_tokens / snapshot.spec_draft_tokens
    per_step = 1 + snapshot.spec_accepted_tokens / snapshot.spec_verified_decodes
    assert samples(found["glmjax_spec_acceptance_rate"]) == {
        ("glmjax_spec_acceptance_rate", ()): rate
    }
    tokens_per_step = samples(found["glmjax_spec_tokens_per_step"])
    assert tokens_per_step == {("glmjax_spec_tokens_per_step", ()): pytest.approx(per_step)}
    assert samples(found["glmjax_engine_healthy"]) == {("glmjax_engine_healthy", ()): 1}


def test_latency_histograms_and_health_per_server():
    first = AsyncEngine(_StandInEngine(prefix_caching=False, dcp=1))
    second = AsyncEngine(_StandInEngine(prefix_caching=True, dcp=1))
    first_registry, second_registry = server_registry(first), server_registry(second)
    first.ttft.observe(0.3)
    first.ttft.observe(20.0)
    first.time_per_output_token.observe(0.004)
    first._error = RuntimeError("device lost")  # what the engine loop records on failure

    ttft = samples(families(first_registry)["glmjax_time_to_first_token_seconds"])
    name = "glmjax_time_to_first_token_seconds"
    assert ttft[(f"{name}_bucket", (("le", "0.25"),))] == 0
    assert ttft[(f"{name}_bucket", (("le", "0.5"),))] == 1
    assert ttft[(f"{name}_bucket", (("le", "30.0"),))] == 2
    assert ttft[(f"{name}_bucket", (("le", "+Inf"),))] == 2
    assert ttft[(f"{name}_count", ())] == 2
    assert ttft[(f"{name}_sum", ())] == 20.3
    tpot = samples(families(first_registry)["glmjax_time_per_output_token_seconds"])
    assert tpot[("glmjax_time_per_output_token_seconds_count", ())] == 1
    assert samples(families(first_registry)["glmjax_engine_healthy"]) == {
        ("glmjax_engine_healthy", ()): 0
    }
    assert (
        samples(families(first_registry)["glmjax_feature_enabled"])[
            ("glmjax_feature_enabled", (("feature", "prefix_caching"),))
        ]
        == 0
    )

    other = families(second_registry)
    assert (
        samples(other["glmjax_time_to_first_token_seconds"])[
            ("glmjax_time_to_first_token_seconds_count", ())
        ]
        == 0
    )
    assert samples(other["glmjax_engine_healthy"]) == {("glmjax_engine_healthy", ()): 1}
