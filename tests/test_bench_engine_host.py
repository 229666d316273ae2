"""`bench.engine_host` on the CPU: the stubbed engine decodes one request, every phase is
timed, and the model's steps took kimi's whole parameter tree."""

import json

import pytest

from bench.engine_host import PHASES, main


@pytest.mark.extended
def test_quick_run_times_every_phase(tmp_path):
    path = tmp_path / "engine_host.json"
    main(["--steps", "5", "--repeats", "2", "--warmup", "2", "--context", "600",
          "--out", str(path)])
    result = json.loads(path.read_text())
    assert result["parameter_leaves"] == 563  # kimi-linear-48b's tree
    assert len(result["runs"]) == 2
    for run in result["runs"]:
        assert run["step_us_median"] > 0
        assert set(run["phases_us"]) == set(PHASES)
        assert all(us > 0 for us in run["phases_us"].values())
        # the phases are parts of a step: a model call inside it, the checks inside the batch
        assert run["phases_us"]["model call"] < run["step_us_mean"]
        assert run["phases_us"]["validation"] <= run["phases_us"]["batch"]
