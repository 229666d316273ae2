#!/usr/bin/env bash
# The H200 runs docs/STATUS.md lists under "Next device calls", one named step each, so a
# session spends its device minutes on runs instead of on writing them.
#
# Here, once:      make device-wheels
# On the device:   run(command="bash bench/device_calls.sh STEP [STEP...]", carry=[".whl"])
#                  (GLMJAX_COMMIT=<sha> before it: the device's copy of .git may report a
#                  stale HEAD; the benches record the variable)
#
# Every step writes its JSON and log under $OUT as it goes and runs under its own timeout,
# so one slow step leaves the others' results. `bash bench/device_calls.sh list` names them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
}

export PYTHONPATH=/tmp/site:. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONUNBUFFERED=1

run_logged() {  # NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T), at most ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? after $SECONDS s in all"
  tail -n 25 "$OUT/$name.log"
}

# The kernels built on the CPU since the last device session, on the GPU (seventeenth
# session): the KDA prefill's any-decay diagonal blocks by products with the key-by-key
# branch, the scan forming W and U, the scan zeroing the padding rows of o; the KDA layer
# and model through them.
verify() {
  run_logged pytest_gpu 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kda_kernel.py tests/test_layers_kda.py tests/test_model.py
}

# The decode path's weight stream and routing on the GPU (the nineteenth session's change:
# the router's logits as the stream's partial sums, which the routing kernel adds): the
# kernels, projection, MoE layer and the model's decode against prefill.
verify_decode() {
  run_logged pytest_gpu_decode 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_stream_matmul.py tests/test_moe_routing.py tests/test_projection.py \
    tests/test_layers_moe.py tests/test_model.py
}

# Issue 20 / 18 at 8K after the seventeenth session: both gate paths (any decay now on the
# products), the any-decay worst case (decays x128), W and U formed by the scan, fla beside.
kda_8k() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_logged kda_kernel_8k 300 python3 -m \
    bench.kda_kernel --cases 8K --pass-cases '' --out "$OUT/kda_kernel_8K.json"
}

# The engine's host time with the model stubbed, on this machine's CPU: what the lent
# hosts' Python costs against the 2-core CI box's (bench.engine_host there).
engine_host() {
  JAX_PLATFORMS=cpu run_logged engine_host 180 python3 -m bench.engine_host \
    --out "$OUT/engine_host_kimi_tree.json"
}

conv() {
  run_logged kda_conv 240 python3 -m bench.kda_conv --sweep --out "$OUT/kda_conv.json"
}

kimi_step() {
  run_logged kimi_step 420 python3 -m bench.model_prefill --preset kimi-linear-48b \
    --num-layers 27 --num-experts 256 --tokens 8192 --mla-attention cudnn \
    --out "$OUT/model_prefill_kimi_27L256E_8192.json"
}

# Where kimi's ladder and coalesced schedules part, layer by layer (retained KDA states,
# MLA latents, next-token logprobs): fp32 at 16 experts (32 ran out of memory on an H100,
# where CUDA graphs need the 15% the client leaves), then bf16 at 64 (any GPU; the full
# 256 with KIMI_SCHEDULE_EXPERTS=256 on the H200). Ran on an H100 on 2026-12-06:
# PERFORMANCE.md, "Greedy tokens".
kimi_schedule() {
  JAX_DEFAULT_MATMUL_PRECISION=highest XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 run_logged \
    schedule_kimi_fp32 420 python3 -m bench.dsa_schedule --no-layer-rows \
    --preset kimi-linear-48b --model-layers 27 --model-experts 16 --model-dtype float32 \
    --lengths 8192 --out "$OUT/schedule_kimi_27L16E_fp32.json"
  run_logged schedule_kimi_bf16 300 python3 -m bench.dsa_schedule --no-layer-rows \
    --preset kimi-linear-48b --model-layers 27 \
    --model-experts "${KIMI_SCHEDULE_EXPERTS:-64}" --lengths 8192 \
    --out "$OUT/schedule_kimi_27L${KIMI_SCHEDULE_EXPERTS:-64}E_bf16.json"
}

# Cold TTFT through the engine, ladder against coalesced (the 150 / 750 ms bars);
# KIMI_LENGTHS=8192 for the 8K bar alone (no 32K compile).
kimi_ttft() {
  run_logged prefill_kimi 540 python3 -m bench.prefill --preset kimi-linear-48b \
    --num-layers 27 --num-experts 256 --lengths "${KIMI_LENGTHS:-8192,32768}" --unaligned 0 \
    --beside-lengths '' \
    --concurrency '' --samples 3 --no-profile --json "$OUT/prefill_kimi_27L256E.json"
}

