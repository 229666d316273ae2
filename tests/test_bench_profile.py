"""The per-op profile of the benchmarks: the trace parser on a synthetic GPU trace shaped like
the ones XLA's CUPTI collector writes, and on a real CPU trace; scope paths from HLO text.

GPU events as jax 0.11.2's exporter writes them (xla/tsl/profiler/convert/
xplane_to_trace_events.cc): one process per device plane named "/device:GPU:N", one thread
per line ("Stream #N(...)" for CUDA streams), each kernel's args holding the keys of its
launch annotation (``XlaModule:#prefix=...,hlo_module=...#::Thunk:#name=...,hlo_op=...#``,
xla/backends/gpu/runtime/annotation.cc) next to CUPTI's own stats.
"""

import gzip
import json

import jax
import jax.numpy as jnp
import pytest

from bench.profile import (
    CATEGORIES,
    KernelEvent,
    categorize,
    hlo_op_paths,
    kernel_events,
    profile_call,
    summarize,
)

GPU, HOST = 1001, 1


def _meta(pid, name, tid=None):
    event = {"ph": "M", "pid": pid, "name": "process_name" if tid is None else "thread_name",
             "args": {"name": name}}
    return event if tid is None else event | {"tid": tid}


def _kernel(ts, dur, kernel, tid=7, pid=GPU, **args):
    base = {"correlation_id": "41", "kernel_details": "regs:128 static_shared:0 grid:132,1,1",
            "hlo_module": "jit_prefill_step", "program_id": "17", "tf_op": "XlaModule"}
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": kernel,
            "args": base | args}


PREFIX = "jit(prefill_step)"
GPU_TRACE = {"displayTimeUnit": "ns", "traceEvents": [
    _meta(HOST, "/host:CPU"), _meta(HOST, "python", tid=5),
    _meta(GPU, "/device:GPU:0 (NVIDIA H200)"), _meta(GPU, "Stream #7(Kernel,MemcpyD2D)", 7),
    _meta(GPU, "Stream #13(Kernel)", 13), _meta(GPU, "XLA Ops", 100),
    # Routed experts: a cuBLAS kernel; the name is relative to the module's prefix.
    _kernel(0.0, 500.0, "nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNN", hlo_op="cublas-gemm.3",
            prefix=PREFIX, name="decoder_block/moe/routed_experts/ragged_dot"),
    _kernel(500.0, 20.0, "loop_gather_fusion", hlo_op="loop_gather_fusion.2", prefix=PREFIX,
            name="decoder_block/moe/routed_experts"),
    # The detailed annotation level's full op_name wins over prefix + name.
    _kernel(520.0, 100.0, "kda_scan_kernel", hlo_op="custom-call.9", prefix=PREFIX,
            name="decoder_block/kda", op_name=f"{PREFIX}/decoder_block/kda/kda_scan/pallas_call"),
    _kernel(620.0, 30.0, "input_reduce_fusion", hlo_op="input_reduce_fusion.4", prefix=PREFIX,
            name="decoder_block/mla_prefill/attention/dsa_indexer/reduce_sum"),
    _kernel(650.0, 70.0, "loop_exponential_fusion", hlo_op="loop_exponential_fusion",
            prefix=PREFIX, name="decoder_block/mla_prefill/attention/while/body/exp"),
    # A projection outside every category scope: a Triton GEMM fusion, another stream.
    _kernel(650.0, 40.0, "gemm_fusion_dot_general_3", hlo_op="gemm_fusion_dot_general.3",
            tid=13, prefix=PREFIX, name="decoder_block/kda/dot_general"),
    _kernel(720.0, 10.0, "loop_add_fusion", hlo_op="loop_add_fusion.1", prefix=PREFIX,
            name="decoder_block/mhc_write/add"),
    _kernel(730.0, 5.0, "loop_convert_fusion", hlo_op="loop_convert_fusion.8", prefix=PREFIX,
            name="decoder_block/kda/conv"),
    _kernel(735.0, 5.0, "MemcpyD2D", hlo_op="copy-start.2"),  # no op name: other
    # Not device time on a stream: xprof's derived line and the host's launch call.
    _kernel(0.0, 740.0, "decoder_block", tid=100, name="decoder_block"),
    _kernel(0.0, 3.0, "cuLaunchKernel", pid=HOST, tid=5, hlo_op="cublas-gemm.3",
            name="decoder_block/moe/routed_experts/ragged_dot"),
]}


def test_gpu_trace_kernels_are_stream_events_attributed_by_scope():
    events = kernel_events(GPU_TRACE)
    summary = summarize(events, {"routed_experts": 10 ** 12, "kda_projections": 10 ** 11},
                        device_kind="NVIDIA H200")

    assert len(events) == 9 and {e.hlo_module for e in events} == {"jit_prefill_step"}
    assert events[0].op_path == f"{PREFIX}/decoder_block/moe/routed_experts/ragged_dot"
    ms = {c: row["ms"] for c, row in summary["categories"].items()}
    assert ms == pytest.approx({"moe": 0.52, "kda_kernel": 0.1, "dsa_indexer": 0.03,
                                "mla_attention": 0.07, "projections": 0.04, "mhc": 0.01,
                                "other": 0.01, "shared_experts": 0.0})
    assert summary["busy_ms"] == pytest.approx(0.78)
    assert summary["span_ms"] == pytest.approx(0.74)  # two streams overlap
    assert summary["useful_tflop"] == pytest.approx(1.1)
    assert summary["categories"]["moe"]["tflop_per_s"] == pytest.approx(1 / 0.52e-3)
    assert summary["mfu"]["peak_busy"] == pytest.approx(1.1e12 / 0.78e-3 / 989e12)
    assert summary["mfu"]["measured_matmul_span"] == pytest.approx(1.1e12 / 0.74e-3 / 790e12)
    assert summary["mfu"]["peak_step"] is None  # no timed step given
    # each top op with its launches and the fusions that ran it (numeric suffixes dropped)
    assert summary["categories"]["mhc"]["top_ops"] == {
        "decoder_block/mhc_write/add": {"kernels": 1, "hlo_ops": ["loop_add_fusion"]}}
    assert summary["categories"]["other"]["top_ops"]["MemcpyD2D"]["hlo_ops"] == ["copy-start"]


