"""`bench.param_dispatch` on the CPU: every form of the tiny preset's parameters timed,
the same leaves in each (none in the last), and `pure_state`'s form the one the engine
passes."""

import json

from bench.param_dispatch import main, parameter_forms
from glmjax.model import FlatParams


def test_quick_run_times_every_form(tmp_path):
    path = tmp_path / "dispatch.json"
    main(["--preset", "tiny", "--calls", "5", "--repeats", "1", "--out", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [r["form"] for r in rows] == ["nnx.State", "nested dicts",
                                         "FlatParams (pure_state)", "no parameters"]
    leaves = [r["leaves"] for r in rows]
    assert leaves[0] == leaves[1] == leaves[2] > 0 and leaves[3] == 0
    assert all(r["host_us_per_call"] > 0 for r in rows)


def test_pure_state_form_is_flat_params():
    forms = parameter_forms("tiny")
    assert isinstance(forms["FlatParams (pure_state)"][1], FlatParams)