kimi_fp32() {
  JAX_DEFAULT_MATMUL_PRECISION=highest run_logged prefill_kimi_fp32 540 python3 -m \
    bench.prefill --preset kimi-linear-48b --num-layers 27 --num-experts 64 --dtype float32 \
    --lengths 8192 --unaligned 0 --beside-lengths '' --concurrency '' --samples 3 \
    --no-profile --json "$OUT/prefill_kimi_27L64E_fp32.json"
}

decode() {
  for i in 1 2; do
    run_logged "decode_$i" 300 python3 -m bench.decode --batches 1,16,64 --steps 64 \
      --json "$OUT/decode_kimi-linear-48b_$i.json"
  done
}

# Batch-1 decode of the whole kimi through the engine, twice (bar 3.32 ms a step; 3.63 /
# 3.55 on 2026-12-05 with one executable, the engine's pick; two called in turn, the
# benchmark's --decode-executables 2, gained nothing then).
decode_b1() {
  local i
  for i in 1 2; do
    run_logged "decode_b1_$i" 150 python3 -m bench.decode --batches 1 --steps 200 \
      --no-profile --json "$OUT/decode_b1_$i.json"
  done
}

# The batch-1 step as the server now runs it on one GPU (the decode program's buffers
# pinned, serving.pinned, and its temporaries under SKIP_TEMP) against the tree before
# (--unpinned --no-pin-temporaries: each step's batch, logits and status in new buffers,
# XLA's default allocator), alternately on one machine; then XLA's log over 20 steps of
# the pinned steps (of the steps before too with UPDATES_BEFORE=1): the allocations that
# moved before each CUDA-graph launch and the commands re-set.
# On an H100: DECODE_ARGS="--num-experts 64" (a batch-1 step reads 8 experts a layer
# either way).
decode_b1_pinned() {
  local i mode
  for i in 1 2; do
    run_logged "decode_b1_before_$i" 150 python3 -m bench.decode ${DECODE_ARGS:-} --batches 1 \
      --steps 200 --no-profile --unpinned --no-pin-temporaries \
      --json "$OUT/decode_b1_before_$i.json"
    run_logged "decode_b1_pinned_$i" 150 python3 -m bench.decode ${DECODE_ARGS:-} --batches 1 \
      --steps 200 --no-profile --json "$OUT/decode_b1_pinned_$i.json"
    rm -f "$OUT/decode_b1_before_$i.log" "$OUT/decode_b1_pinned_$i.log"  # tails printed
  done
  export TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1
  [ -n "${UPDATES_BEFORE:-}" ] && run_logged decode_b1_updates_before 150 python3 -m \
    bench.decode ${DECODE_ARGS:-} --batches 1 --steps 20 --no-profile --unpinned \
    --no-pin-temporaries --json /tmp/u.json
  run_logged decode_b1_updates_pinned 150 python3 -m bench.decode ${DECODE_ARGS:-} \
    --batches 1 --steps 20 --no-profile --json /tmp/u.json
  unset TF_CPP_MIN_LOG_LEVEL TF_CPP_VMODULE
  for mode in before pinned; do
    [ -f "$OUT/decode_b1_updates_$mode.log" ] || continue
    echo "-- $mode: CUDA-graph updates (allocations moved; commands re-set), 20 steps"
    grep -o "num_commands=[0-9]*; updated_allocs=[0-9]*" "$OUT/decode_b1_updates_$mode.log" \
      | sort | uniq -c | sort -rn | head -n 8
    grep -o "Updated [0-9]* commands" "$OUT/decode_b1_updates_$mode.log" | sort | uniq -c \
      | sort -rn | head -n 8
    rm -f "$OUT/decode_b1_updates_$mode.log"
  done
}

# A decode change against the tree before it, on one GPU of either kind: kimi's 27 layers at
# 64 routed experts (~25 GB; a batch-1 step reads 8 experts a layer either way), batch 1,
# the two trees alternately. The caller extracts the tree before into _before_tree
# (untracked, so it travels: `git archive <sha> glmjax pallas_kernels serving bench | tar
# -x -C _before_tree`).
decode_b1_ab() {
  local i
  for i in 1 2; do
    (cd _before_tree && run_logged "decode_b1_before_$i" 200 python3 -m bench.decode \
      --num-experts 64 --batches 1 --steps 200 --no-profile \
      --json "$OUT/decode_b1_64E_before_$i.json")
    run_logged "decode_b1_after_$i" 200 python3 -m bench.decode --num-experts 64 --batches 1 \
      --steps 200 --no-profile --json "$OUT/decode_b1_64E_after_$i.json"
  done
}

