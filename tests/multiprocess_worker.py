"""One of the processes `tests/test_multiprocess.py` starts: `glmjax.shard`'s experiment
(tiny preset, tp 4) at each dcp given, on the mesh of every process's devices; process 0
also runs the one-device reference and writes the differences to `--out` as JSON.

A KV block id holds 64 tokens at every dcp (block size 64 / dcp), so the one-device
reference is the same program each time: it compiles once.

    python tests/multiprocess_worker.py --coordinator 127.0.0.1:PORT --num-processes 4 \\
        --process-id I --dcp 1,2,4 --out results.json
"""

import argparse
import json
import sys
from pathlib import Path

from glmjax import distributed, shard

SHARD_ARGS = ["--preset", "tiny", "--tp", "4", "--tokens", "160", "--decode-steps", "2",
              "--repeats", "1"]
TOKENS_PER_BLOCK_ID = 64


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    distributed.add_arguments(p)
    p.add_argument("--dcp", default="1,2,4")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    group = distributed.initialize(args, tp=4, flags=vars(args))
    results = {}
    for dcp in args.dcp.split(","):
        block_size = str(TOKENS_PER_BLOCK_ID // int(dcp))
        results[dcp] = shard.run(shard.parse_args([*SHARD_ARGS, "--dcp", dcp,
                                                   "--block-size", block_size]))
        print(f"process {group.process_id}: dcp {dcp} done", file=sys.stderr, flush=True)
    if group.is_leader:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
