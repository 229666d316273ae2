"""TP4 over four processes, as four hosts run it: four local processes with one CPU device
each (``jax.distributed``, gloo collectives), the tiny preset on a (tp 4, dcp) mesh.

Each test starts its processes once and checks several things, as every start compiles
the model four times over (the children compile with LLVM's optimisations off,
``XLA_FLAGS``, to save some of that); the two that start four processes are marked
``extended`` (`make test-extended`: too long for CI's two cores beside the rest). The
differences from one device are fp32 rounding summed in another order: one device is
itself up to 1.2e-6 from an fp64 evaluation of the same run and the mesh up to 1.0e-6
(`python -m bench.prefill_fp64`), so the two may differ by up to their sum; TOLERANCE is
2e-6 (measured: up to 1.4e-6).
"""

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

for _package in ("fastapi", "uvicorn", "pydantic", "httpx"):  # absent on the GPU machines
    pytest.importorskip(_package)

import httpx  # noqa: E402
import jax  # noqa: E402

from glmjax import distributed
from glmjax.random_weights import random_model
from serving import multiprocess
from serving.engine import DeviceLostError, Engine, EngineConfig
from serving.request import SamplingParams
from serving.server import build_config, parse_args
from serving.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[1]
PROCESSES = 4
START_TIMEOUT_S = 420
NUMERICS_TIMEOUT_S = 600  # the offline prefill: ~40 s alone, minutes at load 15
KILL_BOUND_S = 30  # a killed process ends every process within this (heartbeat timeout 10 s)
TOLERANCE = 2e-6  # max |mesh - one device| / max |one device|, fp32
CHILD_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    "PYTHONPATH": str(ROOT),
}



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def start(command: list[str], logs: Path, num_processes: int = PROCESSES, extra=None):
    """`command` plus the multi-process flags, once per process (output to logs/p<i>.txt);
    yields the processes and kills those still running at the end."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | CHILD_ENV
    processes = []
    for i in range(num_processes):
        args = [*command, "--coordinator", coordinator, "--num-processes", str(num_processes),
                "--process-id", str(i), *(extra(i) if extra else [])]
        with open(logs / f"p{i}.txt", "w") as log:
            processes.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=log,
                                              stderr=subprocess.STDOUT))
    try:
        yield processes
    finally:
        wait_all(processes, 0)


def wait_all(processes: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit codes after at most `timeout_s` (None: still running, then killed)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in processes:
        try:
            codes.append(p.wait(max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in processes:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def log_text(logs: Path, i: int) -> str:
    return (logs / f"p{i}.txt").read_text(errors="replace")


@pytest.mark.extended
def test_numerics_match_one_device(tmp_path):
    """`python -m glmjax.prefill --tp 4 --dcp 2` over the four processes (the states process
    0 saved, at 2-3 retained positions): logits, every retained KDA state (recurrent and
    conv) and the MLA latents against the same prefill on one device. Decode over four
    processes is the server test's (its greedy tokens against one device); one process's
    meshes at every dcp, decode included, are `test_sharding.py`'s. `glmjax.shard`'s
    experiment over four processes (`multiprocess_worker.py --dcp 1,2,4`: logits, states
    and caches after a prefill and two decodes) ran here at dcp 4 until CI's 2 cores ran
    short of time (~50 s of this test's ~90)."""
    out = tmp_path / "results.json"
    with start([sys.executable, "tests/multiprocess_worker.py", "--dcp", "", "--prefill",
                "--out", str(out)], tmp_path) as processes:
        codes = wait_all(processes, NUMERICS_TIMEOUT_S)
    assert codes == [0] * PROCESSES, log_text(tmp_path, 0)[-3000:]
    offline = json.loads(out.read_text())["prefill"]
    assert len(offline["positions"]) >= 2
    for kind in ("logits", "kda_recurrent", "kda_conv", "mla_latent"):
        assert offline[kind]["max_rel"] <= TOLERANCE, ("prefill", kind, offline[kind])


SERVER_ARGS = ["--preset", "tiny", "--tp", "4", "--dcp", "2", "--block-size", "16",
               "--max-num-batched-tokens", "64", "--max-model-len", "256", "--max-num-seqs",
               "4", "--num-state-slots", "16", "--single-bucket", "--log-level", "warning"]
PROMPTS = ["The four processes share one model. " * 2, "Tensor parallel over hosts!"]
MAX_TOKENS = 8


def reference_tokens() -> list[list[str]]:
    """Greedy tokens (their texts) of one process on one device (dcp emulated), same
    flags."""
    args = parse_args(SERVER_ARGS)
    config = build_config(args)
    engine = Engine(config, random_model(config, args.seed), EngineConfig(
        max_model_len=256, block_size=16, dcp=2, budget=64, max_num_seqs=4,
        num_kv_blocks=64, num_state_slots=16, single_bucket=True))
    tokenizer = ByteTokenizer(config.vocab_size)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), tokenizer.encode(prompt),
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                          ignore_eos=True))
    done = engine.run_until_done()
    return [[tokenizer.token_text(t) for t in done[str(i)].output_token_ids]
            for i in range(len(PROMPTS))]


