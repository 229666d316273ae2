"""The process-wide XLA flags of `glmjax.xla_options`: set before JAX starts, refused after,
and known to the installed XLA (an unknown flag aborts the process at start-up)."""

import os
import subprocess
import sys

import jax
import pytest

from glmjax import xla_options


def test_batch_invariant_gemms_adds_its_flag_once(monkeypatch):
    monkeypatch.setattr(xla_options.xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    xla_options.batch_invariant_gemms()
    xla_options.batch_invariant_gemms()
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {xla_options.NO_SPLIT_K}"


def test_batch_invariant_gemms_refuses_once_jax_has_started(monkeypatch):
    jax.devices()
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(RuntimeError, match="started its backends"):
        xla_options.batch_invariant_gemms()
    monkeypatch.setenv("XLA_FLAGS", xla_options.NO_SPLIT_K)  # already there: nothing to do
    xla_options.batch_invariant_gemms()


def test_the_installed_xla_knows_the_flag():
    flags = f"{xla_options.NO_SPLIT_K} {xla_options.PIN_TEMPORARIES}"
    result = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2.0"


def test_the_server_flag_reaches_the_model_config():
    from serving import server as server_module  # the server's packages: not on the GPU image

    args = server_module.parse_args(["--batch-invariant"])
    assert server_module.build_config(args).batch_invariant
    assert not server_module.build_config(server_module.parse_args([])).batch_invariant
