"""How far fp32 is from fp64 in the offline prefill, on one device and on a mesh: the noise
floor the mesh-against-one-device tests compare at.

    python -m bench.prefill_fp64 --out bench/results/prefill_fp64_tiny.json    # CPU, ~2 min
    python -m bench.prefill_fp64 --other /tmp/states ...   # states of the four-process run

Runs `python -m glmjax.prefill --save-states` three times, each in its own process, on the
same random prompt and weights: fp32 on one device, fp32 on a ``--tp`` x ``--dcp`` mesh of
CPU devices, and an fp64 evaluation on one device. The fp64 run enables JAX's x64 mode and
reads every ``jnp.float32`` in the code as ``jnp.float64`` (the model names its compute
dtype that way; the weights are the fp32 draws, widened), so every matmul, scan and
normalisation runs in fp64 on the same inputs. A measurement device only: the model has
no fp64 mode. Prints and writes, for each pair (one device - fp64, mesh - fp64, mesh - one
device) and each kind (last-token logits, KDA recurrent and conv states at every saved
position, MLA latents), the largest of max |a - b| / max |b| over the kind's arrays (each
layer, each position).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

PAIRS = (("one", "fp64"), ("mesh", "fp64"), ("mesh", "one"))


def _worker(argv: list[str]) -> None:
    """``--worker fp32|fp64 LOGITS.npy <glmjax.prefill arguments>`` in this process."""
    precision, logits_path, *prefill_args = argv
    if precision == "fp64":
        import jax
        import jax.numpy as jnp

        jax.config.update("jax_enable_x64", True)
        jnp.float32 = jnp.float64  # before glmjax is imported: every fp32 of the code
    from glmjax.prefill import main

    result = main(prefill_args, progress=None)
    np.save(logits_path, result.logits)


def arrays(states_dir: Path, logits_path: Path | None) -> dict[str, list[np.ndarray]]:
    """{kind: arrays} of one run: logits (when given), per (layer, position) states, per
    layer latents."""
    from glmjax.prefill_states import load_states

    saved = load_states(states_dir)
    tokens = saved.prompt_len
    return {
        **({} if logits_path is None else {"logits": [np.load(logits_path)]}),
        "kda_recurrent": [r[row] for r in saved.recurrent for row in range(len(saved.positions))],
        "kda_conv": [c[row] for c in saved.conv for row in range(len(saved.positions))],
        "mla_latent": [m["latent"].reshape(-1, m["latent"].shape[-1])[:tokens]
                       for m in saved.mla],
    }


def max_relative(actual: list[np.ndarray], reference: list[np.ndarray]) -> float:
    """The largest max |a - r| / max |r| over pairs of arrays, in fp64."""
    return max(float(np.max(np.abs(np.float64(a) - np.float64(r))) / np.max(np.abs(r)))
               for a, r in zip(actual, reference, strict=True))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.prefill_fp64",
                                description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="an fp32 preset")
    p.add_argument("--tokens", type=int, default=350, help="random prompt length")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--budget", type=int, default=128)
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--dcp", type=int, default=2)
    p.add_argument("--other", type=Path, metavar="DIR",
                   help="states another run of the same flags saved (the four-process "
                        "prefill, say): compared with fp64 and one device too, logits aside")
    p.add_argument("--out", type=Path, help="also write the results here (JSON)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    common = ["--preset", args.preset, "--random-tokens", str(args.tokens), "--block-size",
              str(args.block_size), "--budget", str(args.budget), "--dcp", str(args.dcp),
              "--no-compile-cache"]
    runs = {"one": ("fp32", []), "mesh": ("fp32", ["--tp", str(args.tp)]), "fp64": ("fp64", [])}
    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        for name, (precision, extra) in runs.items():
            states, logits = Path(tmp) / name, Path(tmp) / f"{name}.npy"
            subprocess.run([sys.executable, "-m", "bench.prefill_fp64", "--worker", precision,
                            str(logits), *common, *extra, "--save-states", str(states)],
                           check=True, stdout=subprocess.DEVNULL)
            found[name] = arrays(states, logits)
    pairs = PAIRS
    if args.other is not None:
        found["other"] = arrays(args.other, None)
        pairs += (("other", "fp64"), ("other", "one"))
    results = {
        "preset": args.preset, "tokens": args.tokens, "block_size": args.block_size,
        "budget": args.budget, "tp": args.tp, "dcp": args.dcp,
        "other": None if args.other is None else str(args.other),
        "max_rel": {f"{a}-{b}": {kind: max_relative(found[a][kind], found[b][kind])
                                 for kind in found[a]} for a, b in pairs},
    }
    print(f"{args.preset}, {args.tokens} tokens, mesh tp={args.tp} dcp={args.dcp}: "
          f"max |a - b| / max |b| per array, largest of each kind")
    names = list(results["max_rel"])
    print(f"{'kind':16}" + "".join(f"{name:>14}" for name in names))
    for kind in results["max_rel"][names[0]]:
        print(f"{kind:16}" + "".join(f"{results['max_rel'][n][kind]:14.2e}"
                                     if kind in results["max_rel"][n] else f"{'-':>14}"
                                     for n in names))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2:])
    else:
        main()
