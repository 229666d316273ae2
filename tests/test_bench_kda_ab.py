"""`bench.kda_ab`: a side's JSON line from a CPU smoke run (interpret mode), the device time
of a small jitted call from its CPU trace, the summary's medians and ratios to fla from
hand-made lines, and the `--set` parser."""

import json

import jax
import jax.numpy as jnp
import pytest

from bench.kda_ab import config_overrides, jax_device_ms, main, summarize


@pytest.mark.extended  # ~25-35 s on two busy cores: two kernel compiles in interpret mode
def test_quick_runs_append_lines_and_summarize(tmp_path, capsys):
    path = tmp_path / "ab.jsonl"
    first = main(["--quick", "--tree", "main", "--out", str(path)])
    second = main(["--quick", "--tree", "main", "--set", "scan_prefetch=false",
                   "--out", str(path)])
    fla = main(["--quick", "--fla", "--out", str(path)])  # no fla on the CPU: no rows
    assert first["config"]["scan_prefetch"] and not second["config"]["scan_prefetch"]
    assert second["side"] == "main scan_prefetch=false"
    assert fla["ms"] == fla["device_ms"] == {}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["side"] for line in lines] == ["main", "main scan_prefetch=false", "fla"]
    assert all(line["ms"]["bounded"] > 0 and line["device_ms"] == {} for line in lines[:2])
    tables = main(["--summary", str(path)])  # no device times on the CPU: that table empty
    assert {(r["side"], r["row"]) for r in tables["ms"]} == {
        ("main", "bounded"), ("main scan_prefetch=false", "bounded")}
    assert all(r["fla_over_ours"] is None for r in tables["ms"]) and tables["device_ms"] == []
    out = capsys.readouterr().out
    assert "wall time" in out and "device time" in out and "main scan_prefetch=false" in out


def test_device_time_grows_with_the_work_of_each_call():
    """On the CPU the trace's ops are XLA's thunks on host threads, which may overlap (so
    their sum is no bound on the wall time) and move with the host's load; a call that
    chains eight times the matmuls must still count several times the busy time of one."""
    x = jnp.ones((256, 256), jnp.float32) / 256

    def chain(a, n):
        for _ in range(n):
            a = jnp.tanh(a @ a)
        return a

    one, eight = (jax.jit(lambda a, n=n: chain(a, n)) for n in (1, 8))
    jax.block_until_ready((one(x), eight(x)))
    busy_one = min(jax_device_ms(lambda: one(x), 4) for _ in range(2))
    busy_eight = min(jax_device_ms(lambda: eight(x), 4) for _ in range(2))
    assert 0 < busy_one and busy_eight > 3 * busy_one


def test_summary_takes_medians_and_sets_each_gate_against_its_fla_path():
    def line(side, ms):
        return dict(case="8K", heads=32, side=side, ms=ms,
                    device_ms={row: t / 2 for row, t in ms.items()})

    fla = "fla safe_gate", "fla chunk_kda"
    lines = [line("main", {"bounded": 1.0, "any decay": 2.0}),
             line("fla", dict(zip(fla, (1.5, 3.0)))),
             line("main", {"bounded": 3.0, "any decay": 2.0}),
             line("fla", dict(zip(fla, (2.5, 1.0)))),
             line("main", {"bounded": 1.2, "any decay": 2.0})]
    rows = {(r["side"], r["row"]): r for r in summarize(lines)}
    assert rows["main", "bounded"]["median_ms"] == 1.2
    assert rows["main", "bounded"]["runs"] == [1.0, 3.0, 1.2]
    assert rows["main", "bounded"]["fla_over_ours"] == pytest.approx(2.0 / 1.2)  # safe_gate
    assert rows["main", "any decay"]["fla_over_ours"] == pytest.approx(2.0 / 2.0)  # chunk_kda
    assert rows["fla", "fla safe_gate"]["fla_over_ours"] is None
    device = {(r["side"], r["row"]): r for r in summarize(lines, "device_ms")}
    assert device["main", "bounded"]["median_ms"] == 0.6
    assert device["main", "bounded"]["fla_over_ours"] == pytest.approx(1.0 / 0.6)
    old = dict(case="8K", heads=32, side="before", ms={"bounded": 1.0})  # no device_ms
    assert {r["side"] for r in summarize([*lines, old], "device_ms")} == {"main", "fla"}


def test_config_overrides_take_kernel_config_fields():
    assert config_overrides(["prep_num_warps=1", "fuse_output=False", "prep_block_k=16"]) == {
        "prep_num_warps": 1, "fuse_output": False, "prep_block_k": 16}
    for bad in ("prep_warps=1", "prep_num_warps", "prep_num_warps="):
        with pytest.raises(ValueError, match="FIELD=VALUE"):
            config_overrides([bad])