# A KDA kernel change against the tree before it, and both against fla, each side in its
# own process, in turn, two rounds (~7 min on one GPU of either kind): 8K x 32 heads on
# both gate paths and one 32K prompt at H = 16 (the segment-parallel scan), 4 snapshots;
# then each row's median and ours against fla's, by wall time and by the GPU's busy time
# (fla's wall time holds host time that moves with the machine: docs/KERNEL.md,
# twenty-sixth and twenty-seventh sessions). The caller extracts
# the tree before into _before_tree (untracked, so it travels: `git archive <sha>
# pallas_kernels bench glmjax | tar -x -C _before_tree`); this tree's bench/kda_ab.py is
# copied there. KDA_AB_PAIRS (case:heads words) and KDA_AB_ROUNDS change the cases and
# rounds: the scan's grid order (2026-12-07, untimed) shows only past one wave of programs,
# KDA_AB_PAIRS="4x8K:32 32K:16" KDA_AB_ROUNDS=1 (~5 min).
kda_ab() {
  local round pair case heads
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  cp bench/kda_ab.py _before_tree/bench/kda_ab.py
  for round in $(seq "${KDA_AB_ROUNDS:-2}"); do
    for pair in ${KDA_AB_PAIRS:-8K:32 32K:16}; do
      case=${pair%%:*} heads=${pair##*:}
      (cd _before_tree && run_logged "kda_ab_before_${case}_$round" 150 python3 -m \
        bench.kda_ab --case "${case:-8K}" --heads "${heads:-32}" --any --tree before \
        --out "$OUT/kda_ab.jsonl")
      run_logged "kda_ab_after_${case}_$round" 150 python3 -m bench.kda_ab --case \
        "${case:-8K}" --heads "${heads:-32}" --any --tree after --out "$OUT/kda_ab.jsonl"
      run_logged "kda_ab_fla_${case}_$round" 150 python3 -m bench.kda_ab --case \
        "${case:-8K}" --heads "${heads:-32}" --fla --out "$OUT/kda_ab.jsonl"
    done
  done
  run_logged kda_ab_summary 60 python3 -m bench.kda_ab --summary "$OUT/kda_ab.jsonl"
  unset XLA_PYTHON_CLIENT_PREALLOCATE
}

# Issue 20's table in one short call (~5 min; 2026-12-07 on an H100:
# bench/results/kda_cases_h100_2026-12-07.jsonl): ours (both gate paths) and fla at 8K,
# 32K and 4 x 8K x 32 heads, ours at H = 16 on one 32K sequence, one process each, by wall
# time and by the GPU's busy time. KDA_QUICK_TESTS=1 runs the kernel's `gpu` tests first
# (~3 min).
kda_quick() {
  local case
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  [ -n "${KDA_QUICK_TESTS:-}" ] && run_logged pytest_gpu_kda 240 python3 -m pytest -q -m gpu \
    -p no:cacheprovider tests/test_kda_kernel.py
  for case in 8K 32K 4x8K; do
    run_logged "kda_quick_ours_$case" 150 python3 -m bench.kda_ab --case "${case:-8K}" --any \
      --tree main --out "$OUT/kda_quick.jsonl"
    run_logged "kda_quick_fla_$case" 150 python3 -m bench.kda_ab --case "${case:-8K}" --fla \
      --out "$OUT/kda_quick.jsonl"
  done
  run_logged kda_quick_ours_h16 150 python3 -m bench.kda_ab --case 32K --heads 16 --any \
    --tree main --out "$OUT/kda_quick.jsonl"
  run_logged kda_quick_summary 60 python3 -m bench.kda_ab --summary "$OUT/kda_quick.jsonl"
  unset XLA_PYTHON_CLIENT_PREALLOCATE
}

# The prep and inverse kernels' key-slice loads pipelined by Triton (`inverse_num_stages`,
# `prep_num_stages` 2; built 2026-12-07, untimed) against the pick, each in its own
# process, at 8K and 4 x 8K x 32 heads, both gate paths (the prep at 2 stages also over
# 16-column slices, which spill nothing through XLA for sm_90a); then H = 16 at 32K with the
# segment scan and its transitions at 2 stages (`segment_num_stages`, 1 until now; through
# XLA for sm_90a: loop bodies 1,799 -> 2,017 and 308 -> 320 SASS, no new spills); their
# `gpu` test first (~6 min).
kda_stages() {
  local case
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  run_logged pytest_gpu_stages 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kda_kernel.py -k pipelined_loads
  for case in 8K 4x8K; do
    run_logged "kda_stages_pick_$case" 150 python3 -m bench.kda_ab --case "${case:-8K}" \
      --any --tree main --out "$OUT/kda_stages.jsonl"
    run_logged "kda_stages_inverse_$case" 150 python3 -m bench.kda_ab --case "${case:-8K}" \
      --any --tree main --set inverse_num_stages=2 --out "$OUT/kda_stages.jsonl"
    run_logged "kda_stages_both_$case" 150 python3 -m bench.kda_ab --case "${case:-8K}" \
      --any --tree main --set inverse_num_stages=2 --set prep_num_stages=2 \
      --out "$OUT/kda_stages.jsonl"
    run_logged "kda_stages_both16_$case" 150 python3 -m bench.kda_ab --case "${case:-8K}" \
      --any --tree main --set inverse_num_stages=2 --set prep_num_stages=2 \
      --set prep_block_k=16 --out "$OUT/kda_stages.jsonl"
  done
  run_logged kda_stages_pick_h16 150 python3 -m bench.kda_ab --case 32K --heads 16 --any \
    --tree main --out "$OUT/kda_stages.jsonl"
  run_logged kda_stages_segments_h16 150 python3 -m bench.kda_ab --case 32K --heads 16 \
    --any --tree main --set segment_num_stages=2 --out "$OUT/kda_stages.jsonl"
  run_logged kda_stages_summary 60 python3 -m bench.kda_ab --summary "$OUT/kda_stages.jsonl"
  unset XLA_PYTHON_CLIENT_PREALLOCATE
}

# Where the batch-1 step's ~3.6 ms of host time goes (the device needs 3.3): cProfile of the
# whole benchmark; per call of the jitted steps and of the engine's own functions.
decode_host() {
  run_logged decode_host 300 python3 -m cProfile -o "$OUT/decode_b1.prof" -m bench.decode \
    --batches 1 --steps 200 --no-profile --json "$OUT/decode_b1_host.json"
  python3 -c "import pstats, sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(40)" \
    "$OUT/decode_b1.prof" > "$OUT/decode_b1_prof.txt"
}

# At 8K, the bounded path's prep / inverse / W/U / scan tilings (~6 min; a call each:
# together they pass the 10 minutes of one), then in kda_prep_any the any-decay path's
# with the 8K case and fla beside them.
kda_prep() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_logged kda_sweep_bounded 360 python3 -m \
    bench.kda_kernel --sweep bounded --sweep-case 8K --cases '' \
    --out "$OUT/kda_kernel_sweep_bounded_8K.json"
}

