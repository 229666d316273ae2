"""`make test-gpu` (`pytest -m gpu`) must collect on the GPU machines, which have no
fastapi, uvicorn, pydantic or httpx (DESIGN.md section 7), nor the test-only schemathesis:
a test module that needs them skips at collection (`pytest.importorskip`) instead of
failing the whole run.

Checked by collecting the `gpu` selection in a subprocess where those packages cannot be
imported (a ``sitecustomize`` that refuses them)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SERVER_PACKAGES = ("fastapi", "uvicorn", "pydantic", "httpx", "starlette", "schemathesis")
BLOCKER = f"""\
import sys

class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {SERVER_PACKAGES!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, _Refuse())
"""


@pytest.mark.slow
def test_gpu_selection_collects_without_the_server_packages(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    # Plugins off: an installed plugin (schemathesis) may import the refused packages itself.
    env = dict(os.environ, PYTHONPATH=path, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-m", "gpu", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "error" not in result.stdout.lower(), result.stdout[-4000:]
    assert "tests/test_kda_kernel.py::" in result.stdout
