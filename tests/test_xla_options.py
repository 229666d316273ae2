"""`glmjax.xla_options.stable_temporaries`: when it asks XLA for stable temporaries."""

import pytest

from glmjax.xla_options import UPDATE_MODE_FLAG, stable_temporaries

SKIP_TEMP = f"{UPDATE_MODE_FLAG}=SKIP_TEMP"


def test_one_device_gets_the_flag_after_the_callers_flags():
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert stable_temporaries(devices=1, environ=environ)
    assert environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {SKIP_TEMP}"
    assert not stable_temporaries(devices=1, environ=environ)  # never twice
    assert environ["XLA_FLAGS"].count(UPDATE_MODE_FLAG) == 1


def test_no_xla_flags_yet():
    environ = {}
    assert stable_temporaries(devices=1, environ=environ)
    assert environ == {"XLA_FLAGS": SKIP_TEMP}


@pytest.mark.parametrize("environ, devices", [
    ({"XLA_FLAGS": f"{UPDATE_MODE_FLAG}=ALWAYS_UPDATE"}, 1),  # the user's choice stands
    ({}, 2),  # a mesh: the VMM allocator is untried with NCCL here
    ({}, 4),
    ({"JAX_PLATFORMS": "cpu"}, 1),
])
def test_left_alone(environ, devices):
    before = dict(environ)
    assert not stable_temporaries(devices=devices, environ=environ)
    assert environ == before


def test_a_gpu_among_the_platforms_still_gets_it():
    environ = {"JAX_PLATFORMS": "cuda,cpu"}
    assert stable_temporaries(devices=1, environ=environ)
    assert environ["XLA_FLAGS"] == SKIP_TEMP
