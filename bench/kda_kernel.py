"""KDA prefill kernel benchmark: our Pallas scan vs the jax.numpy oracle vs fla `chunk_kda`.

    python -m bench.kda_kernel                      # the three standard cases
    python -m bench.kda_kernel --sweep              # also time every tiling at 32K tokens
    python -m bench.kda_kernel --sweep any --sweep-case 8K --cases 8K
                                                    # the any-decay tilings at 8K
    python -m bench.kda_kernel --pass-cases 32K     # time the passes alone at 32K only
    python -m bench.kda_kernel --heads 16 --cases 32K --segments 1,3,4,8
                                                    # the segment-parallel scan (issue 20)
    python -m bench.kda_kernel --quick              # CPU smoke run: tiny shapes, interpret mode

Cases (H = 32 unless `--heads`, K = V = 128, bf16 q/k/v/beta, fp32 decay): one sequence
of 8192 and of 32768 tokens, a packed batch of 4 x 8192. Rows: our kernel on its bounded-gate path
(`gate_lower_bound=-5`, GLM's gate; the benchmark's decays are inside it) with no snapshot
(capacity 1, inactive) and with 4 snapshots at unaligned offsets; our kernel on its
any-decay path with 4 snapshots, on the same decays and on decays 128x stronger (its
worst case: the diagonal blocks summed key by key); the bounded path with W and U the
other way (read from the W/U pass where the runtime's scan forms them,
`KernelConfig.form_w_u_in_scan`, and the reverse); the jitted jax.numpy chunked oracle; fla-core `chunk_kda`
(output_final_state=True, `cu_seqlens` as its varlen users pass it, under
`torch.inference_mode`) on identical inputs when fla imports, by default (any decay) and
with `safe_gate=True, lower_bound=-5` (its bounded-gate path). `--segments P,...` adds our
bounded path with 4 snapshots and the scan forced to P segments per sequence (1: the plain
scan), at each of `--segment-warps`; `--unfused-output` adds both gate paths with the scan
leaving the output to the chunk-parallel output pass (the runtime's pick,
`KernelConfig.fuse_output`, has the scan compute it). Each case prints the bytes the kernel
moves per token-head by source count (`pallas_kernels.kda_traffic`) and the time they take
at GB10's 273 GB/s.

Timing: warm-up, then `--samples` samples of `--iters` back-to-back launches closed by one
device synchronisation (the launches queue on the device, so a sample measures device
time per call); the table reports the median. Results go to bench/results/kda_kernel.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import relative_error, time_calls, write_json
from pallas_kernels import kda_chunks, kda_pallas, kda_prefill, kda_prep, kda_segments
from pallas_kernels.kda_traffic import traffic_summary
from pallas_kernels.tuning import KernelConfig, device_spec, select_config

HEADS, HEAD_K, HEAD_V = 32, 128, 128
QUICK_HEADS, QUICK_HEAD_DIM = 2, 32  # --quick: interpret mode on the CPU
GATE_LOWER_BOUND = -5.0
CASES = {"8K": [8192], "32K": [32768], "4x8K": [8192] * 4, "quick": [700, 90]}
# The any-decay worst-case row: decays x128 (mean ~ -6 a token) spread wider than the
# diagonal blocks' products take (`kda_prep.MAX_FACTOR_LOG`) in nearly every sub-chunk.
WIDE_DECAY_SCALE = 128.0
WIDE_ROW = "pallas any decay, decays x128, 4 snap"
RESULTS = Path(__file__).parent / "results"


def make_inputs(lens, seed=0):
    """Random inputs shaped like a KDA layer's: unit q/k, logsigmoid/16 decays (HEADS,
    HEAD_K, HEAD_V as `main` sets them)."""
    rng = np.random.default_rng(seed)
    tokens = sum(lens)

    def unit(shape):
        x = rng.standard_normal(shape, np.float32)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    decay = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((tokens, HEADS, HEAD_K))))) / 16
    return dict(
        q=jnp.asarray(unit((tokens, HEADS, HEAD_K)), jnp.bfloat16),
        k=jnp.asarray(unit((tokens, HEADS, HEAD_K)), jnp.bfloat16),
        v=jnp.asarray(rng.standard_normal((tokens, HEADS, HEAD_V)), jnp.bfloat16),
        g=jnp.asarray(decay, jnp.float32),
        beta=jnp.asarray(1.0 / (1.0 + np.exp(-rng.standard_normal((tokens, HEADS)))),
                         jnp.bfloat16),
        cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32),
        initial_states=jnp.zeros((len(lens), HEADS, HEAD_K, HEAD_V), jnp.float32),
    )


def snapshot_offsets(lens, capacity):
    """Four unaligned offsets per sequence (capacity 4), or one inactive slot (capacity 1)."""
    if capacity == 1:
        return jnp.full((len(lens), 1), -1, jnp.int32)
    rows = [[n // 4 + 7, n // 2 - 3, 3 * n // 4 + 1, n] for n in lens]
    return jnp.asarray(rows, jnp.int32)


def floor_bytes(lens, capacity):
    """Fewest bytes a prefill must move: inputs read once, outputs and states written once."""
    tokens, seqs = sum(lens), len(lens)
    per_token = HEADS * (2 * HEAD_K * 2 + HEAD_V * 2 + HEAD_K * 4 + 2 + HEAD_V * 2)
    state = HEADS * HEAD_K * HEAD_V * 4
    return tokens * per_token + seqs * state * (2 + capacity)


def chunked_flops(lens, chunk=64):
    """Matmul FLOPs of the chunked form (Aqk, L, W, U, W S, Qg S, Aqk Vnew, Kg^T Vnew)."""
    tokens = sum(lens)
    per_token = 2 * (2 * chunk * HEAD_K + chunk * HEAD_K + chunk * HEAD_V
                     + 3 * HEAD_K * HEAD_V + chunk * HEAD_V)
    return tokens * HEADS * per_token


def measure_copy_bandwidth():
    """Device-to-device copy rate in bytes/s (read + write), the memory ceiling."""
    x = jnp.ones((512, 1024, 1024), jnp.float32)  # 2 GiB
    copy = jax.jit(lambda a: a + 1.0)
    ms, _ = time_calls(lambda: copy(x), jax.block_until_ready, iters=10, samples=5)
    return 2 * x.nbytes / (ms * 1e-3)


def fla_runner(inputs, lens, **options):
    """fla chunk_kda on the same values (extra keyword options passed through), or None
    when fla / torch cannot run here."""
    try:
        import torch
        from fla.ops.kda import chunk_kda
    except ImportError as error:
        print(f"fla not available: {error}")
        return None, None

    def to_torch(x):
        return torch.from_dlpack(jax.device_get(x).astype(np.float32)).cuda()

    q, k, v, beta = (to_torch(inputs[n]).to(torch.bfloat16)[None] for n in ("q", "k", "v",
                                                                          "beta"))
    g = to_torch(inputs["g"])[None]
    cu = torch.tensor(np.asarray(inputs["cu_seqlens"]), dtype=torch.long, device="cuda")
    h0 = torch.zeros((len(lens), HEADS, HEAD_K, HEAD_V), dtype=torch.float32, device="cuda")

    def call():
        with torch.inference_mode():
            return chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             cu_seqlens=cu, **options)

    return call, lambda out: torch.cuda.synchronize()


def time_passes(inputs, lens, config, timing):
    """Milliseconds of each pass alone: prep (its two kernels, then both), with P > 1 scan
    segments their transitions and their combine, the scan with 4 snapshots (computing
    the output too, with config.fuse_output), else the output pass. On the CPU
    (interpret mode, inputs padded by a chunk of rows) as a smoke test."""
    chunk, segments = config.chunk_size, config.scan_segments
    interpret = jax.default_backend() == "cpu"
    flags = dict(config=config, interpret=interpret, exact=False)
    cu, init = inputs["cu_seqlens"], inputs["initial_states"]
    slots = kda_chunks.chunk_slots(cu, sum(lens), chunk)
    q, k, v, g, beta = (kda_chunks.pad_rows(inputs[n], chunk) if interpret else inputs[n]
                        for n in ("q", "k", "v", "g", "beta"))
    offsets = snapshot_offsets(lens, 4)
    matrices = jax.jit(lambda s: kda_prep.chunk_matrices(
        q, k, g, beta, s, scale=HEAD_K ** -0.5, bounded_gates=True, **flags))
    w_u = jax.jit(lambda m, s: kda_prep.chunk_w_u(m, v, beta, s, **flags))
    prep = jax.jit(lambda s: kda_prep.chunk_prep(
        q, k, v, g, beta, s, scale=HEAD_K ** -0.5, bounded_gates=True, **flags))
    transitions = jax.jit(lambda t, s: kda_segments.segment_transitions(t, s, cu, init,
                                                                        **flags))
    combine = jax.jit(lambda tr: kda_segments.combine_segments(init, tr, segments))
    scan = jax.jit(lambda t, s, states: kda_pallas.chunk_scan(t, k, v, beta, s, cu, states,
                                                              offsets, out_dtype=v.dtype,
                                                              **flags))
    output = jax.jit(lambda t, e, vn, s: kda_pallas.chunk_output(t, e, vn, s,
                                                                 out_dtype=jnp.bfloat16,
                                                                 **flags))
    chunk_matrices = matrices(slots)
    tensors = prep(slots)
    calls = {
        "prep matrices": lambda: matrices(slots),
        "prep w_u": lambda: w_u(chunk_matrices, slots),
        "prep": lambda: prep(slots),
    }
    segment_states = init
    if segments > 1:
        trans = transitions(tensors, slots)
        segment_states = combine(trans)
        calls["segment transitions"] = lambda: transitions(tensors, slots)
        calls["segment combine"] = lambda: combine(trans)
    calls["scan"] = lambda: scan(tensors, slots, segment_states)
    if not config.fuse_output:  # the output pass after a plain scan
        entry_states, v_new, _, _ = scan(tensors, slots, segment_states)
        calls["output"] = lambda: output(tensors, entry_states, v_new, slots)
    return {name: time_calls(call, jax.block_until_ready, **timing)[0]
            for name, call in calls.items()}


def run_case(name, lens, config, args, bandwidth):
    inputs = make_inputs(lens)
    rows = {}

    compiled = {}

    def ours(capacity, bound=GATE_LOWER_BOUND, config=config, inputs=inputs):
        """A call of our kernel; one jitted function per (capacity, bound, config)."""
        offsets = snapshot_offsets(lens, capacity)
        fn = compiled.setdefault((capacity, bound, config), jax.jit(
            lambda i, off: kda_prefill(**i, checkpoint_offsets=off, config=config,
                                       gate_lower_bound=bound)))
        return lambda: fn(inputs, offsets)

    def measure(row, call, sync=jax.block_until_ready, **timing):
        """Time one row; print it at once (compiles make a case take minutes)."""
        rows[row] = time_calls(call, sync, **timing)[0]
        print(f"{name} {row}: {rows[row]:.3f} ms", flush=True)

    timing = dict(iters=args.iters, samples=args.samples)
    bounded4, any_decay4 = ours(4), ours(4, None)  # each compiled once: timed, then checked
    checked = {"bounded": bounded4, "any decay": any_decay4}
    measure("pallas, 0 snapshots", ours(1), **timing)
    measure("pallas, 4 snapshots", bounded4, **timing)
    measure("pallas any decay, 4 snap", any_decay4, **timing)
    # The any-decay path's worst case: decays too wide for the diagonal blocks' products
    # in (nearly) every sub-chunk and head, which then sum them key by key.
    wide = dict(inputs, g=inputs["g"] * WIDE_DECAY_SCALE)
    any_wide4 = ours(4, None, inputs=wide)
    measure(WIDE_ROW, any_wide4, **timing)
    # W and U the other way: read from the W/U pass where the runtime's scan forms them.
    toggled = dataclasses.replace(config, form_w_u_in_scan=not config.form_w_u_in_scan)
    row = ("pallas, W/U in the scan, 4 snap" if toggled.scan_forms_w_u else
           "pallas, W/U pass, 4 snap")
    checked[row] = ours(4, config=toggled)
    measure(row, checked[row], **timing)
    if args.unfused_output:  # the output pass after a plain scan, both gate paths
        unfused = dataclasses.replace(config, fuse_output=False)
        for row, bound in (("pallas output pass, 4 snap", GATE_LOWER_BOUND),
                           ("pallas any decay output pass, 4 snap", None)):
            checked[row] = ours(4, bound, config=unfused)
            measure(row, checked[row], **timing)
    for segments in map(int, filter(None, args.segments.split(","))):
        # one segment is the plain scan, at its own warps
        for warps in args.segment_warps.split(",")[:1 if segments == 1 else None]:
            forced = dataclasses.replace(config, scan_segments=segments,
                                         segment_num_warps=int(warps))
            row = f"pallas {segments} seg{f' w{warps}' if segments > 1 else ''}, 4 snap"
            checked[row] = ours(4, config=forced)
            measure(row, checked[row], **timing)
    ref = jax.jit(lambda i, off: kda_prefill(**i, checkpoint_offsets=off, backend="reference"))
    offsets4 = snapshot_offsets(lens, 4)
    measure("jax.numpy reference", lambda: ref(inputs, offsets4), iters=min(2, args.iters),
            samples=min(args.samples, max(3, args.samples // 2)))
    fla_options = {"fla chunk_kda": {},
                   "fla chunk_kda safe_gate": dict(safe_gate=True, lower_bound=GATE_LOWER_BOUND)}
    for row, options in fla_options.items():
        fla_call, fla_sync = (None, None) if args.no_fla else fla_runner(inputs, lens, **options)
        if fla_call is not None:
            measure(row, fla_call, fla_sync, **timing)

    ref_out = ref(inputs, offsets4)
    errors = {}
    for path, call in checked.items():
        for out_name, a, b in zip(("o", "final_states", "snapshots"), call(), ref_out):
            errors[f"{path} {out_name}"] = relative_error(a, b)
    for out_name, a, b in zip(("o", "final_states", "snapshots"), any_wide4(),
                              ref(wide, offsets4)):
        errors[f"{WIDE_ROW} {out_name}"] = relative_error(a, b)
    floor_ms = floor_bytes(lens, 4) / bandwidth * 1e3
    ours4 = rows["pallas, 4 snapshots"]
    return dict(
        case=name, lens=lens, ms=rows, relative_error_vs_reference=errors,
        traffic=traffic_summary(config, HEAD_K, HEAD_V, tokens=sum(lens),
                                heads=HEADS),
        traffic_unfused_output=(traffic_summary(
            dataclasses.replace(config, fuse_output=False), HEAD_K, HEAD_V,
            tokens=sum(lens), heads=HEADS) if args.unfused_output else None),
        pass_ms=(time_passes(inputs, lens, config, timing)
                 if name in args.pass_cases.split(",") else None),
        snapshot_overhead=ours4 / rows["pallas, 0 snapshots"] - 1.0,
        speedup_vs_reference=rows["jax.numpy reference"] / ours4,
        speedup_vs_fla=(rows["fla chunk_kda"] / ours4) if "fla chunk_kda" in rows else None,
        speedup_vs_fla_safe_gate=(rows["fla chunk_kda safe_gate"] / ours4
                                  if "fla chunk_kda safe_gate" in rows else None),
        floor_ms=floor_ms,
        achieved_bandwidth_gbs=floor_bytes(lens, 4) / (ours4 * 1e-3) / 1e9,
        achieved_tflops=chunked_flops(lens) / (ours4 * 1e-3) / 1e12,
    )


def sweep_configs(base: KernelConfig):
    """(tiling, gate lower bound) pairs: on each gate path (any decay first) the selected
    tiling, then the prep kernel's warps and key slice; on the bounded path also the
    inverse kernel's warps and key slice, W/U's warps and the scan's value block (16:
    twice the programs, 190 registers at 8 warps on sm_90)."""
    for bound in (None, GATE_LOWER_BOUND):
        yield base, bound
        for warps, block_k in ((1, 16), (2, 16), (4, 16), (1, 32), (4, 32), (2, 64)):
            config = dataclasses.replace(base, prep_num_warps=warps, prep_block_k=block_k)
            if config != base:
                yield config, bound
    for warps, block_k in ((1, 16), (1, 64), (2, 32), (2, 64)):
        config = dataclasses.replace(base, inverse_num_warps=warps, inverse_block_k=block_k)
        if config != base:
            yield config, GATE_LOWER_BOUND
    yield dataclasses.replace(base, w_u_num_warps=4), GATE_LOWER_BOUND
    yield dataclasses.replace(base, block_v=16), GATE_LOWER_BOUND


def print_table(results):
    """Milliseconds per row, ratios to ours with 4 snapshots, passes, errors, ceilings."""
    header = f"{'case':6} {'rows':38} {'ms':>9} {'vs ours(4)':>11}"
    print(header)
    for result in results:
        ours4 = result["ms"]["pallas, 4 snapshots"]
        for row, ms in result["ms"].items():
            print(f"{result['case']:6} {row:38} {ms:9.3f} {ms / ours4:10.2f}x")
        for label, traffic in (("", result["traffic"]),
                               ("fused output: ", result.get("traffic_fused_output"))):
            if traffic is None:
                continue
            passes = ", ".join(f"{k} {v:.0f}" for k, v in traffic["bytes_per_token_head"].items())
            print(f"{'':6} {label}scan segments {result['config']['scan_segments']}; bytes per "
                  f"token-head {traffic['total_bytes_per_token_head']:.0f} ({passes}): "
                  f"{traffic['gb10_ms_at_273GBs']:.2f} ms at 273 GB/s")
        if result["pass_ms"]:
            passes = ", ".join(f"{k} {v:.3f}" for k, v in result["pass_ms"].items())
            print(f"{'':6} passes alone (ms): {passes}")
        errors = ", ".join(f"{k} {v:.1e}" for k, v in
                           result["relative_error_vs_reference"].items())
        print(f"{'':6} relative error vs the reference: {errors}")
        print(f"{'':6} snapshot overhead {100 * result['snapshot_overhead']:+.1f}%, "
              f"floor {result['floor_ms']:.3f} ms, "
              f"{result['achieved_bandwidth_gbs']:.0f} GB/s, "
              f"{result['achieved_tflops']:.1f} TFLOP/s")


def write_results(path, args, device, bandwidth, results, sweep):
    """The JSON the committed results and the plots come from."""
    payload = dict(
        args={k: str(v) for k, v in vars(args).items()},
        device=device.device_kind, jax=jax.__version__, python=platform.python_version(),
        copy_bandwidth_tbs=bandwidth / 1e12, heads=HEADS, head_k=HEAD_K, head_v=HEAD_V,
        timing="median of samples; each sample = iters queued calls / one sync",
        results=results, sweep=sweep,
    )
    write_json(payload, path)


def main(argv=None):
    global HEADS, HEAD_K, HEAD_V
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="8K,32K,4x8K")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--unfused-output", action="store_true",
                        help="also time the plain scan and the output pass (both gate paths)")
    parser.add_argument("--segments", default="",
                        help="also time the scan forced to these segment counts, e.g. 1,3,8")
    parser.add_argument("--segment-warps", default=str(KernelConfig.segment_num_warps),
                        help="warps of the segment kernels for --segments, e.g. 4,8")
    parser.add_argument("--quick", action="store_true",
                        help="CPU smoke run: the quick case, 2 heads of 32, one sample")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--sweep", nargs="?", const="all", choices=("all", "bounded", "any"),
                        help="also time the tilings of `sweep_configs` at --sweep-case, on "
                        "both gate paths or one")
    parser.add_argument("--sweep-case", default="32K", choices=sorted(CASES))
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--pass-cases", default="8K,32K,4x8K",
                        help="cases whose passes are also timed alone (a minute of compiles each)")
    parser.add_argument("--out", type=Path, default=RESULTS / "kda_kernel.json")
    args = parser.parse_args(argv)
    HEADS = args.heads
    if args.quick:  # interpret mode: no fla; passes alone only with --pass-cases quick
        HEADS, HEAD_K, HEAD_V = QUICK_HEADS, QUICK_HEAD_DIM, QUICK_HEAD_DIM
        args.no_fla, args.iters, args.samples = True, 1, 1
        args.cases = "quick" if args.cases else ""  # --cases '': the sweep alone
        args.pass_cases = "quick" if args.pass_cases == "quick" else ""
    cases = list(filter(None, args.cases.split(",")))  # none: the sweep alone
    for name in {*cases, *filter(None, args.pass_cases.split(","))} - set(CASES):
        parser.error(f"unknown case {name!r}: the cases are {', '.join(CASES)}")

    device = jax.devices()[0]
    spec = device_spec(device)
    bandwidth = 4.8e12 if args.quick else measure_copy_bandwidth()
    print(f"device {device.device_kind}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    sweep = []
    if args.sweep:
        lens = CASES[args.sweep_case]
        inputs = make_inputs(lens)
        offsets = snapshot_offsets(lens, 4)
        base = select_config(spec, num_seqs=1, num_heads=HEADS, head_k=HEAD_K, head_v=HEAD_V,
                             num_tokens=sum(lens))
        reference = jax.jit(lambda i, off: kda_prefill(**i, checkpoint_offsets=off,
                                                       backend="reference"))(inputs, offsets)
        for config, bound in sweep_configs(base):
            if args.sweep != "all" and (bound is None) != (args.sweep == "any"):
                continue
            fn = jax.jit(lambda i, off, c=config, b=bound: kda_prefill(
                **i, checkpoint_offsets=off, config=c, gate_lower_bound=b))
            errors = {}
            try:
                ms = time_calls(lambda fn=fn: fn(inputs, offsets), jax.block_until_ready,
                                iters=min(5, args.iters), samples=min(3, args.samples))[0]
                # a fast tiling must also be right: its errors against the reference
                errors = {out: relative_error(a, b) for out, a, b in
                          zip(("o", "final_states", "snapshots"), fn(inputs, offsets), reference)}
            except Exception as error:  # a tiling that fails to compile is reported
                print(f"{config}: failed: {type(error).__name__}: {str(error)[:200]}")
                ms = None
            gate = "bounded" if bound is not None else "any decay"
            sweep.append(dict(config=dataclasses.asdict(config), gate=gate,
                              case=args.sweep_case, ms=ms, relative_error_vs_reference=errors))
            print(f"sweep {args.sweep_case} {gate} {config}: {ms} ms, errors "
                  + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
            write_results(args.out, args, device, bandwidth, [], sweep)

    results = []
    for name in cases:
        lens = CASES[name]
        config = select_config(spec, num_seqs=len(lens), num_heads=HEADS, head_k=HEAD_K,
                               head_v=HEAD_V, num_tokens=sum(lens))
        result = run_case(name, lens, config, args, bandwidth)
        result["config"] = dataclasses.asdict(config)
        results.append(result)
        write_results(args.out, args, device, bandwidth, results, sweep)  # after every case
    print_table(results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
