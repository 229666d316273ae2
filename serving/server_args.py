"""The command line of ``python -m serving.server``: every flag, its default and help, the
epilog's request limits and start-up notes (``--help``), and the checks of the HTTP options
(``serving.http_guard.HTTPOptions``) before anything starts."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from glmjax import compile_cache, distributed
from serving import api
from serving.batch_builder import BatchBuckets
from serving.http_guard import DEFAULT_MAX_BODY_BYTES, DEFAULT_REQUEST_TIMEOUT_S, HTTPOptions
from serving.json_body import MAX_JSON_DEPTH
from serving.precompile import reachable_programs
from serving.request import MAX_TOP_LOGPROBS
from serving.step import SchedulerConfig

DESCRIPTION = "OpenAI-compatible HTTP server: ``python -m serving.server``."

LIMITS = f"""\
request limits (a request past any is answered 4xx, nothing else is affected):
  prompt + max_tokens <= --max-model-len tokens; token ids in [0, vocabulary)
  n = best_of = 1; completions logprobs <= {api.MAX_LOGPROBS}; chat top_logprobs <= {MAX_TOP_LOGPROBS}
  stop: at most {api.MAX_STOP_STRINGS} non-empty strings; top_k <= vocabulary (-1 or 0: all)
  seed in [0, 2**32); temperature in [0, 2]; top_p in (0, 1]
  body <= --max-body-bytes (413); JSON nested <= {MAX_JSON_DEPTH} deep, valid Unicode, no NaN
"""

STARTUP = """\
start-up (time to ready: python -m bench.startup measures it, cold and warm):
  Every batch is padded to a bucket (tokens x sequences x block-table width, powers of two
  up to --max-num-batched-tokens, --max-num-seqs and --max-model-len); each bucket is one
  compiled program. With the copies, the sampler and the gathers of its rows, the default
  flags reach {programs} programs.
  --precompile all (default): /health answers only once every program is compiled, on
    all cores, so no request ever waits on a compile. The first start with given flags
    pays every compile (seconds each on a CPU, tens of seconds for a deep model on a
    GPU); a restart with the same flags, JAX version and device reads them from the
    persistent cache (--compile-cache-dir) in a fraction of that.
  --precompile none: ready once the weights are in memory and a warm-up request has
    compiled the smallest shapes; each new bucket then compiles the first time a step
    needs it, stalling every request meanwhile.
  Fewer buckets start faster: lower --max-num-seqs, --max-model-len or
  --max-num-batched-tokens, or --single-bucket (one program per entry point, but every
  step computes the largest batch).
