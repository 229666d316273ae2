"""Block sizes, warps and pipeline stages for the KDA kernels, picked from the device.

The deployment target is GB10 (DGX Spark, compute capability 12.1, 48 SMs, 99 KB of shared
memory per block); measurements run on an H200 (9.0, 132 SMs, 227 KB). `select_config`
maps a `DeviceSpec` to a `KernelConfig`; `estimate_shared_memory` is the model used to keep
a configuration inside the device's per-block limit (the real compile-and-measure check is
`python -m pallas_kernels.aot`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

FP32_BYTES = 4
SUB_CHUNK = 16  # rows per sub-chunk of the KDA prep: the smallest tile a Triton dot accepts
# Shared memory the KDA prep kernel takes at any stage count (Triton 3.9, sm_90 and sm_121)
PREP_SCRATCH = 4096


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """What the configuration depends on: compute capability, SM count, smem per block."""

    name: str
    compute_capability: tuple[int, int]
    num_sms: int
    smem_per_block: int  # bytes a block may use (opt-in maximum)
    memory_bandwidth: float = 0.0  # bytes/s; 0: unknown (the segment rule ignores it)


H200 = DeviceSpec("NVIDIA H200", (9, 0), 132, 227 * 1024, 4.8e12)
GB10 = DeviceSpec("NVIDIA GB10", (12, 1), 48, 99 * 1024, 273e9)
KNOWN_DEVICES = {"h200": H200, "gb10": GB10}


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static tiling of the two passes (hashable: it is a jit static argument)."""

    chunk_size: int = 64
    block_v: int = 64           # value columns per scan program
    scan_num_warps: int = 8
    scan_num_stages: int = 1
    # Prep: G, Qg, Kg, Aqk and T = (I + L)^-1 per chunk, over slices of `prep_block_k` key
    # columns (a loop). 2 warps x 32 columns was the fastest of ten tilings on the H200 at
    # 8K (docs/KERNEL.md, fifteenth session), and with 2 x 64 within noise of the fastest
    # on an H100 once the kernel stopped spilling (twenty-third session).
    prep_num_warps: int = 2
    prep_block_k: int = 32
    # Pipeline stages of the prep and inverse kernels' key-slice loops: at 2, Triton's
    # pipeliner issues a slice's loads (cp.async into shared memory) during the slice
    # before; both kernels wait mostly on those loads (docs/KERNEL.md, twenty-fifth,
    # twenty-ninth and thirtieth sessions). Through XLA for sm_90a at 2: the inverse 96 ->
    # 112 registers, 8 -> 0 B of spills; the prep 144 -> 812 B of spills. On an H100 at
    # 8K the inverse at 2 took the call 3-4% faster, the prep at 2 8% slower (0-2% slower
    # over 16-column slices): `select_config` picks the inverse's 2 on sm_90.
    prep_num_stages: int = 1
    # Prep: the diagonal 16 x 16 blocks and their inverses, a sub-chunk a program, their
    # products over slices of `inverse_block_k` key columns.
    inverse_num_warps: int = 1
    inverse_block_k: int = 32
    inverse_num_stages: int = 1  # see prep_num_stages
    w_u_num_warps: int = 8      # prep: W and U per chunk
    output_block_v: int = 128   # value columns per output program
    output_num_warps: int = 4
    output_num_stages: int = 1
    # The segment-parallel scan (docs/KERNEL.md): each sequence split into this many
    # segments, 1 = the plain scan. Its two loop kernels (the segments' transitions and
    # the scan from each segment's entry state) run at these warps and stages.
    scan_segments: int = 1
    segment_num_warps: int = 4
    segment_num_stages: int = 1
    # The output O = Qg S_entry + Aqk Vnew computed by the scan itself, chunk by chunk,
    # instead of by the chunk-parallel output pass: the entry states and Vnew are never
    # stored (1,792 fewer bytes a token-head by source count, `kda_traffic`), at two more
    # matmuls a chunk on the scan's serial path (docs/KERNEL.md). `select_config` picks it.
    fuse_output: bool = False
    # W = T (beta k exp(G)) and U = T diag(beta) v formed by the scan, chunk by chunk, from
    # T, beta k exp(G), v and beta, instead of read from the W/U pass: 1,024 fewer bytes a
    # token-head by source count (`kda_traffic`), at two more matmuls a chunk in every
    # value-block program (W's repeated in each). Plain scan only: with `scan_segments` >
    # 1 the transitions read W and U, and the W/U pass runs. `select_config` picks it
    # (docs/KERNEL.md, seventeenth session).
    form_w_u_in_scan: bool = False
    # The scan's loads Triton does not pipeline (G_last's row, beta v) issued one chunk
    # ahead and carried in the loop, instead of first thing in each chunk: on the H100
    # 3-4% / 2.5% / 1.3% faster at 8K / 32K / 4 x 8K (docs/KERNEL.md, twenty-sixth
    # session). `select_config` picks it on sm_90 only: for sm_121 Triton's compile spills
    # 296 bytes a thread with it against 64 without (`pallas_kernels.aot`).
    scan_prefetch: bool = False

    @property
    def scan_forms_w_u(self) -> bool:
        """Whether the scan forms W and U itself (`form_w_u_in_scan`, plain scan)."""
        return self.form_w_u_in_scan and self.scan_segments == 1


