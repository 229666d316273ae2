"""The serving loop over several processes: process 0 schedules, the others follow.

    steps = ShardingPlan(config, make_mesh(tp, dcp), interleave).steps()
    if group.is_leader:                   # process 0: HTTP, scheduler, allocators, sampler
        channel = StepChannel(group)
        engine = Engine(config, model, engine_config, steps=leader_steps(steps, channel))
        ...                               # serve; a watch() fails requests if a follower dies
        stop_followers(channel)
    else:                                 # every other process
        follow(steps, nnx.split(model), group)   # each announced call, until stop

JAX's multi-controller runtime runs one jitted program only when every process calls it,
with the same global shapes, in the same order. The scheduler (planner, allocators,
prefix cache, request queue) is host state fed by HTTP requests that arrive at process 0
alone, so it lives there; each device call it makes is announced to the other processes
before process 0 makes it. Why a broadcast and not a scheduler replicated on every
process: replicas stay identical only if every process sees every request, abort and
client disconnect at the same step, which needs the same broadcast (of requests instead
of steps) plus a deterministic clock; announcing the steps keeps one scheduler and makes
the followers a short loop with no serving state at all.

The channel is JAX's coordination service (the key-value store process 0 already hosts
for ``jax.distributed``), not a collective: a step's metadata has a different shape every
step (a collective needs the shapes known in advance on every process), the followers
wait for it without holding a device, and it works the same on CPU, GPU and across hosts.
Call n is stored under ``glmjax/step/n`` as a pickle of (name, host arguments): the
PrefillBatch / DecodeBatch of NumPy arrays (``serving.batch_builder``), the copy pairs,
the cache sizes (the followers unpickle what the store holds: like JAX's coordinator
itself, it belongs on a private network). Keys older than ``KEEP_CALLS`` calls are deleted: a follower cannot fall
that far behind, as every prefill and decode is a collective that process 0 waits on (its
status) and a step makes at most five calls. Costs per call: one store round trip
before the call, and process 0 waits for each call to finish (so that a failure shows in
the call that failed); neither is measured on GPUs yet.

Only process 0 samples and streams: the steps' logits and status come back replicated,
so process 0 reads its own copy (one device's data; no other process is involved) and
the sampler, a jitted program too, runs on that copy alone.

Failure: a call that fails after it was announced may have left the processes' caches
in different states, so it ends the group (``DeviceLostError`` on process 0, which
fails the requests in flight and answers new ones 503; an exit with status 1 on a
follower). Failures before the announcement (scheduling, batch building, sampling) stay
the engine's per-request failures. A process that dies is noticed by JAX's heartbeat, which then ends every
process (``glmjax.distributed``) without a word to process 0's HTTP clients, and a
collective waiting on the dead process may not fail before that. So the followers also
beat in the key-value store (``beat``), and process 0 (``watch``) fails the requests in
flight, answers new ones 503 and exits as soon as one falls silent for less than JAX's
timeout, or its engine stops serving; the other followers then end by JAX's heartbeat.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax

from glmjax.distributed import ProcessGroup
from glmjax.sharding import ModelSteps
from serving.engine import DeviceLostError

logger = logging.getLogger(__name__)

KEEP_CALLS = 64
POLL_MS = 1000  # how long a follower waits on the store before checking for a signal
HEARTBEAT_S = 0.5
_STEP_KEY = "glmjax/step/{}"
_ALIVE_KEY = "glmjax/alive/{}"
STOP = "stop"


class StepChannel:
    """Process 0 announces device calls in order; the other processes receive them."""

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.calls = 0

    def announce(self, name: str, *args) -> None:
        """Process 0: stores call ``(name, args)`` (host values) for the followers."""
        client = self.group.client
        client.key_value_set_bytes(_STEP_KEY.format(self.calls), pickle.dumps((name, args)))
        if self.calls >= KEEP_CALLS:
            client.key_value_delete(_STEP_KEY.format(self.calls - KEEP_CALLS))
        self.calls += 1

    def receive(self) -> tuple[str, tuple]:
        """A follower: the next call, waiting as long as process 0 is idle.

        Raises:
          jax.errors.JaxRuntimeError: the coordination service failed (process 0 is gone).
        """
        key = _STEP_KEY.format(self.calls)
        while True:
            try:
                payload = self.group.client.blocking_key_value_get_bytes(key, POLL_MS)
            except jax.errors.JaxRuntimeError as error:
                if "DEADLINE_EXCEEDED" in str(error):  # idle: wait on
                    continue
                raise
            self.calls += 1
            return pickle.loads(payload)


def _local(x: jax.Array) -> jax.Array:
    """This process's copy of a replicated array, as an array on its own device."""
    return x if x.is_fully_addressable else x.addressable_data(0)