kda_prep_any() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_logged kda_sweep_any 420 python3 -m \
    bench.kda_kernel --sweep any --sweep-case 8K --cases 8K --pass-cases '' \
    --out "$OUT/kda_kernel_sweep_any_8K.json"
}

# JAX and PyTorch (fla) share the GPU: no preallocation (fla ran out of memory at 32K on an
# H100 under XLA's 95%, 2026-12-05).
kda_full() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_logged kda_kernel_full 540 python3 -m \
    bench.kda_kernel --cases 8K,32K,4x8K --unfused-output --out "$OUT/kda_kernel.json"
  XLA_PYTHON_CLIENT_PREALLOCATE=false run_logged kda_kernel_h16 180 python3 -m \
    bench.kda_kernel --heads 16 --cases 32K --pass-cases '' --out "$OUT/kda_kernel_h16.json"
}

# Issue 20's profile: every kernel of one kda_prefill call (both gate paths) and of fla's
# chunk_kda (default, safe_gate) at 8K, ncu's full set (stall reasons, occupancy, bytes).
# Without preallocation (ncu saves and restores the memory a kernel may touch before each
# of its ~38 replays: all of it under XLA's 95%) and without command buffers (ncu fails to
# profile a kernel inside XLA's CUDA graphs); only the KDA kernels of both.
ncu_kda() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_command_buffer= \
    run_logged ncu_kda 540 ncu --profile-from-start off --set full -f -o "$OUT/ncu_kda_8K" \
    -k 'regex:kda_chunk|chunk_kda|inter_solve|intra|recompute|delta_h|fwd_o|cumsum' \
    python3 -m bench.kda_ncu --case 8K
  ncu -i "$OUT/ncu_kda_8K.ncu-rep" --csv --page details > "$OUT/ncu_kda_8K.csv"
}

