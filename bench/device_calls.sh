#!/usr/bin/env bash
# The H200 runs docs/STATUS.md lists under "Next device calls", one named step each, so a
# session spends its device minutes on runs instead of on writing them.
#
# Here, once:      make device-wheels && bash bench/device_calls.sh prepare
# On the device:   run(command="bash bench/device_calls.sh STEP [STEP...]",
#                      carry=[".whl", "exp"])   (GLMJAX_COMMIT=<sha> before it: the device's
#                  copy of .git may report a stale HEAD; the benches record the variable)
#
# Every step writes its JSON and log under $OUT as it goes and runs under its own timeout,
# so one slow step leaves the others' results. `bash bench/device_calls.sh list` names them.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Trees the comparisons run in (ignored folder exp/, carried): the gmm before group-local
# work items, and the token-parallel any-decay diagonal kernel (branch diag-token).
GMM_BEFORE=c44e353
DIAG_TOKEN=f358a6c

prepare() {  # here, not on the device
  for pair in "old:$GMM_BEFORE" "diag:$DIAG_TOKEN"; do
    rm -rf "exp/${pair%%:*}" && mkdir -p "exp/${pair%%:*}"
    # Without results and docs: the carried paths may hold 64 MiB, the wheels take 44.
    git archive "${pair#*:}" | tar -x -C "exp/${pair%%:*}" --exclude=bench/results \
      --exclude=docs
  done
}

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

# The kernels built on the CPU since the last device session, on the GPU.
verify() {
  run_logged pytest_gpu 420 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_gmm.py tests/test_layers_moe.py tests/test_kda_conv.py \
    tests/test_layers_kda.py tests/test_layers_mhc.py
}
verify_kda() {
  run_logged pytest_gpu_kda 480 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kda_kernel.py
}

# Routed experts at 8K, both presets: the model's two fused launches at the pick, with and
# without half tiles, and at 64-row tiles (1.06x the useful rows at kimi 8K against the
# pick's 1.12x, but twice the weight loads), one run; then the global row grid (the tree
# before, same machine; its --sweep-fused takes no count, so its other tilings and the
# whole-MoE part are cut here).
moe() {
  local launches="import sys, bench.moe as m
m.FUSED_SWEEP = tuple(t for t in m.FUSED_SWEEP if t[0] == 64) if sys.argv[2] == 'now' else ()
m.run_moe_part = lambda *args: None
m.main(['--tokens', '8192', '--parts', 'moe', '--sweep-fused', '--out', sys.argv[1]])"
  run_logged moe_8192 300 python3 -c "$launches" "$OUT/moe_8192_half_tiles.json" now
  (cd exp/old && run_logged moe_8192_before 300 python3 -c "$launches" \
    "$OUT/moe_8192_before.json" before)
}

# The decode steps' routed experts (batch 1 and 2: the per-row schedule, never swept on the
# H200; 2.9 TB/s at batch 1 where the floor assumes 4.8): the pick and every PER_ROW_SWEEP
# tiling. A faster one goes into gmm_tuning.select_gmm_config for few rows.
moe_decode() {
  run_logged moe_decode 300 python3 -c "import sys, bench.moe as m
m.run_moe_part = lambda *args: None
m.main(['--tokens', '1', '2', '--presets', 'kimi-linear-48b', '--parts', 'moe',
        '--sweep-fused', '--out', sys.argv[1]])" "$OUT/moe_decode_per_row_sweep.json"
}

conv() {
  run_logged kda_conv 240 python3 -m bench.kda_conv --sweep --out "$OUT/kda_conv.json"
}

kimi_step() {
  run_logged kimi_step 420 python3 -m bench.model_prefill --preset kimi-linear-48b \
    --num-layers 27 --num-experts 256 --tokens 8192 --mla-attention cudnn \
    --out "$OUT/model_prefill_kimi_27L256E_8192.json"
}

diag_token() {
  (cd exp/diag && run_logged pytest_gpu_diag_token 420 python3 -m pytest -q -m gpu \
    -p no:cacheprovider tests/test_kda_kernel.py)
  (cd exp/diag && run_logged kda_kernel_diag_token 300 python3 -m bench.kda_kernel \
    --cases 8K,32K --no-fla --out "$OUT/kda_kernel_diag_token.json")
  run_logged kda_kernel_main 360 python3 -m bench.kda_kernel --cases 8K,32K \
    --out "$OUT/kda_kernel_main.json"
}

# Where kimi's ladder and coalesced schedules part, layer by layer (retained KDA states,
# MLA latents, next-token logprobs): fp32 at 64 experts (rounding ~1e-6 everywhere, or a
# layer that stands out), then bf16 at the full 256.
kimi_schedule() {
  JAX_DEFAULT_MATMUL_PRECISION=highest run_logged schedule_kimi_fp32 420 python3 -m \
    bench.dsa_schedule --no-layer-rows --preset kimi-linear-48b --model-layers 27 \
    --model-experts 64 --model-dtype float32 --lengths 8192 \
    --out "$OUT/schedule_kimi_27L64E_fp32.json"
  run_logged schedule_kimi_bf16 300 python3 -m bench.dsa_schedule --no-layer-rows \
    --preset kimi-linear-48b --model-layers 27 --model-experts 256 --lengths 8192 \
    --out "$OUT/schedule_kimi_27L256E_bf16.json"
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

fused_decode_all() {  # the fused KDA decode step at every row count (FUSED_DECODE_WAVES=16)
  run_logged decode_fused_all 300 python3 -c "import os, pallas_kernels.tuning as t
t.FUSED_DECODE_WAVES = 16
from bench.decode import main
main(['--batches', '16,64', '--steps', '32', '--no-profile', '--json',
      os.environ['OUT'] + '/decode_fused_all.json'])"
}

kda_full() {
  run_logged kda_kernel_full 540 python3 -m bench.kda_kernel --cases 8K,32K,4x8K \
    --unfused-output --out "$OUT/kda_kernel.json"
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

dsa_schedule() {
  run_logged dsa_schedule_layers 240 python3 -m bench.dsa_schedule --model-layers 0 \
    --out "$OUT/dsa_schedule_layers.json"
  run_logged dsa_schedule_8192 240 python3 -m bench.dsa_schedule --lengths 8192 \
    --out "$OUT/dsa_schedule_8192.json"
}

invariance_glm() {
  run_logged batch_invariance_glm 240 python3 -m bench.batch_invariance \
    --preset glm5.3-flash --ops mhc,decode_step --out "$OUT/batch_invariance_glm.json"
}

STEPS="prepare setup verify verify_kda moe moe_decode conv kimi_step diag_token kimi_schedule
kimi_fp32 decode fused_decode_all kda_full ncu_kda dsa_schedule invariance_glm"

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
if [[ $1 != prepare ]]; then
  : "${OUT:?OUT must name the folder results go to (the device tool sets it)}"
  mkdir -p "$OUT"
fi
for step in "$@"; do
  "$step"
done
