"""`python -m bench.batch_invariance`: the row comparison, a quick CPU run of a few of the
real ops (their JSON, every op deterministic at one row, the per-row norm invariant), and
that an op mixing its rows is caught and a failing op recorded without stopping the rest."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bench.batch_invariance as bi
from bench.batch_invariance_ops import Op
from bench.batch_invariance_step_ops import OPS


def test_difference_is_bitwise():
    x = np.array([1.0, -2.0, np.inf, np.nan], np.float32)
    assert bi.difference(x, x.copy()) == dict(equal=True, differing=0.0, max_abs=0.0,
                                              max_rel=0.0)
    # -0.0 == 0.0 in value but not in bits: not equal, though no element differs in value.
    zeros = bi.difference(np.array([0.0], np.float32), np.array([-0.0], np.float32))
    assert not zeros["equal"] and zeros["max_abs"] == 0.0
    y = x.copy()
    y[1] = np.nextafter(np.float32(-2.0), np.float32(0))
    d = bi.difference(y, x)
    assert not d["equal"] and d["differing"] == 0.25
    # One ulp below 2 is 2 ** -23; the largest finite magnitude is 2.
    assert d["max_abs"] == 2.0 ** -23 and d["max_rel"] == 2.0 ** -24


def mixing_op(shapes):
    """Adds the batch mean to every row: row 0 depends on the rows beside it."""
    x = jnp.arange(shapes.max_rows * 8, dtype=jnp.float32).reshape(shapes.max_rows, 8)

    def program(_, x):
        return {"y": x + x.mean(axis=0)}

    return Op(jax.jit(program), None, lambda i: (x[jnp.asarray(i)],), lambda rows: {})


def broken_op(shapes):
    raise RuntimeError("this op cannot be built")


@pytest.mark.extended
def test_quick_run_writes_json_and_separates_the_ops(tmp_path, monkeypatch):
    monkeypatch.setattr(bi, "OPS", dict(OPS, mixing=mixing_op, broken=broken_op))
    path = tmp_path / "batch_invariance.json"
    ops = ["final_norm", "router", "broken", "mla_attention", "mixing"]
    payload = bi.main(["--quick", "--rows", "1,2,4", "--ops", ",".join(ops),
                       "--out", str(path)])
    assert json.loads(path.read_text())["summary"] == payload["summary"]
    assert [e["op"] for e in payload["ops"]] == ops
    summary = payload["summary"]
    assert summary["broken"] == "error" and summary["mixing"] == "differs"
    assert "cannot be built" in payload["ops"][2]["error"]
    # An RMSNorm reduces each row on its own: invariant on the CPU too.
    assert summary["final_norm"] == "invariant"
    for entry in payload["ops"]:
        if entry["op"] == "broken":
            continue
        assert entry["error"] is None and [r["rows"] for r in entry["results"]] == [1, 2, 4]
        one, _, four = entry["results"]
        assert one["bitwise_equal"], f"{entry['op']} is not deterministic at one row"
        assert four["checked_rows"] == [0, 1, 3]
        for part in four["parts"].values():
            assert set(part) == {"differing_rows", "differing_row_share", "differing_share",
                                 "max_abs", "max_rel"}
            assert part["max_rel"] < 1e-5 or entry["op"] == "mixing"
    mixing = payload["ops"][-1]["results"]
    assert mixing[1]["parts"]["y"]["differing_rows"] == [0, 1]
    assert mixing[1]["parts"]["y"]["max_abs"] > 0


def test_reference_rows_compare_every_row_with_a_batch_of_rows(tmp_path, monkeypatch):
    """`--reference-rows 3`: rows 0..2 of each batch against the batch of rows 0..2 (a
    prefill's first tokens in spans of other lengths): the MLA's input projections are
    invariant on the CPU, the op mixing its rows differs at every row it shares."""
    monkeypatch.setattr(bi, "OPS", dict(OPS, mixing=mixing_op))
    payload = bi.main(["--quick", "--rows", "2,5", "--reference-rows", "3", "--ops",
                       "mla_in,mixing", "--out", str(tmp_path / "batch_invariance.json")])
    assert payload["summary"] == {"mla_in": "invariant", "mixing": "differs"}
    two, five = payload["ops"][1]["results"]
    assert (two["checked_rows"], five["checked_rows"]) == ("0..1", "0..2")
    assert five["parts"]["y"]["differing_rows"] == [0, 1, 2]
    assert five["parts"]["y"]["differing_row_share"] == 1.0
    assert set(payload["ops"][0]["results"][1]["parts"]) == {"q_nope", "q_pe", "latent"}


def test_unknown_op_is_a_parser_error():
    with pytest.raises(SystemExit):
        bi.parse_args(["--quick", "--ops", "lm_head,nope"])