# Every kernel of one kda_prefill call (both gate paths) and of fla's chunk_kda (default,
# safe_gate) at 8K, timed by ncu alone (one replay a kernel, no full set): each kernel's
# time, grid, block, registers and instructions, to set ours against fla's kernel by kernel.
kda_times() {
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_command_buffer= \
    run_logged kda_times 300 ncu --profile-from-start off -f -o "$OUT/kda_times_8K" \
    --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,smsp__inst_executed.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes.sum \
    python3 -m bench.kda_ncu --case 8K
  ncu -i "$OUT/kda_times_8K.ncu-rep" --csv --page raw > "$OUT/kda_times_8K.csv"
}

# Whether two copies of a step's executable called in turn spare XLA's CUDA-graph updates
# (the batch-1 decode step's host time): a chain of 600 small kernels, one executable
# against two; then 16 calls with XLA's command-buffer log on, to count the updates.
pingpong() {
  run_logged cmdbuf_pingpong 120 python3 -m bench.cmdbuf_pingpong \
    --out "$OUT/cmdbuf_pingpong.json"
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,command_executor=1 \
    run_logged cmdbuf_pingpong_vlog 90 python3 -m bench.cmdbuf_pingpong --calls 16 \
    --repeats 1 --out "$OUT/cmdbuf_pingpong_vlog.json"
  grep -i "updated" "$OUT/cmdbuf_pingpong_vlog.log" | sed 's/.*\] //' | cut -c1-100 | sort |
    uniq -c | sort -rn | head -20
}

# glm5.3-flash decode at reduced depth (6 layers, 16 experts: fits an H100): its step with
# mHC's Sinkhorn as one launch a read (a74e50f; 11,042 -> 1,952 launches a step at one row
# for the full model, counted by bench.launches), never timed.
glm_decode() {
  run_logged decode_glm 300 python3 -m bench.decode --preset glm5.3-flash --num-layers 6 \
    --num-experts 16 --batches 1,16 --steps 32 --json "$OUT/decode_glm_6L16E.json"
}

dsa_schedule() {
  run_logged dsa_schedule_layers 240 python3 -m bench.dsa_schedule --model-layers 0 \
    --out "$OUT/dsa_schedule_layers.json"
  run_logged dsa_schedule_8192 240 python3 -m bench.dsa_schedule --lengths 8192 \
    --out "$OUT/dsa_schedule_8192.json"
}

# Issue 18's greedy identity: which prefill products round a row by the span's length, and
# whether XLA's GEMMs without split-K fix it. First each kimi op's rows below 4096 against
# the batch of rows 0..4095 (the ladder's first step) at 512 / 2048 / 8192 rows, under
# INVARIANCE_FLAGS (XLA_FLAGS settings, one run each; on an H100 on 2026-12-07 at the
# defaults: the router's fp32 logits differ at every length, several small products at
# 512 and 2048: bench/results/prefill_invariance_kimi_h100_2026-12-07.json); then kimi's
# ladder against its coalesced span layer by layer under the first setting with our flash
# attention (cuDNN's rounds a query by its span: 2026-12-07), 8 layers, then 27 at 64
# experts (any GPU; on an H100 the 8 layers were bit-identical).
invariance_prefill() {
  local flags name
  for flags in ${INVARIANCE_FLAGS:---xla_gpu_experimental_force_split_k=1 --xla_gpu_enable_triton_gemm=false}; do
    name=$(echo "$flags" | tr -dc 'a-z_' | cut -c1-40)
    XLA_FLAGS="$flags" run_logged "invariance_$name" 110 python3 -m bench.batch_invariance \
      --ops kda_in,kda_o_proj,moe_in,dense_mlp,moe_layer --rows 512,2048,8192 \
      --reference-rows 4096 --out "$OUT/prefill_invariance_kimi_$name.json"
  done
  flags=${INVARIANCE_FLAGS:---xla_gpu_experimental_force_split_k=1}
  flags=${flags%% *}
  XLA_FLAGS="$flags" run_logged schedule_kimi_8L 120 python3 -m bench.dsa_schedule \
    --no-layer-rows --preset kimi-linear-48b --model-layers 8 --model-experts 16 \
    --mla-attention pallas --lengths 8192 --out "$OUT/schedule_kimi_8L16E_bf16.json"
  XLA_FLAGS="$flags" run_logged schedule_kimi_27L 240 python3 -m bench.dsa_schedule \
    --no-layer-rows --preset kimi-linear-48b --model-layers 27 --model-experts 64 \
    --mla-attention pallas --lengths 8192 --out "$OUT/schedule_kimi_27L64E_bf16.json"
}