def complete(client: httpx.Client, prompt: str, max_tokens: int = MAX_TOKENS) -> httpx.Response:
    return client.post("/v1/completions", json={
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})


def tokens(response: httpx.Response) -> list[str]:
    """The texts of the completion's tokens."""
    return response.json()["choices"][0]["logprobs"]["tokens"]


@pytest.mark.extended
def test_server_greedy_cached_and_kill(tmp_path):
    """The four-process server answers the one-process greedy tokens, cold and from its
    prefix cache; killing one process fails the request in flight, answers the next
    with a 503 and ends all four within KILL_BOUND_S."""
    port = free_port()
    with (start([sys.executable, "-m", "serving.server", *SERVER_ARGS], tmp_path,
                extra=lambda i: ["--port", str(port)]) as processes,
          concurrent.futures.ThreadPoolExecutor(2) as pool):
        expected = pool.submit(reference_tokens)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert all(p.poll() is None for p in processes), log_text(tmp_path, 0)[-3000:]
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(2)
        cold = [complete(client, prompt) for prompt in PROMPTS]
        cached = complete(client, PROMPTS[0])
        expected = expected.result()
        for response in (*cold, cached):
            assert response.status_code == 200, response.text
        assert [tokens(r) for r in cold] == expected
        assert cached.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert tokens(cached) == expected[0]

        in_flight = pool.submit(complete, client, "a long one", 200)
        time.sleep(3)
        processes[2].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        response = in_flight.result()
        # In flight and after: 503 "engine_unavailable", never silence.
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "engine_unavailable"
        after = complete(client, "after the kill")
        assert after.status_code == 503, after.text
        failed_s = time.monotonic() - killed_at
        codes = wait_all(processes, KILL_BOUND_S - (time.monotonic() - killed_at))
        ended_s = time.monotonic() - killed_at
    print(f"requests failed {failed_s:.1f} s and all {PROCESSES} processes ended "
          f"{ended_s:.1f} s after the kill: exit codes {codes}")
    assert None not in codes, f"still running {KILL_BOUND_S} s after the kill: {codes}"
    assert all(code != 0 for code in codes), codes
    # Process 0 saw the dead peer's collective fail, or its silence, whichever came first.
    assert "the process group cannot go on" in log_text(tmp_path, 0)


@pytest.mark.slow
def test_mismatched_flags_refused(tmp_path):
    """Two processes started with different seeds both refuse to start, naming the flag."""
    with start([sys.executable, "-m", "serving.server", "--tp", "2"], tmp_path, 2,
               extra=lambda i: ["--seed", str(i)]) as processes:
        codes = wait_all(processes, 120)
    assert codes == [1, 1], codes
    for i in range(2):
        assert "different flags: --seed: process 0=0, process 1=1" in log_text(tmp_path, i)


def test_multi_process_flags_need_a_coordinator():
    args = parse_args(["--num-processes", "4"])
    with pytest.raises(ValueError, match="needs --coordinator"):
        distributed.initialize(args, tp=4, flags=vars(args))


def test_comparable_flags_leave_out_per_process_ones():
    flags = vars(parse_args(["--tp", "4", "--port", "9000", "--process-id", "3"]))
    kept = distributed.comparable_flags(flags)
    assert "port" not in kept and "process_id" not in kept and kept["tp"] == 4
    assert kept["weights"] is None and "jax_version" in kept


class _Store:
    """The coordination service's key-value store, as ``watch`` and ``beat`` use it."""

    def __init__(self):
        self.values = {}

    def key_value_increment(self, key, increment):
        self.values[key] = str(int(self.values.get(key, 0)) + increment)

    def key_value_try_get(self, key):
        if key not in self.values:
            raise jax.errors.JaxRuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def test_watch_fails_the_engine_when_a_follower_falls_silent(monkeypatch):
    store = _Store()
    monkeypatch.setattr(distributed.ProcessGroup, "client", property(lambda self: store))
    group = distributed.ProcessGroup(0, 3)
    failed, exited = [], threading.Event()
    store.key_value_increment("glmjax/alive/2", 1)  # process 2 beats once, then dies
    done = threading.Event()
    threading.Thread(target=lambda: [store.key_value_increment("glmjax/alive/1", 1)
                                     for _ in iter(lambda: done.wait(0.02), True)],
                     daemon=True).start()  # process 1 beats on
    multiprocess.watch(group, is_dead=lambda: False, fail=failed.append, timeout_s=0.3,
                       grace_s=0.0, poll_s=0.02, exit=lambda status: exited.set())
    assert exited.wait(5)
    done.set()
    assert [str(e) for e in failed] == ["process 2 sent no heartbeat for 0.3 s"]
    assert isinstance(failed[0], DeviceLostError)


def test_watch_ends_quietly_when_stopped(monkeypatch):
    store = _Store()
    monkeypatch.setattr(distributed.ProcessGroup, "client", property(lambda self: store))
    exited = threading.Event()
    stop = multiprocess.watch(distributed.ProcessGroup(0, 2), is_dead=lambda: False,
                              fail=lambda e: exited.set(), timeout_s=0.2, poll_s=0.02,
                              exit=lambda status: exited.set())
    stop.set()
    assert not exited.wait(0.5)
