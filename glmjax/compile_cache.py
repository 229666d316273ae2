"""JAX's persistent compilation cache, on by default for the server, the offline prefill
and the benchmarks: a restart reads every compiled program from disk instead of
compiling it again (minutes for a deep model's buckets).

The cache lives under ``$XDG_CACHE_HOME/glmjax/xla`` (``~/.cache/glmjax/xla``); the entry
points take ``--compile-cache-dir`` and ``--no-compile-cache``. JAX keys each entry on the
program, the compile options, the device kind and the jax/XLA versions, so a stale entry
is never used for another program or machine (the key includes the host's device count
and XLA_FLAGS too). `enabled` turns the cache on for a block of a running process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "glmjax" / "xla"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--compile-cache-dir`` and ``--no-compile-cache``."""
    parser.add_argument("--compile-cache-dir", type=Path, default=default_dir(),
                        help="persistent XLA compilation cache (restarts skip compiles)")
    parser.add_argument("--no-compile-cache", action="store_true",
                        help="compile every program afresh")


# The JAX settings `enable` changes.
_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")


def enable(cache_dir: Path | None) -> None:
    """Caches every compiled program under ``cache_dir`` (None: leaves the cache off).
    Call before the first compile."""
    if cache_dir is None:
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    # Small programs too: a server's sampler and copies compile in well under a second,
    # but there are dozens of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def enable_from_args(args: argparse.Namespace) -> None:
    enable(None if args.no_compile_cache else args.compile_cache_dir)


@contextlib.contextmanager
def enabled(cache_dir: Path):
    """The cache under ``cache_dir`` on for the block, off again after it (JAX decides
    whether to use its cache once a process; this resets that decision both ways)."""
    before = {name: getattr(jax.config, name) for name in _SETTINGS}
    enable(cache_dir)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