def leader_steps(steps: ModelSteps, channel: StepChannel) -> ModelSteps:
    """`steps` (over a mesh spanning every process) for process 0: each call is
    announced to the followers on `channel` first; outputs read by the host (logits, status, token
    logprobs) come back as process 0's own copy. A call that fails after its
    announcement raises ``DeviceLostError``."""
    group = channel.group

    def announced(name: str, call: Callable, *host_args):
        channel.announce(name, *host_args)
        try:
            # A device call returns before it runs: wait, so that a failed collective
            # raises here (the engine reads each step's status at once anyway).
            return jax.block_until_ready(call())
        except Exception as error:
            raise DeviceLostError(
                f"{name} (call {channel.calls - 1}) failed on process 0 after it was sent to "
                f"the other {group.num_processes - 1} processes; their caches may differ, "
                f"so the process group stops: {error!r}") from error

    def prefill(model_state, caches, batch, *, return_logprobs=False):
        batch = jax.device_get(batch)
        out = announced("prefill", lambda: steps.prefill(
            model_state, caches, batch, return_logprobs=return_logprobs), batch,
            return_logprobs)
        logprobs = None if out.token_logprobs is None else _local(out.token_logprobs)
        return out._replace(logits=_local(out.logits), status=_local(out.status),
                            token_logprobs=logprobs)

    def decode(model_state, caches, batch):
        batch = jax.device_get(batch)
        out = announced("decode", lambda: steps.decode(model_state, caches, batch), batch)
        return out._replace(logits=_local(out.logits), status=_local(out.status))

    def copy_state_slots(caches, sources, destinations):
        pairs = jax.device_get((sources, destinations))
        caches, status = announced("copy_state_slots",
                                   lambda: steps.copy_state_slots(caches, *pairs), *pairs)
        return caches, _local(status)

    def copy_kv_blocks(caches, sources, destinations):
        pairs = jax.device_get((sources, destinations))
        return announced("copy_kv_blocks", lambda: steps.copy_kv_blocks(caches, *pairs),
                         *pairs)

    def init_caches(num_state_slots, num_kv_blocks):
        return announced("init_caches", lambda: steps.init_caches(
            num_state_slots, num_kv_blocks), num_state_slots, num_kv_blocks)

    def place(model_state):
        # The followers place their own copy of the same weights (checked by flags).
        return announced("place", lambda: steps.place(model_state))

    return steps._replace(prefill=prefill, decode=decode, copy_state_slots=copy_state_slots,
                          copy_kv_blocks=copy_kv_blocks, init_caches=init_caches, place=place,
                          mixed=None,  # not announced: a mixed step runs as two
                          decode_pinned=None)  # not announced: decode as above


def stop_followers(channel: StepChannel) -> None:
    """Process 0, at an orderly shutdown: tells the followers to exit (status 0)."""
    channel.announce(STOP)


