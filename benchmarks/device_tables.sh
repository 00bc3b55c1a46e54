#!/usr/bin/env bash
# The device steps that produce or check a shipped table, for one GPU model. On the device,
# from the repository root:
#   [GPU=h100] bash benchmarks/device_tables.sh STEP...
# GPU: the model's short name in file names (default: from nvidia-smi, e.g. h200). ARCH: the
# arch in table names (default: the GPU's, e.g. sm_90). SPEC: the table's sweep spec (default
# sweeps/$GPU.toml, else sweeps/h200.toml, the Hopper grid); HELDOUT and TRAFFIC likewise
# sweeps/$GPU-heldout.toml and sweeps/$GPU-traffic.toml, else the H200's.
# Steps:
#   tests     pytest -m gpu: every GPU test (each route against the reference, CUDA graphs,
#             an engine's captured steps)
#   smoke     benchmarks/vendor_smoke.toml on one GPU: every route, the vendors' included,
#             through the whole sweep pipeline, at a few small problems
#   table     SPEC on all GPUs into runs/$GPU/$ARCH-$GPU.parquet; resumed from its journal
#             there, and stopped (SIGINT, journal kept) once BUDGET_S seconds of the call are
#             spent, so a table takes as many calls as it needs; SHARD=I/N: that share only;
#             PRUNE_FROM=TABLE: another GPU's table prunes it (--prune-from, PRUNE_RATIO)
#   hardware  what mlatune.hardware reads of the GPU (and nvidia-smi -q) into $OUT/hardware.txt
#   refine    the table's --refine for REFINE_S seconds (its journal and table in runs/$GPU)
#   heldout   HELDOUT into runs/$GPU-heldout/ (what `mlatune report --heldout` judges by)
#   traffic   TRAFFIC into runs/$GPU-traffic/ (serving-like shapes, held out likewise)
#   resweep   ROUTES (comma separated; name a route's competitors too, so they are timed in
#             the same run) swept on SPEC into runs/$GPU-resweep-new/, then their rows in
#             TABLE (default tables/$ARCH-$GPU.parquet) replaced by the new ones (mlatune
#             merge --replace-routes): runs/$GPU-resweep/$ARCH-$GPU.parquet
#   check     mlatune validate, then coverage of HELDOUT's problems (--require nearest), of
#             the newest table: runs/$GPU-resweep/, runs/$GPU/, else tables/
#   jitcache  FlashInfer's JIT builds (~/.cache/flashinfer) into $OUT/jit-cache.tgz: carried
#             into a later call and unpacked in ~, a fresh machine skips their nvcc builds
# Vendor libraries (FlashMLA, FlashInfer) come as wheels installed before this script runs,
# with PYTHONPATH pointing at them (kept). Every command it runs is logged before it runs;
# logs go under $OUT, and runs/ (journals and tables) as $OUT/runs.tgz.
set -u -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" runs
BUDGET_S=${BUDGET_S:-540}
T0=$(date +%s)
NGPU=$(nvidia-smi -L | wc -l)
MODEL=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
GPU=${GPU:-$(grep -oiE '\b[a-z][0-9]{2,4}\b' <<< "$MODEL" | head -1 | tr 'A-Z' 'a-z')}
ARCH=${ARCH:-$(python3 -c 'import torch; print("sm_%d%d" % torch.cuda.get_device_capability())')}
spec_for() {  # the GPU's own spec of a kind, else the H200's
  if [ -f "sweeps/$GPU$1.toml" ]; then echo "sweeps/$GPU$1.toml"; else echo "sweeps/h200$1.toml"; fi
}
SPEC=${SPEC:-$(spec_for "")}
HELDOUT=${HELDOUT:-$(spec_for -heldout)}
TRAFFIC=${TRAFFIC:-$(spec_for -traffic)}
TABLE=${TABLE:-tables/$ARCH-$GPU.parquet}