def device_spec(device: jax.Device | None = None) -> DeviceSpec:
    """DeviceSpec of a JAX GPU device (defaults to the first device)."""
    device = device or jax.devices()[0]
    if device.platform != "gpu":
        return H200
    major, minor = (int(x) for x in str(device.compute_capability).split("."))
    num_sms = int(getattr(device, "core_count", 0) or 0)
    # sm_12x (consumer Blackwell, GB10) has 99 KB per block, sm_90/sm_100 227 KB, sm_80 163 KB.
    if major == 12:
        smem = 99 * 1024
    elif major == 8:
        smem = 163 * 1024
    else:
        smem = 227 * 1024
    # Memory bandwidth: GB10's for sm_12x (the deployment target), the H200's for sm_90.
    bandwidth = {12: GB10.memory_bandwidth, 9: H200.memory_bandwidth}.get(major, 0.0)
    return DeviceSpec(device.device_kind, (major, minor), num_sms or 1, smem, bandwidth)


def estimate_shared_memory(config: KernelConfig, head_k: int, head_v: int, *,
                           compute_capability: tuple[int, int],
                           operand_bytes: int = 2) -> dict[str, int]:
    """Upper estimate of shared memory per block, in bytes, for each pass.

    Scan pass: the operands of its largest dots are staged in shared memory, and each
    pipeline stage past the first buffers the tiles loaded per chunk (W or beta k exp(G),
    Qg, Kg [C, K], Aqk [C, C] unless carried, U or v [C, BV] in the operand dtype; and
    T [C, C] where the scan forms W and U). Hopper and datacenter Blackwell (9.x, 10.x) feed wgmma from
    shared memory and double-buffer those tiles; mma.sync targets (8.x, 12.x, GB10 among
    them) stage them once, Qg not among them (measured). The segment-parallel scan's
    kernels ("segment") hold the same tiles at `segment_num_stages`. Prep pass: its two
    kernels loop over key slices, and each pipeline stage holds one slice's q and k (operand
    dtype) and g (fp32): the inverse kernel ("inverse") a [16, inverse_block_k] slice at
    each of its stages, the prep kernel ("prep") a [C, prep_block_k] slice at each stage
    past the first, over a 4,096 B scratch it takes at any stage count. Output pass (no
    loop): its operands Qg [C, K], S [K, BV_out], Aqk [C, C] and Vnew [C, BV_out].

    Calibrated against Triton 3.9 (`python -m pallas_kernels.aot`; the test suite checks
    that the estimate bounds what Triton allocates, and not by more than 2x): e.g. block_v
    32, 2 stages, bf16, output fused: sm_90 159,744 B (estimate 172,032), 176,128 with W
    and U formed in the scan (188,416); sm_121 77,824 (78,848), 86,016 (87,040) since the
    snapshot code exists once in the scan (86,528 before); the inverse 4,096 B a stage and
    the prep 4,096 / 19,456 at 1 / 2 stages on both.
    """
    c, bv = config.chunk_size, config.block_v
    formed = operand_bytes * c * c if config.scan_forms_w_u else 0  # T
    if compute_capability[0] in (9, 10):
        loop_tiles = operand_bytes * (3 * c * head_k + c * c + c * bv) + formed
        base, per_stage = 2 * c * head_k * operand_bytes + head_k * bv * FP32_BYTES, 2 * loop_tiles
    else:
        loop_tiles = operand_bytes * (2 * c * head_k + c * c + c * bv) + formed
        base, per_stage = 2 * c * head_k * operand_bytes + 1024, loop_tiles
    scan = base + max(0, config.scan_num_stages - 1) * per_stage
    segment = base + max(0, config.segment_num_stages - 1) * per_stage

    def key_slice(rows, block_k):  # q and k in the operand dtype, g in fp32
        return rows * min(block_k, head_k) * (2 * operand_bytes + FP32_BYTES)

    inverse = config.inverse_num_stages * key_slice(SUB_CHUNK, config.inverse_block_k)
    prep = PREP_SCRATCH + max(0, config.prep_num_stages - 1) * key_slice(c, config.prep_block_k)
    out_v = min(config.output_block_v, head_v)
    output = operand_bytes * (c * head_k + head_k * out_v + c * c + c * out_v)
    return {"scan": scan, "segment": segment, "inverse": inverse, "prep": prep,
            "output": output}


