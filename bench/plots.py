"""Figures from the benchmark JSON: kernel time against tokens, coalesced vs ladder TTFT.

    pip install -e '.[plots]'      # matplotlib, an optional extra
    python -m bench.plots          # reads bench/results/, writes docs/img/*.png

- docs/img/kda_kernel_ms.png from bench/results/kda_kernel.json (`python -m bench.kda_kernel`):
  ms per call against tokens for our Pallas scan (4 snapshots), fla `chunk_kda` and the
  jax.numpy reference; single sequences joined by lines, packed batches as open markers.
- docs/img/prefill_ttft_<preset>.png from each bench/results/prefill_<preset>.json
  (`python -m bench.prefill`): median cold TTFT against prompt length, coalesced and
  ladder, each point labelled with the ladder / coalesced ratio. Skipped or failed lengths
  are left out.
- docs/img/moe_<preset>_<part>.png from every bench/results/moe*.json of the H200 joined
  (`python -m bench.moe`): useful TFLOP/s against tokens, one series per implementation, with the
  memory floor (every expert's weights read once at 4.8 TB/s) as the TFLOP/s it allows.
  Failed (e.g. out-of-memory) points are left out.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
IMAGES = Path(__file__).parent.parent / "docs" / "img"
KERNEL_ROWS = {  # label -> key in kda_kernel.json's "ms"
    "ours (Pallas, 4 snapshots)": "pallas, 4 snapshots",
    "fla chunk_kda": "fla chunk_kda",
    "jax.numpy reference": "jax.numpy reference",
}
MODES = {"coalesced": "coalesced", "ladder": "ladder (coalescing off)"}


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "bench.plots needs matplotlib, which is not a project dependency: install the "
            "optional extra with `pip install -e '.[plots]'` (or `pip install matplotlib`)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def kernel_figure(plt, results: dict, path: Path) -> None:
    """ms per call against total tokens, one series per implementation."""
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for (label, key), color in zip(KERNEL_ROWS.items(), ("C0", "C1", "C2")):
        single = sorted((sum(r["lens"]), r["ms"][key]) for r in results["results"]
                        if len(r["lens"]) == 1 and key in r["ms"])
        packed = [(sum(r["lens"]), r["ms"][key], r["case"]) for r in results["results"]
                  if len(r["lens"]) > 1 and key in r["ms"]]
        if single:
            ax.plot(*zip(*single), "o-", color=color, label=label)
        for tokens, ms, case in packed:
            ax.plot(tokens, ms, "s", color=color, markerfacecolor="none")
            ax.annotate(case, (tokens, ms), textcoords="offset points", xytext=(6, -3),
                        fontsize=7, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.margins(x=0.15)
    ax.set_xlabel("tokens (open squares: packed batch)")
    ax.set_ylabel("ms per call")
    ax.set_title(f"KDA prefill scan, H={results['heads']}, K=V={results['head_k']}, "
                 f"{results['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    _save(fig, path)


def prefill_figure(plt, results: dict, path: Path) -> bool:
    """Median cold TTFT against prompt length; False when no length has both modes."""
    rows = sorted((e for e in results.get("cold", []) if e.get("ratio")),
                  key=lambda e: e["tokens"])
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    tokens = [e["tokens"] for e in rows]
    for mode, label in MODES.items():
        ax.plot(tokens, [e[mode]["median_ttft_s"] for e in rows], "o-", label=label)
    for index, e in enumerate(rows):  # labels alternate above / below: lengths may be close
        target = f" (target {e['target_ratio']:.2f})" if e.get("target_ratio") else ""
        ax.annotate(f"{e['ratio']:.2f}x{target}", (e["tokens"], e["ladder"]["median_ttft_s"]),
                    textcoords="offset points", xytext=(6, 8 if index % 2 == 0 else -14),
                    fontsize=7)
    model = results["model"]
    ax.set_xlabel("prompt tokens (cold)")
    ax.set_ylabel("median time to first token (s)")
    ax.set_title(f"{model['name']} on {results['device']}, budget "
                 f"{results['engine']['budget']}; label: ladder / coalesced", fontsize=9)
    ticks = []  # [position, label]: lengths within 5% of the previous share one tick
    for t in tokens:
        if ticks and t < 1.05 * ticks[-1][0]:
            ticks[-1][1] += f"\n{t}"
        else:
            ticks.append([t, str(t)])
    ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks], fontsize=7)
    ax.margins(x=0.1, y=0.15)
    ax.grid(True, alpha=0.3)
    ax.legend()
    _save(fig, path)
    return True


def moe_figures(plt, results: dict, out: Path, stem: str) -> list[Path]:
    """Per preset and part ("gemm": one grouped GEMM, "moe": the routed experts): useful
    TFLOP/s against tokens, per implementation, and the memory floor's bound. `results`
    may join several runs' rows (`main` joins every bench/results/moe*.json of a device)."""
    written = []
    for preset, part in sorted({(r["preset"], r["part"]) for r in results["rows"]}):
        rows = [r for r in results["rows"] if r["preset"] == preset and r["part"] == part]
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for impl in dict.fromkeys(r["impl"] for r in rows):
            points = sorted({r["tokens"]: r["tflops"] for r in rows  # a later run wins
                             if r["impl"] == impl and "tflops" in r}.items())
            if points:
                ax.plot(*zip(*points), "o-", label=impl)
        floor = sorted({(r["tokens"], r["useful_tflop"] / r["floor_ms_h200"] * 1e3)
                        for r in rows if r["impl"] != "dense"})
        ax.plot(*zip(*floor), "k--", label="memory floor (all experts' weights, 4.8 TB/s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (each routed to top-k experts)")
        ax.set_ylabel("useful TFLOP/s")
        what = "one gate-shaped grouped GEMM" if part == "gemm" else "routed experts"
        ax.set_title(f"{preset}, {rows[0]['experts']} experts: {what} ({results['device']})",
                     fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = out / f"{stem}_{preset}_{part}.png"
        _save(fig, path)
        written.append(path)
    return written


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m bench.plots",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=IMAGES)
    args = parser.parse_args(argv)
    plt = _pyplot()
    written = []
    kernel = args.results / "kda_kernel.json"
    if kernel.is_file():
        path = args.out / "kda_kernel_ms.png"
        kernel_figure(plt, json.loads(kernel.read_text()), path)
        written.append(path)
    for source in sorted(args.results.glob("prefill_*.json")):
        path = args.out / f"{source.stem.replace('prefill_', 'prefill_ttft_', 1)}.png"
        if prefill_figure(plt, json.loads(source.read_text()), path):
            written.append(path)
        else:
            print(f"{source}: no cold length with both schedules measured; no figure")
    moe_runs = [json.loads(p.read_text()) for p in sorted(args.results.glob("moe*.json"))]
    for device in dict.fromkeys(run["device"] for run in moe_runs):
        rows = [row for run in moe_runs if run["device"] == device for row in run["rows"]]
        stem = "moe" + ("" if device == "NVIDIA H200" else "_" + device.replace(" ", "_"))
        written += moe_figures(plt, {"device": device, "rows": rows}, args.out, stem)
    if not written:
        raise SystemExit(f"no benchmark results in {args.results}")
    return written


if __name__ == "__main__":
    main()