log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/session.log"; }
run() {  # NAME COMMAND...: logged, run with its output in $OUT/NAME.log, rc and wall logged
  local name=$1 s=$(date +%s); shift
  log "$name: + $*"
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  log "$name: rc=$rc wall=$(( $(date +%s) - s ))s"
  tail -15 "$OUT/$name.log" | tee -a "$OUT/session.log"
  return $rc
}
left_s() { local left=$(( BUDGET_S - ($(date +%s) - T0) )); echo $(( left > 1 ? left : 1 )); }
sweep() {  # NAME SPEC GPUS [more sweep options]: into runs/NAME/$ARCH-$GPU.parquet
  local left; left=$(left_s)
  [ "$left" -gt 20 ] || { log "$1: no time left"; return 1; }
  mkdir -p "runs/$1"
  run "$1" timeout -s INT "$left" python3 -m mlatune sweep "$2" --arch "$ARCH" --gpus "$3" \
    --resume --out "runs/$1/$ARCH-$GPU.parquet" "${@:4}"
  local rc=$?
  run "$1-cost" python3 benchmarks/bench.py --routine sweep-cost \
    --journal "runs/$1/$ARCH-$GPU.journal.jsonl"
  return $rc
}
newest_table() {
  for t in "runs/$GPU-resweep/$ARCH-$GPU.parquet" "runs/$GPU/$ARCH-$GPU.parquet" "$TABLE"; do
    [ -f "$t" ] && { echo "$t"; return; }
  done
  echo "$TABLE"
}

log "$MODEL x$NGPU: GPU=$GPU ARCH=$ARCH SPEC=$SPEC HELDOUT=$HELDOUT TRAFFIC=$TRAFFIC TABLE=$TABLE"
log "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)')"
for step in "$@"; do
  case $step in
    tests) run gpu-tests timeout "$(left_s)" python3 -m pytest -m gpu -q -p no:cacheprovider ;;
    smoke) ( export CUDA_VISIBLE_DEVICES=0; sweep "$GPU-smoke" benchmarks/vendor_smoke.toml 1 ) ;;
    table) sweep "$GPU" "$SPEC" "$NGPU" ${SHARD:+--shard "$SHARD"} \
             ${PRUNE_FROM:+--prune-from "$PRUNE_FROM" --prune-ratio "${PRUNE_RATIO:-1.4}"} ;;
    hardware) run hardware python3 -c 'import json, torch; from mlatune import arch, hardware
d = arch.current_device(); p = torch.cuda.get_device_properties(0)
print(hardware.of_device(d, hardware.measure_bandwidth(d)).as_json())
print({k: str(getattr(p, k)) for k in dir(p) if not k.startswith("_")})'
              nvidia-smi -q >> "$OUT/hardware.log" 2>&1 ;;
    refine) run refine timeout -s INT "$(left_s)" python3 -m mlatune sweep "$SPEC" \
              --arch "$ARCH" --gpus "$NGPU" --out "runs/$GPU/$ARCH-$GPU.parquet" \
              --refine "${REFINE_S:-300}" ;;
    heldout) sweep "$GPU-heldout" "$HELDOUT" "$NGPU" ;;
    traffic) sweep "$GPU-traffic" "$TRAFFIC" "$NGPU" ;;
    resweep) [ -n "${ROUTES:-}" ] || { log "resweep: set ROUTES"; continue; }
             mkdir -p "runs/$GPU-resweep"
             sweep "$GPU-resweep-new" "$SPEC" "$NGPU" --routes "$ROUTES" &&
               run replace python3 -m mlatune merge "$TABLE" \
                 "runs/$GPU-resweep-new/$ARCH-$GPU.parquet" --replace-routes "$ROUTES" \
                 --out "runs/$GPU-resweep/$ARCH-$GPU.parquet" ;;
    check) t=$(newest_table)
           run validate python3 -m mlatune validate "$t"
           run coverage python3 -m mlatune coverage "$t" "$HELDOUT" --arch "$ARCH" \
             --require nearest ;;
    jitcache) tar czf "$OUT/jit-cache.tgz" -C ~ .cache/flashinfer
              log "jitcache: $(du -h "$OUT/jit-cache.tgz" | cut -f1)" ;;
    *) log "unknown step $step (see the head of $0)" ;;
  esac
done
# Journals and tables travel back gzipped in one tarball (files from $OUT: 8 at most).
tar czf "$OUT/runs.tgz" runs
log "done; runs.tgz $(du -h "$OUT/runs.tgz" | cut -f1)"
