"""One model over several processes (one per host, as four GB10 boxes run TP4): JAX's
multi-controller runtime (``jax.distributed``), its flags and the start-up checks.

    parser = argparse.ArgumentParser(); add_arguments(parser); args = parser.parse_args()
    group = initialize(args, flags=vars(args))   # None: one process, nothing to do
    mesh = make_mesh(tp, dcp)                     # over jax.devices(): every process's devices

Every process runs the same command with its own ``--process-id``; process 0 also hosts
JAX's coordination service at ``--coordinator HOST:PORT`` (the others connect to it).
Without ``--coordinator`` JAX's own sources are used: ``JAX_COORDINATOR_ADDRESS`` and its
cluster detection (SLURM, Open MPI, ...) for the process count and id; with neither, the
run is a single process. After ``jax.distributed.initialize``, ``jax.devices()`` lists
the devices of all processes (process 0's first), so ``glmjax.sharding.make_mesh`` builds
the same (tp, dcp) mesh in every process; each process holds its own devices' shards.

Start-up checks (``initialize``), each a ``ValueError`` naming the bad value, raised in
every process: tp must equal the global device count (a process without a device on the
mesh would have nothing to run), and every flag that shapes the model, the mesh or the
schedule must be the same in every process (each process publishes its flags in the
coordination service's key-value store and compares them with every other's).

Failure: a process that stops sending heartbeats for ``--heartbeat-timeout`` seconds (it
died, or its host went away) makes JAX's coordination service end every other process
("Terminating process because the JAX distributed service detected fatal errors"; exit
status 134), and a coordinator that cannot be reached within ``--init-timeout`` seconds
fails ``initialize`` in the processes waiting for it. A collective already in flight fails
sooner: gloo on the CPU reports the closed connection at once. Both bounds are JAX's; we
only choose them (JAX's default heartbeat timeout is 100 s, ours 10 s).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Mapping

import jax
from jax._src import distributed as jax_distributed

logger = logging.getLogger(__name__)

# Flags that may differ between processes: who a process is, where process 0 listens
# for HTTP, how much it logs.
PER_PROCESS_FLAGS = frozenset(
    {"process_id", "host", "port", "log_level", "json", "coordinator"})
_FLAGS_KEY = "glmjax/flags/{}"


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """This process's place in a multi-process run."""

    process_id: int
    num_processes: int

    @property
    def is_leader(self) -> bool:
        """Process 0: runs the scheduler, the HTTP server and the sampler."""
        return self.process_id == 0

    @property
    def client(self):
        """JAX's coordination-service client (key-value store, barriers). JAX keeps it in
        ``jax._src.distributed`` (``jax.experimental.multihost_utils`` reads it there too)."""
        client = jax_distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized")
        return client


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The multi-process flags (all optional; without them the run is one process)."""
    group = parser.add_argument_group("multiple processes (jax.distributed)")
    group.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address for JAX's coordination service (default: "
                            "$JAX_COORDINATOR_ADDRESS; neither: one process)")
    group.add_argument("--num-processes", type=int,
                       help="processes in the run (default: JAX's cluster detection)")
    group.add_argument("--process-id", type=int,
                       help="this process, 0 .. N-1 (default: JAX's cluster detection)")
    group.add_argument("--init-timeout", type=int, default=300,
                       help="seconds to wait for every process to connect")
    group.add_argument("--heartbeat-timeout", type=int, default=10,
                       help="seconds without a heartbeat after which a process counts as "
                            "dead and every process is ended")


def initialize(args: argparse.Namespace, *, tp: int, flags: Mapping[str, object]
               ) -> ProcessGroup | None:
    """Starts ``jax.distributed`` when `args` ask for several processes (before any other
    JAX call), asks for one CPU device per process on a CPU, and checks that `tp` covers
    the devices of all processes and that `flags` match across processes. Returns None
    for a single process (also when JAX was asked to start a group of one).

    Raises:
      ValueError: a bad --num-processes / --process-id, tp unequal to the global device
        count, or flags that differ between processes (naming the flag and the values).
    """
    coordinator = args.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if coordinator is None:
        if args.num_processes not in (None, 1):
            raise ValueError(f"--num-processes {args.num_processes} needs --coordinator "
                             f"HOST:PORT (or JAX_COORDINATOR_ADDRESS)")
        return None
    if args.num_processes is not None and args.num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {args.num_processes}")
    if args.process_id is not None and args.num_processes is not None and not (
            0 <= args.process_id < args.num_processes):
        raise ValueError(f"--process-id must be in [0, {args.num_processes}), "
                         f"got {args.process_id}")
    if args.num_processes is not None and tp % args.num_processes:
        raise ValueError(f"--tp {tp} must be a multiple of --num-processes "
                         f"{args.num_processes}")
    if args.num_processes is not None and not os.environ.get("XLA_FLAGS", "").count(
            "xla_force_host_platform_device_count"):
        # Only the CPU backend reads this: each process lends tp / N host devices.
        jax.config.update("jax_num_cpu_devices", tp // args.num_processes)
    jax.distributed.initialize(
        coordinator, args.num_processes, args.process_id,
        initialization_timeout=args.init_timeout,
        heartbeat_timeout_seconds=args.heartbeat_timeout)
    group = ProcessGroup(jax.process_index(), jax.process_count())
    if group.num_processes == 1:
        return None
    logger.info("process %d of %d: %d local devices, %d in all (coordinator %s)",
                group.process_id, group.num_processes, jax.local_device_count(),
                jax.device_count(), coordinator)
    if jax.device_count() != tp:
        raise ValueError(f"--tp {tp} must equal the devices of all {group.num_processes} "
                         f"processes ({jax.device_count()}: {jax.local_device_count()} here)")
    check_same_flags(group, flags, timeout_s=args.init_timeout)
    return group


def comparable_flags(flags: Mapping[str, object], *, ignore: Iterable[str] = PER_PROCESS_FLAGS
                     ) -> dict[str, object]:
    """`flags` less the per-process ones, as JSON-safe values (plus JAX's version)."""
    ignore = set(ignore)
    kept = {k: v if isinstance(v, int | float | bool | str | None) else str(v)
            for k, v in sorted(flags.items()) if k not in ignore}
    return kept | {"jax_version": jax.__version__}


def check_same_flags(group: ProcessGroup, flags: Mapping[str, object], *,
                     timeout_s: int = 300) -> None:
    """Publishes this process's flags and compares them with every other process's.

    Raises:
      ValueError: naming each flag that differs, with its value in every process.
    """
    mine = comparable_flags(flags)
    client = group.client
    client.key_value_set(_FLAGS_KEY.format(group.process_id), json.dumps(mine))
    every = {i: json.loads(client.blocking_key_value_get(_FLAGS_KEY.format(i),
                                                         timeout_s * 1000))
             for i in range(group.num_processes)}
    differing = sorted({k for theirs in every.values() for k in theirs.keys() | mine.keys()
                        if theirs.get(k) != mine.get(k)})
    if differing:
        values = "; ".join(
            f"--{k.replace('_', '-')}: " + ", ".join(f"process {i}={v.get(k)!r}"
                                                     for i, v in every.items())
            for k in differing)
        raise ValueError(f"the processes were started with different flags: {values}")