def _exit_now(status: int) -> None:
    """Ends the process at once: ``sys.exit`` would first wait in JAX's shutdown barrier
    for process 0 (up to 300 s) while this process's heartbeats go on, so process 0
    would not notice that it is gone."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def follow(steps: ModelSteps, model_state, group: ProcessGroup, *,
           channel: StepChannel | None = None) -> None:
    """A follower's loop: runs every call process 0 announces, with its own copy of the
    weights (``model_state``, unplaced) and caches. Returns when process 0 says stop; a
    failed call or SIGTERM ends the process (status 1) at once."""
    channel = channel or StepChannel(group)
    beat(group)

    def terminated(*_):
        logger.error("process %d: SIGTERM; the process group stops", group.process_id)
        _exit_now(1)

    # JAX's preemption notifier takes SIGTERM; a follower should still end on it.
    signal.signal(signal.SIGTERM, terminated)
    placed, caches = None, None
    while True:
        name, args = channel.receive()
        try:
            if name == STOP:
                logger.info("process %d: process 0 stopped; exiting", group.process_id)
                return
            if name == "place":
                placed = steps.place(model_state)
            elif name == "init_caches":
                caches = steps.init_caches(*args)
            elif name == "copy_kv_blocks":
                caches = steps.copy_kv_blocks(caches, *args)
            elif name == "copy_state_slots":
                caches, _ = steps.copy_state_slots(caches, *args)
            elif name in ("prefill", "decode"):
                batch, *flags = args
                call = steps.prefill if name == "prefill" else steps.decode
                kwargs = {"return_logprobs": flags[0]} if flags else {}
                out = call(placed, caches, batch, **kwargs)
                caches = out.caches
                # Surface a failed collective now, not at some later call.
                jax.block_until_ready(out.status)
            else:
                raise ValueError(f"unknown call {name!r}")
        except Exception:
            logger.exception("process %d: call %d (%s) failed; the process group stops",
                             group.process_id, channel.calls - 1, name)
            _exit_now(1)


def beat(group: ProcessGroup, *, interval_s: float = HEARTBEAT_S) -> threading.Thread:
    """A follower: a daemon thread counting up ``glmjax/alive/<process id>`` every
    `interval_s`, for process 0's ``watch``. It stops when the process does (a device
    call holds no Python lock, so a long compile or step does not stop it)."""
    def run():
        while True:
            group.client.key_value_increment(_ALIVE_KEY.format(group.process_id), 1)
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="follower-heartbeat", daemon=True)
    thread.start()
    return thread


def watch(group: ProcessGroup, *, is_dead: Callable[[], bool],
          fail: Callable[[Exception], None], timeout_s: float, grace_s: float = 1.5,
          poll_s: float = 0.25, exit: Callable[[int], None] = _exit_now) -> threading.Event:
    """Process 0: a daemon thread that notices a follower silent for `timeout_s` (it died,
    or its host went away) or `is_dead()` (the engine stopped serving), calls `fail` with
    the reason (the engine fails the requests in flight and answers new ones 503), and
    ends the process
    `grace_s` later. JAX's own heartbeat would end process 0 too, but without a word to
    its clients, and a follower that waits on a process 0 serving nothing would wait
    forever (`exit` ends the process, with status 1); `timeout_s` must leave `grace_s`
    inside JAX's heartbeat timeout. Returns an event that ends the watch when set (an
    orderly shutdown, before ``stop_followers``)."""
    done = threading.Event()
    followers = range(1, group.num_processes)

    def count(i: int) -> str | None:
        try:
            return group.client.key_value_try_get(_ALIVE_KEY.format(i))
        except jax.errors.JaxRuntimeError:  # NOT_FOUND: no beat yet
            return None

    def run():
        last = {i: (count(i), time.monotonic()) for i in followers}
        reason = None
        while reason is None and not done.is_set():
            time.sleep(poll_s)
            now = time.monotonic()
            for i in followers:
                value = count(i)
                if value != last[i][0]:
                    last[i] = (value, now)
                elif now - last[i][1] > timeout_s:
                    reason = f"process {i} sent no heartbeat for {timeout_s:g} s"
            if reason is None and is_dead():
                reason = "the engine stopped serving"
        if reason is None:
            return
        logger.critical("%s; the process group cannot go on: process 0 fails every request "
                        "and exits in %.1f s", reason, grace_s)
        fail(DeviceLostError(reason))
        time.sleep(grace_s)
        exit(1)

    threading.Thread(target=run, name="process-group-watch", daemon=True).start()
    return done