# The segment-parallel scan's rule (`scan_segments`), a model in units of one chunk step
# of one scan program (docs/KERNEL.md, "The segment-parallel scan"):
SCAN_STEP_SECONDS = 2.6e-6      # H200: the scan, 1.36 ms for 512 chunks in one wave (32K)
REGISTERS_PER_SM = 65536        # sm_90 and sm_121 alike
SCAN_REGISTERS = 256            # per thread, scan kernels: 255 with the snapshot code (aot)
TRANSITION_REGISTERS = 168      # kda_segment_transition at 4 warps: 126 sm_90, 168 sm_121
SEGMENT_STEP_COST = 1.14        # a step at 4 warps against 8: 1.48 / 1.30 ms (H200, 32K)
MIN_SEGMENT_GAIN = 1.2          # modelled speed-up below which the plain scan is kept
MIN_SEGMENT_CHUNKS = 16         # chunks per segment below which segments are not worth it
MAX_SEGMENTS = 16


def resident_programs(num_warps: int, registers: int = SCAN_REGISTERS) -> int:
    """Programs of `num_warps` warps one SM holds at once, limited by registers."""
    return max(1, REGISTERS_PER_SM // (registers * 32 * num_warps))


def segment_model(num_sms: int, programs: int, key_blocks: int, value_blocks: int,
                  segments: int, chunks: int, *, plain_warps: int, segment_warps: int) -> float:
    """Modelled scan time (chunk steps of one program) of one sequence of `chunks` chunks.

    programs: plain-scan programs (sequences x heads x value blocks). segments = 1 is the
    plain scan: ceil(programs / slots) waves of `chunks` steps. With P > 1 segments of
    ceil(chunks / P) steps: the transitions of segments 0..P-2 (segment 0 only its value
    columns, the others key and value columns), then the scan of all P segments, each a
    number of waves of that length, at SEGMENT_STEP_COST per step; the combine is ignored.
    A wave is as many programs as the SMs hold (`resident_programs`: the transitions need
    fewer registers than the scan, which carries the snapshot code).
    """
    def waves(count, warps, registers=SCAN_REGISTERS):
        return -(-count // (num_sms * resident_programs(warps, registers)))

    if segments == 1:
        return float(waves(programs, plain_warps) * chunks)
    per_head = programs // value_blocks
    transitions = programs + (segments - 2) * per_head * (key_blocks + value_blocks)
    length = -(-chunks // segments)
    return SEGMENT_STEP_COST * length * (
        waves(transitions, segment_warps, TRANSITION_REGISTERS)
        + waves(programs * segments, segment_warps))


def select_segments(spec: DeviceSpec, config: KernelConfig, *, num_seqs: int, num_heads: int,
                    head_k: int, head_v: int, num_tokens: int | None) -> int:
    """Segments per sequence for the scan: of the counts from 3 to MAX_SEGMENTS that leave
    every segment MIN_SEGMENT_CHUNKS chunks (at the average sequence length), the one the
    model (`segment_model`) finds fastest, if it beats the plain scan by MIN_SEGMENT_GAIN;
    else 1 (plain).

    Each count's modelled time is its steps at SCAN_STEP_SECONDS, or the time the scan's
    bytes (the transitions' included: `kda_traffic`) take at the device's bandwidth, if
    longer: a bandwidth-bound scan gains nothing from segments that add bytes.
    Two segments never help (the second waits for the first), so P starts at 3. Without
    a token count (`num_tokens=None`) the scan stays plain.
    """
    from pallas_kernels.kda_traffic import bytes_per_token_head  # it imports this module

    if num_tokens is None:
        return 1
    chunks = -(-num_tokens // (num_seqs * config.chunk_size))
    value_blocks = head_v // config.block_v
    steps = functools.partial(segment_model, spec.num_sms, num_seqs * num_heads * value_blocks,
                              head_k // config.block_v, value_blocks, chunks=chunks,
                              plain_warps=config.scan_num_warps,
                              segment_warps=config.segment_num_warps)

    def seconds(segments):
        passes = bytes_per_token_head(dataclasses.replace(config, scan_segments=segments),
                                      head_k, head_v)
        scan_bytes = (passes["scan"] + passes.get("transition", 0.0)) * num_tokens * num_heads
        floor = scan_bytes / spec.memory_bandwidth if spec.memory_bandwidth else 0.0
        return max(steps(segments) * SCAN_STEP_SECONDS, floor)

    candidates = range(3, min(MAX_SEGMENTS, chunks // MIN_SEGMENT_CHUNKS) + 1)
    best = min(candidates, key=lambda p: (seconds(p), p), default=1)
    return best if seconds(1) >= MIN_SEGMENT_GAIN * seconds(best) else 1


def select_config(spec: DeviceSpec, *, num_seqs: int, num_heads: int, head_k: int,
                  head_v: int, operand_bytes: int = 2,
                  num_tokens: int | None = None) -> KernelConfig:
    """Pick the tiling for a device and a problem shape.

    The scan runs one program per (sequence, head, value block). Value blocks of 32 were
    fastest on the H200 at 32K tokens (bench/results/kda_kernel_091ba60.json, sweep) and
    keep GB10 free of register spills; 2 pipeline stages beat 1 there. Stages are dropped while the
    shared-memory estimate exceeds the device's per-block limit; the output pass takes the
    widest value block (128, 64, 32; 128 was fastest on the H200) that fits. When those
    programs leave most SMs idle (few sequences x heads, long sequences: `num_tokens` rows
    in all), the scan is split into segments (`select_segments`). The scan computes the
    output itself (`fuse_output`): 1-2% faster than the output pass on the H200 at 8K and
    32K on both gate paths (bench/results/kda_kernel_fused_2026-12-02e.json) and 24% fewer
    bytes, which is what decides GB10's speed; `output_block_v` then only matters to a
    config that turns it off. The scan also forms W and U itself (`form_w_u_in_scan`): 17%
    fewer bytes (GB10's speed) and on the H100 as fast or faster than the W/U pass at 8K,
    32K and 4 x 8K (1.443 / 5.646 / 6.076 ms against 1.480 / 5.652 / 6.119,
    bench/results/kda_kernel_*_h100_2026-12-05c.json). On the H200 the W/U pass was 4%
    faster at 8K (1.401 against 1.457 ms, kda_kernel_8K_h200_2026-12-06.json; 32K and
    4 x 8K untimed there), so the H200's pick may change once those are timed. On sm_90
    the scan loads G_last and beta v a chunk ahead (`scan_prefetch`, timed on an H100) and
    the inverse kernel's key-slice loads are pipelined (`inverse_num_stages` 2: on an H100
    0.991 / 3.929 ms against 1.026 / 4.100 at 8K / 4 x 8K, bounded gate,
    bench/results/kda_stages_h100_2026-12-07.txt). For sm_121 it compiles at 2 stages
    within 8,192 B (`python -m pallas_kernels.aot`) but is untimed there: GB10 keeps 1.
    """
    def fits(candidate, pass_name):
        estimate = estimate_shared_memory(candidate, head_k, head_v,
                                          compute_capability=spec.compute_capability,
                                          operand_bytes=operand_bytes)
        return estimate[pass_name] <= spec.smem_per_block

    hopper = spec.compute_capability[0] == 9
    base = KernelConfig(block_v=min(32, head_v), fuse_output=True, form_w_u_in_scan=True,
                        scan_prefetch=hopper, inverse_num_stages=2 if hopper else 1)
    for stages in (2, 1):
        config = dataclasses.replace(base, scan_num_stages=stages)
        if not all(fits(config, name) for name in ("scan", "segment", "inverse", "prep")):
            continue
        for out_v in (128, 64, 32):
            candidate = dataclasses.replace(config, output_block_v=min(out_v, head_v))
            if fits(candidate, "output"):
                segments = select_segments(spec, candidate, num_seqs=num_seqs,
                                           num_heads=num_heads, head_k=head_k, head_v=head_v,
                                           num_tokens=num_tokens)
                return dataclasses.replace(candidate, scan_segments=segments)
    raise ValueError(
        f"no KDA kernel configuration fits {spec.smem_per_block} bytes of shared memory on "
        f"{spec.name} for head_k={head_k}, head_v={head_v}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of the decode kernel: one program per (row, head, value block) holds the
    [K, block_v] fp32 state tile in registers (hashable: a jit static argument)."""

    block_v: int = 32
    num_warps: int = 4


FUSED_DECODE_WAVES = 2  # most (row, head) programs per SM for the fused decode step


def use_fused_decode(spec: DeviceSpec, *, num_rows: int, num_heads: int) -> bool:
    """Whether a KDA decode step of `num_rows` rows runs as one fused launch
    (`pallas_kernels.kda_decode_fused`, a program per row and head holding the whole
    [K, V] state: one resident per SM) rather than the conv, norms and gates as XLA ops
    around `kda_decode`. On the H200 at kimi-linear-48b's 32 heads the fused step took
    14.8 us a layer at one row (one wave of programs) where the per-op path's 16 launches
    took ~38 us with their gaps; at 64 rows (15.5 waves) the whole step was ~2 ms slower
    (33.5 against 31.2 ms). The crossover is not measured yet: two waves is the guess.
    """
    return num_rows * num_heads <= FUSED_DECODE_WAVES * spec.num_sms


def select_decode_config(spec: DeviceSpec, *, num_rows: int, num_heads: int, head_k: int,
                         head_v: int) -> DecodeConfig:
    """Pick the decode kernel's tiling for a device and a problem shape.

    The kernel streams each state once, so it needs enough programs in flight to cover
    memory latency and a state tile that stays in registers. A [128, 32] fp32 tile over 4
    warps is 32 registers per thread, far from spilling on sm_90 and sm_121 (the AOT check
    reports it). Narrower value blocks (16) double the programs when there are too few to
    give each SM four, as at one or a few rows; block_v=32 at 64 rows x 64 heads is 16,384
    programs, a value `python -m bench.kda_decode --sweep` checks against 16 and 64.
    """
    block_v = min(32, head_v, max(16, 4096 // head_k))  # a tile of <= 4096 fp32 at K <= 256
    if num_rows * num_heads * (head_v // block_v) < 4 * spec.num_sms:
        block_v = min(16, head_v)
    return DecodeConfig(block_v=block_v)
