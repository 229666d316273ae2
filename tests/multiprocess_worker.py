"""One of the processes `tests/test_multiprocess.py` starts: `glmjax.shard`'s experiment
(tiny preset, tp 4) at each dcp given, on the mesh of every process's devices; process 0
also runs the one-device reference and writes the differences to `--out` as JSON. With
`--prefill`, then `python -m glmjax.prefill` at tp 4, dcp 2 (states saved by process 0),
against the same prefill on process 0's one device: the differences under "prefill".

A KV block id holds 64 tokens at every dcp (block size 64 / dcp), so the one-device
reference is the same program each time: it compiles once.

    python tests/multiprocess_worker.py --coordinator 127.0.0.1:PORT --num-processes 4 \\
        --process-id I --dcp 1,2,4 --out results.json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax

from glmjax import distributed, prefill, shard
from glmjax.prefill_states import load_states

SHARD_ARGS = ["--preset", "tiny", "--tp", "4", "--tokens", "160", "--decode-steps", "2",
              "--repeats", "1"]
TOKENS_PER_BLOCK_ID = 64
PREFILL_ARGS = ["--random-tokens", "160", "--block-size", "32", "--budget", "128", "--dcp", "2",
                "--no-compile-cache"]


def prefill_differences(out_dir: Path) -> dict | None:
    """The offline prefill on the mesh of all processes and, on process 0, on one device:
    {kind: max_difference} of the logits, the KDA states at every saved position and the
    MLA latents (process 0; None elsewhere)."""
    paths = {name: out_dir / f"prefill_{name}" for name in ("mesh", "one")}
    mesh = prefill.main([*PREFILL_ARGS, "--tp", "4", "--save-states", str(paths["mesh"])],
                        progress=None)
    if jax.process_index() != 0:
        return None
    one = prefill.main([*PREFILL_ARGS, "--save-states", str(paths["one"])], progress=None)
    want, got = load_states(paths["one"]), load_states(paths["mesh"])
    assert got.positions == want.positions, (got.positions, want.positions)

    def tokens(blocks):
        return blocks.reshape(-1, blocks.shape[-1])[:want.prompt_len]

    return {
        "positions": list(want.positions),
        "logits": shard.max_difference([one.logits], [mesh.logits]),
        "kda_recurrent": shard.max_difference(want.recurrent, got.recurrent),
        "kda_conv": shard.max_difference(want.conv, got.conv),
        "mla_latent": shard.max_difference([tokens(m["latent"]) for m in want.mla],
                                           [tokens(m["latent"]) for m in got.mla]),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    distributed.add_arguments(p)
    p.add_argument("--dcp", default="1,2,4")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prefill", action="store_true")
    args = p.parse_args(argv)
    group = distributed.initialize(args, tp=4, flags=vars(args))
    results = {}
    for dcp in filter(None, args.dcp.split(",")):
        block_size = str(TOKENS_PER_BLOCK_ID // int(dcp))
        results[dcp] = shard.run(shard.parse_args([*SHARD_ARGS, "--dcp", dcp,
                                                   "--block-size", block_size]))
        print(f"process {group.process_id}: dcp {dcp} done", file=sys.stderr, flush=True)
    if args.prefill:
        start = time.perf_counter()
        differences = prefill_differences(args.out.parent)
        print(f"process {group.process_id}: prefill done in {time.perf_counter() - start:.1f} s",
              file=sys.stderr, flush=True)
        if group.is_leader:
            results["prefill"] = differences
    if group.is_leader:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