"""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each flag's default (unless it has none), and the epilog's lines as written."""

    def _get_help_string(self, action):
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def _default_programs(parser: argparse.ArgumentParser) -> int:
    """How many programs a server with ``parser``'s default flags precompiles."""
    default = parser.get_default
    config = SchedulerConfig(max_model_len=default("max_model_len"),
                             block_size=default("block_size"),
                             budget=default("max_num_batched_tokens"),
                             max_num_seqs=default("max_num_seqs"))
    return len(reachable_programs(BatchBuckets.for_config(config),
                                  feed=not default("no_async_scheduling"),
                                  mixed=default("mixed_steps"), pinned=default("tp") == 1))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m serving.server",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--preset", default="tiny", help="model config (glmjax.config.PRESETS)")
    p.add_argument(
        "--weights",
        type=Path,
        help="safetensors folder (with --family) or orbax checkpoint folder; "
        "default: random weights drawn from --seed",
    )
    p.add_argument("--family", choices=("kimi", "glm"), help="upstream naming of safetensors")
    p.add_argument("--tokenizer", help="tokenizer.json (or its folder); default: bytes")
    p.add_argument("--served-model-name", help="the model id clients name (default: preset)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (loopback: this machine only)"
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $GLMJAX_API_KEY; "
        "unset: no key); /health and /metrics stay open",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest request body; larger is answered 413 without being read",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a request may take (queueing included) before it is aborted: 504",
    )
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel devices: a (tp // dcp, dcp) mesh"
    )
    p.add_argument(
        "--dcp",
        type=int,
        default=1,
        choices=(1, 2, 4),
        help="decode-context-parallel ranks, dividing --tp (with --tp 1: emulated on one device)",
    )
    p.add_argument(
        "--dcp-interleave",
        type=int,
        default=1,
        help="consecutive tokens per dcp rank in the MLA latent cache (divides --block-size)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="step budget B")
    p.add_argument("--block-size", type=int, default=512, help="KV block / prefix unit P")
    p.add_argument(
        "--no-prefill-coalescing",
        action="store_true",
        help="schedule the reference ladder instead of coalesced spans",
    )
    p.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="schedule each step after the previous one's results are back (default: the "
        "next step is scheduled and dispatched while the device runs the current one; off "
        "over several processes, whose steps wait for each device call anyway)",
    )
    p.add_argument(
        "--mixed-steps",
        action="store_true",
        help="run a step's prefill spans and decode rows in one forward (weights read once; "
        "one device only; precompiles one more program per (tokens, sequences, width))",
    )
    p.add_argument(
        "--max-model-len", type=int, default=4096, help="most tokens of prompt plus output"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests per step")
    p.add_argument(
        "--num-kv-blocks", type=int, help="KV block ids (default: 8 requests of --max-model-len)"
    )
    p.add_argument(
        "--num-state-slots",
        type=int,
        default=64,
        help="KDA state slots: running requests plus retained states",
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        choices=range(4),
        metavar="N",
        help="MTP speculative decoding: draft N (1-3) tokens per greedy request with the "
        "model's MTP head and verify them in the next step (same output as plain decoding; "
        "each decode then costs N + 1 rows of compute and N extra state slots while in "
        "flight; sampled requests decode one token per step). 0: off. One device only; "
        "acceptance and tokens per step are in /metrics",
    )
    p.add_argument(
        "--single-bucket",
        action="store_true",
        help="pad every batch to the largest shape: one compile per entry point",
    )
    p.add_argument(
        "--precompile",
        choices=("all", "none"),
        default="all",
        help="all: compile every batch shape the flags can reach before serving (start-up "
        "takes longer, no request ever waits on a compile; the persistent cache makes "
        "restarts fast); none: compile each shape on first use (fast start, the first "
        "requests of each shape stall for the compile)",
    )
    p.add_argument(
        "--pin-temporaries",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each XLA program's temporaries at one address (XLA_FLAGS "
        "--xla_gpu_command_buffer_update_mode=SKIP_TEMP, XLA's VMM allocator), so a decode "
        "step on one GPU launches its CUDA graph as recorded instead of re-setting every "
        "command from the host each step (~1-5 ms of host time a step, which sets the "
        "pace at small batches). Process-wide; an update mode in XLA_FLAGS wins; no effect "
        "on a CPU. --no-pin-temporaries keeps XLA's default allocator (its memory "
        "statistics, which the VMM allocator does not report)",
    )
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens do not depend on what else its steps hold (on a GPU, bit "
        "for bit): the prefill's GEMMs without split-K (XLA_FLAGS "
        "--xla_gpu_experimental_force_split_k=1, process-wide), MLA prefill attention by "
        "our flash kernel over keys packed at multiples of its key blocks (not cuDNN's). So "
        "a coalesced prompt and the ladder of chunks give the same greedy tokens. Off by "
        "default: costs little on long prefills (kimi 8 layers, 8K on an H100: 38.5 -> "
        "38.6 ms), unmeasured on small steps and decode. Not with --mixed-steps",
    )
    compile_cache.add_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="random weights and request seeds")
    p.add_argument("--log-level", default="info", help="debug, info, warning or error")
    distributed.add_arguments(p)
    p.epilog = LIMITS + "\n" + STARTUP.format(programs=_default_programs(p))
    args = p.parse_args(argv)
    try:
        # Read here, not as the flag's default, so that --help never prints the key.
        api_key = args.api_key or os.environ.get("GLMJAX_API_KEY") or None
        args.http = HTTPOptions(api_key, args.max_body_bytes, args.request_timeout)
    except ValueError as error:
        p.error(str(error))
    return args