invariance_glm() {
  run_logged batch_invariance_glm 240 python3 -m bench.batch_invariance \
    --preset glm5.3-flash --ops mhc,decode_step --out "$OUT/batch_invariance_glm.json"
}

# Issue 18's greedy identity under --batch-invariant (thirty-fourth session, not yet run on
# a GPU): first the kernels' own gpu cases (the flash kernel's rows against the batch
# around them, the DSA ladder, the KDA scan resuming from a chunk-end snapshot), then the
# attention's speed (its softmax changed: compare bench/results/attention_2026-12-02.json),
# then the greedy comparison through the engine with and without the switch.
invariant_gpu() {
  run_logged pytest_gpu_invariant 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_attention.py tests/test_layers_mla.py tests/test_layers_dsa_indexer.py \
    tests/test_kda_kernel.py -k "Pallas or Cudnn or ladder or resuming or flash"
  run_logged attention 200 python3 -m bench.attention --impls pallas,cudnn \
    --out "$OUT/attention.json"
}

# Issue 18's DSA bar at 32K (H200; 0.92x of the cuDNN dense layer at 2026-12-02b against
# 0.6x): the layer rows after the sparse kernel's exp2 change (thirty-fourth session).
dsa_32k() {
  run_logged sparse_attention_32K 400 python3 -m bench.sparse_attention --cases 32K \
    --iters 5 --samples 3 --out "$OUT/sparse_attention_32K.json"
}

# glm's ladder against its span layer by layer under the switch (any GPU, ~4 min): DSA's
# selection and mHC, which the thirty-third session's kimi runs did not have.
glm_schedule_invariant() {
  run_logged schedule_glm_invariant 300 python3 -m bench.dsa_schedule --batch-invariant \
    --no-layer-rows --preset glm5.3-flash --model-layers 6 --model-experts 288 \
    --lengths 8192 --out "$OUT/schedule_glm_6L288E_batch_invariant.json"
}

# kimi whole (H200): 8K cold, the ladder against the span, greedy tokens compared, with the
# switch; kimi_ttft is the same run without it.
kimi_invariant() {
  run_logged prefill_kimi_invariant 540 python3 -m bench.prefill --batch-invariant \
    --preset kimi-linear-48b --num-layers 27 --num-experts 256 --lengths 8192 --unaligned 0 \
    --beside-lengths '' --concurrency '' --samples 3 --no-profile \
    --json "$OUT/prefill_kimi_27L256E_batch_invariant.json"
}

# glm at full expert count with DSA (H200): the ratio bars' run with the switch (~4 min).
glm_invariant() {
  run_logged prefill_glm_invariant 560 python3 -m bench.prefill --batch-invariant \
    --preset glm5.3-flash --num-layers 6 --num-experts 288 --lengths 8192,16384,32768 \
    --unaligned 0 --beside-lengths '' --concurrency '' --samples 2 --no-profile \
    --json "$OUT/prefill_glm5.3-flash_6L288E_batch_invariant.json"
}

STEPS="setup kda_quick verify verify_decode kda_8k kimi_ttft kimi_step decode_b1 decode_b1_pinned decode_b1_ab engine_host kda_full kda_ab kda_stages kda_times pingpong kda_prep kda_prep_any conv decode_host decode glm_decode
ncu_kda kimi_schedule kimi_fp32 dsa_schedule invariance_glm invariance_prefill invariant_gpu
glm_schedule_invariant kimi_invariant glm_invariant dsa_32k"

if [[ $# -eq 0 || $1 == list ]]; then
  echo "steps, in the order docs/STATUS.md gives them: $STEPS"
  exit 0
fi
for step in "$@"; do
  if [[ " ${STEPS//$'\n'/ } " != *" $step "* ]]; then
    echo "unknown step $step; steps: $STEPS"
    exit 2
  fi
done
: "${OUT:?OUT must name the folder results go to (the device tool sets it)}"
mkdir -p "$OUT"
for step in "$@"; do
  "$step"
done