def test_category_rules():
    def cat(path, name="k", hlo_op="fusion.1"):
        return categorize(KernelEvent(name, GPU, path, hlo_op, "m", 0.0, 1.0))

    assert cat("jit(f)/decoder_block/moe/shared_experts/mlp/dot_general") == "shared_experts"
    assert cat("jit(f)/decoder_block/moe/router/dot_general") == "projections"
    assert cat("jit(f)/decoder_block/moe/router/top_k") == "other"
    assert cat("jit(f)/decoder_block/mla_prefill/dot_general") == "projections"
    assert cat("jit(f)/decoder_block/mhc_read/dot_general") == "mhc"
    assert cat("", name="sm90_xmma_gemm_bf16bf16_bf16f32") == "projections"
    assert cat("jit(f)/attention_like/x") == "other"  # components match whole, not in part
    assert set(CATEGORIES) >= {"moe", "mla_attention", "dsa_indexer", "kda_kernel", "other"}


HLO = """HloModule jit_step, is_scheduled=true

%fused_computation (param_0: f32[8]) -> f32[8] {
  %param_0 = f32[8]{0} parameter(0), metadata={op_name="x"}
  %exp.1 = f32[8]{0} exponential(%param_0), metadata={op_name="jit(step)/a/routed_experts/exp"}
  ROOT %mul.2 = f32[8]{0} multiply(%exp.1, %exp.1), metadata={op_name="jit(step)/a/routed_experts/mul"}
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %inner = f32[8]{0} fusion(%p), kind=kCustom, calls=%fused_inner
  ROOT %t = (s32[], f32[8]{0}) tuple(%p, %inner), metadata={op_name="jit(step)/a/kda_scan/while/body/tuple"}
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0), metadata={op_name="x"}
  %fusion.1 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation
  ROOT %dot.3 = f32[8]{0} dot(%fusion.1, %fusion.1), metadata={op_name="jit(step)/a/dot_general" stack_frame_id=2}
}
"""  # noqa: E501


def test_hlo_op_paths_fill_fusions_from_what_they_call_or_sit_in():
    module, paths = hlo_op_paths(HLO)

    assert module == "jit_step"
    assert paths["dot.3"] == "jit(step)/a/dot_general"
    assert paths["fusion.1"] == "jit(step)/a/routed_experts"  # common prefix of its ops
    assert paths["inner"] == "jit(step)/a/kda_scan/while/body/tuple"  # from its computation


def test_real_cpu_trace_carries_hlo_ops_that_the_compiled_text_names(tmp_path):
    """CPU traces carry `hlo_op` and `hlo_module` but no op name: the compiled HLO text
    supplies the scopes."""

    @jax.jit
    def step(x, w):
        with jax.named_scope("routed_experts"):
            y = jnp.tanh(x @ w)
        with jax.named_scope("mhc_read"):
            z = jnp.cumsum(jnp.sin(x), axis=0)
        return y, z

    x = jnp.ones((256, 256), jnp.float32)
    jax.block_until_ready(step(x, x))
    text = step.lower(x, x).compile().as_text()
    summary = profile_call(lambda: step(x, x), tmp_path, flops={"routed_experts": 2 * 256 ** 3},
                           device_kind="cpu", hlo_texts=[text])

    with gzip.open(summary["trace"], "rt") as f:
        events = kernel_events(json.load(f), [text])
    assert events and {e.hlo_module for e in events} == {"jit_step"}
    rows = summary["categories"]
    assert rows["moe"]["ms"] > 0 and rows["mhc"]["ms"] > 0
    assert summary["busy_ms"] == pytest.approx(sum(r["ms"] for r in rows.values()))
    assert summary["mfu"]["peak_busy"] is None  # no bf16 peak for a CPU


def test_a_mesh_counts_device_seconds_of_every_gpu():
    """Two GPUs each busy 1 ms over the same 1 ms: the step used 2 device-ms."""
    events = [KernelEvent("nvjet", pid, "jit(f)/decoder_block/dot_general", "cublas-gemm.1",
                          "jit_f", 10.0, 1000.0) for pid in (GPU, GPU + 1)]
    summary = summarize(events, {"kda_projections": 10 ** 12}, device_kind="NVIDIA H200",
                        step_s=2e-3)
    assert summary["devices"] == 2 and summary["busy_ms"] == pytest.approx(2.0)
    assert summary["span_ms"] == pytest.approx(1.0)
    assert summary["mfu"]["peak_busy"] == pytest.approx(summary["mfu"]["peak_span"])
    assert summary["mfu"]["peak_step"] == pytest.approx(1e12 / 4e-3 / 989e12)
