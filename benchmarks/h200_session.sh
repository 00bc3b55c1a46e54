#!/usr/bin/env bash
# One device call of the H200 table work (issues 4 and 8). Usage on the device:
#   bash benchmarks/h200_session.sh STEP... where STEP is one of
#   tests        pytest -m gpu
#   testsbg      with 2+ GPUs: pytest -m gpu in the background on the last GPU, with its own
#                Triton cache (a cold-cache sweep on GPU 0 stays cold); only 1-GPU steps
#                (smoke1, bundled) may run until waittests waits for it. With 1 GPU: as tests
#   smoke1|smoke2  the bundled smoke sweep (1 GPU), a second time with all GPUs
#   traffic        sweeps/h200-traffic.toml (held-out serving-like shapes) on all GPUs, resumed
#   h200 | heldout  sweeps/h200.toml or sweeps/h200-heldout.toml on all GPUs, resumed from
#                  runs/, stopped (SIGINT, journal kept) when BUDGET_S seconds of the call are spent
#   h200fresh      sweeps/h200.toml from scratch into runs/h200fresh (to time the whole sweep)
#   h200one        the same on GPU 0 alone into runs/h200one (one H200's rate; beside testsbg);
#                  with SHARD=I/N only that share of the problems (--shard)
#   bundled        doctor, then how the bundled table answers the held-out problems, on the GPU
#   pcheck         benchmarks/persistent_check.toml on GPU 0 (padded/triton's schedules at
#                  points of the shipped table, for comparison)
#   stepcost       benchmarks/step_cost.py (what one decode() step costs) on GPU 0
#   example        examples/engine_loop.py on GPU 0 (CUDA graph per batch bucket)
#   refine         sweeps/h200.toml --refine REFINE_S (default 300) seconds into runs/h200
#                  (needs the grid's journal and table there: carry them in)
#   jitcache       FlashInfer's JIT builds (~/.cache/flashinfer) into $OUT/jit-cache.tgz; carried
#                  back and unpacked before a later call, a fresh machine skips the nvcc builds
#   dcp            benchmarks/dcp_step.py under torchrun on every GPU (NCCL; real DCP step
#                  against the sweep's simulation), into $OUT/dcp-step.jsonl
#   gluon          the Gluon kernels beside FlashMLA (benchmarks/gluon_check.py, with the
#                  experimental ones), the transposed kernel's split counts with and without
#                  PDL (benchmarks/gluon_splits.py), pytest -m gpu tests/test_gluon_gpu.py
#   seesaw         sweeps/h200.toml for seesaw/gluon alone (its chunked param sets) on GPU 0
#   resweep        sweeps/h200{,-traffic,-heldout}.toml for the seesaw and transposed Gluon
#                  routes (their current param sets; RESWEEP_ROUTES: some of the two) on all
#                  GPUs, into runs/g-<spec>
#   fp8sweep       sweeps/h200{,-traffic,-heldout}.toml's fp8-cache problems for transposed/gluon
#                  (its fp8-MMA and widening param sets) on all GPUs, into runs/f-<spec>;
#                  a grid of bf16 caches only (h200-traffic's verify grid) is swept as it is
#                  (FP8_SPECS: some of the three)
#   prefillsweep   sweeps/h200.toml for fp8-ps/triton alone (its prefill problems; the Gluon
#                  kernel's sets where it runs) on all GPUs, into runs/p-h200
#   decodepoints   benchmarks/decode.py at issue 19's batch-1/64/128 points, bf16 and fp8
#                  caches, transposed/gluon beside FlashMLA
#   points19       benchmarks/decode.py at all of issue 19's points (fp8 caches too where it
#                  has an fp8 target), both Gluon routes beside FlashMLA, in one run
#   seesawcheck    gluon_check.py over bf16 caches: the seesaw kernel's chunked forms (plain,
#                  chunked + pdl, slim, and the lone-barrier form the route's sets run)
#                  beside FlashMLA
#   gluontests     pytest -m gpu tests/test_gluon_gpu.py
#   seesawtests    the same, its seesaw tests only (of the split walks, the afresh form's)
#   seesawab       benchmarks/decode.py at issue 19's seesaw points, the route's sets and the
#                  same without afresh_q alternating twice (decode.py --forms)
#   smallab        decode.py at batch-1 points where the re-swept seesaw rows of session 23 took
#                  up to 1.29x the time of session 17's: the route's sets with and without
#                  rope_regs, alternating twice, beside transposed/gluon and FlashMLA
#   smallsweep     benchmarks/small_check.toml (batch-1 points) swept for seesaw/gluon alone,
#                  then beside transposed/gluon and FlashMLA, then decode.py at the same points
#   twoab          the seesaw's two_requests form (of afresh: a program walks two requests):
#                  its split walks on the GPU, then decode.py at issue 19's seesaw points, the
#                  route's sets as they are and with it, alternating twice
#   ropeab         the same for rope_regs (of afresh: Q's rope part in registers), the
#                  route's sets (with it) against them without it
#   walks          the seesaw kernel's split partials each against its own keys, and the split
#                  reduce alone, on the GPU (which of the two a wrong split result comes from)
#   reduceblocks   benchmarks/reduce_blocks.py: the split reduce alone at the split decodes'
#                  shapes, its rule's block as it was and with uniform slots, and two others
#   gprefill       the Gluon fp8 prefill (fp8-ps/triton's Gluon sets): its GPU tests first (a
#                  hang ends at their timeout, and the benchmark then leaves out the newest
#                  form's sets: those with the flag GLUON_SUSPECT, default pingpong),
#                  then benchmarks/prefill.py at 1 x 4096 tokens, 128 and 16 heads, every
#                  prefill route (fp8-ps without its comparison configs)
#   prefilltests   pytest -m gpu tests/test_prefill_gpu.py but the Gluon kernel's tests
#   profilefp8     Nsight Compute at (128, 16, 8192, 1) fp8: the fp8-MMA kernel's per-SASS stall
#                  samples (profile_sass.sh), then its and FlashMLA's fp8 kernel's sections
#                  (speed of light, pipes, warp states, memory, scheduler) into $OUT/ncu-fp8-*.txt
#   ncufp8         profilefp8's Nsight Compute sections for the fp8-MMA kernel alone
#   wideab         the fp8-MMA kernel's wide_vt form (V^T transposed without bank conflicts):
#                  the fp8 GPU tests of tests/test_gluon_gpu.py, then decode.py at the fp8
#                  points with and without it, alternating twice, then its per-SASS profile
#   maxab          the fp8 GPU tests (the route's fp8-MMA sets with warp_max: a tile's max
#                  over keys across the warps in one barrier), then decode.py at the fp8
#                  points with and without it, alternating twice
#   slimab         the same for slim (the softmax masked only on a tile that reaches a bound,
#                  the scales in the exponent's FMA)
#   fp8splits      gluon_splits.py: the route's fp8-MMA form at forced split counts at small-
#                  batch points (what the kernel's own split rule is fitted to)
#   fp8mma         gluon_check.py over fp8 caches: the fp8-MMA kernel (gluon_transposed_fp8,
#                  q as two e4m3 terms and as one) beside the widening and FlashMLA; with
#                  EXPERIMENTAL=1 also its experimental forms (gluon_check.EXPERIMENTAL)
# Vendor libraries (FlashMLA, FlashInfer) come as wheels installed before this script runs,
# with PYTHONPATH pointing at them (the script keeps it). The installed tree travels as
# .whl/site.tar.xz (18 MB): here, pip download sgl-flash-mla==1.0.0,
# flashinfer-python==0.6.18.post1 and apache-tvm-ffi==0.1.15.post2 (--no-deps, CPython 3.12,
# manylinux), pip install --no-deps --target DIR --python-version 3.12 --only-binary=:all:
# them, tar cJf that DIR; the call carries it and untars it into /tmp/site first. The
# tracked tree and the carry together must stay under the device's 64 MiB a call: since
# session 21 they do not with benchmarks/results in place (43 MB), which no step reads, so
# it is moved aside for the call and back after.
# Everything it makes goes under $OUT (logs, tables and the journals, gzipped).
set -u -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps carried wheels
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" runs
BUDGET_S=${BUDGET_S:-540}
FP8_SET='{"num_splits": 1, "pdl": true, "ws": true, "fp8_mma": true, "defer_sums": true, "stacked": true, "wide_vt": true, "warp_max": true, "slim": true}'
T0=$(date +%s)
NGPU=$(nvidia-smi -L | wc -l)
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/session.log"; }
log "$(nvidia-smi -L | head -1) x$NGPU; $(python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__)')"
fp8_form_ab() {  # NAME OPTION: the fp8 GPU tests (the form in the route's fp8-MMA sets), then
  # decode.py at the fp8 points, the route's sets as they are and with OPTION false, twice
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon_gpu.py \
    -k fp8 > "$OUT/$1-tests.log" 2>&1
  log "$1 tests: rc=$?; $(tail -1 "$OUT/$1-tests.log")"
  grep "^FAILED" "$OUT/$1-tests.log" | tee -a "$OUT/session.log"
  timeout 200 python3 benchmarks/decode.py --points 3,2,0 --kv fp8 \
    --max-params 1 --routes transposed/gluon,dense/flashmla --out "$OUT/$1" \
    --forms "{\"transposed/gluon\": [{}, {\"$2\": false}, {}, {\"$2\": false}]}" \
    > "$OUT/$1.log" 2>&1
  log "$1: rc=$?"; cat "$OUT/$1"/decode-*.md | grep -A30 "## Forms" | tee -a "$OUT/session.log"
}
seesaw_form_ab() {  # NAME TEST-FORM OPTIONS: the seesaw's split walks in SEESAW_FORMS' form,
  # then decode.py at its points, the route's sets as they are and with OPTIONS, twice
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon_gpu.py \
    -k "seesaw and $2" > "$OUT/$1-tests.log" 2>&1
  log "$1 tests: rc=$?; $(tail -1 "$OUT/$1-tests.log")"
  grep "^FAILED" "$OUT/$1-tests.log" | tee -a "$OUT/session.log"
  timeout 240 python3 benchmarks/decode.py --points 7,8,6,4,9 --kv bf16 \
    --routes seesaw/gluon,dense/flashmla --out "$OUT/$1" \
    --forms "{\"seesaw/gluon\": [{}, $3, {}, $3]}" > "$OUT/$1.log" 2>&1
  log "$1: rc=$?"; cat "$OUT/$1"/decode-*.md | grep -A30 "## Forms" | tee -a "$OUT/session.log"
}
ncu_fp8() {  # kernel-regex route params: Nsight Compute's sections at (128, 16, 8192, 1) fp8
  timeout 150 "$(command -v ncu || ls /usr/local/cuda*/bin/ncu | head -1)" --clock-control none \
    --kernel-name "regex:$1" --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section LaunchStats --section Occupancy --section SchedulerStats \
    python3 benchmarks/profile_decode.py --route "$2" --batch 128 --heads 16 --kv-len 8192 \
    --kv-dtype fp8_e4m3fn --params "$3" > "$OUT/ncu-fp8-${2%%/*}.txt" 2>&1
  log "ncu $2: rc=$? $(grep -m1 Duration "$OUT/ncu-fp8-${2%%/*}.txt")"
}
sweep() {  # name spec gpus [more sweep options]
  local left=$(( BUDGET_S - ($(date +%s) - T0) ))
  [ "$left" -gt 20 ] || { log "$1: no time left"; return; }
  local s=$(date +%s)
  timeout -s INT "$left" python3 -m mlatune sweep $2 --arch sm_90 --gpus "$3" --resume \
    --out "runs/$1/sm_90-$1.parquet" "${@:4}" > "$OUT/$1.log" 2>&1
  local rc=$?
  log "$1: rc=$rc wall=$(( $(date +%s) - s ))s journal lines=$(wc -l < runs/$1/sm_90-$1.journal.jsonl)"
  tail -15 "$OUT/$1.log" | tee -a "$OUT/session.log"
  python3 benchmarks/sweep_cost.py "runs/$1/sm_90-$1.journal.jsonl" | tee -a "$OUT/session.log"
}
run_tests() {
  local s=$(date +%s)
  python3 -m pytest -m gpu -q -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1
  log "tests: rc=$? wall=$(( $(date +%s) - s ))s; $(tail -1 "$OUT/gpu-tests.log")"
}
TESTS_PID=""
wait_tests() {  # the background tests (bounded by their own timeout), if any
  [ -n "$TESTS_PID" ] || return 0
  wait "$TESTS_PID"
  log "tests: rc=$? wall=$(( $(date +%s) - TESTS_T0 ))s; $(tail -1 "$OUT/gpu-tests.log")"
  TESTS_PID=""
}
for step in "$@"; do
  case $step in
    tests) run_tests ;;
    testsbg) if [ "$NGPU" -lt 2 ]; then run_tests; continue; fi
             CUDA_VISIBLE_DEVICES=$(( NGPU - 1 )) TRITON_CACHE_DIR=/tmp/triton-tests \
               timeout "$(( BUDGET_S - ($(date +%s) - T0) ))" \
               python3 -m pytest -m gpu -q -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1 &
             TESTS_PID=$!; TESTS_T0=$(date +%s); log "tests: started in the background" ;;
    waittests) wait_tests ;;
    smoke1) sweep smoke1 "" 1 ;;
    smoke2) sweep smoke2 "" "$NGPU" ;;
    h200) sweep h200 sweeps/h200.toml "$NGPU" ;;
    heldout) sweep heldout sweeps/h200-heldout.toml "$NGPU" ;;
    traffic) sweep traffic sweeps/h200-traffic.toml "$NGPU" ;;
    h200fresh) sweep h200fresh sweeps/h200.toml "$NGPU" ;;
    h200one) ( export CUDA_VISIBLE_DEVICES=0; sweep h200one sweeps/h200.toml 1 ${SHARD:+--shard "$SHARD"} ) ;;
    jitcache) tar czf "$OUT/jit-cache.tgz" -C ~ .cache/flashinfer
              log "jitcache: $(du -h "$OUT/jit-cache.tgz" | cut -f1)" ;;
    bundled) { python3 -m mlatune doctor
               python3 -m mlatune coverage sweeps/h200-heldout.toml --require nearest
             } > "$OUT/bundled.log" 2>&1
             log "bundled: rc=$?"; tail -12 "$OUT/bundled.log" | tee -a "$OUT/session.log" ;;
    pcheck) ( export CUDA_VISIBLE_DEVICES=0; sweep pcheck benchmarks/persistent_check.toml 1 ) ;;
    stepcost) CUDA_VISIBLE_DEVICES=0 python3 benchmarks/step_cost.py \
                --out "$OUT/step-cost.jsonl" > "$OUT/step-cost.log" 2>&1
              log "stepcost: rc=$?"; cat "$OUT/step-cost.log" | tee -a "$OUT/session.log" ;;
    example) CUDA_VISIBLE_DEVICES=0 python3 examples/engine_loop.py >> "$OUT/session.log" 2>&1
             log "example: rc=$?" ;;
    refine) left=$(( BUDGET_S - ($(date +%s) - T0) ))
            timeout -s INT "$left" python3 -m mlatune sweep sweeps/h200.toml --arch sm_90 \
              --gpus "$NGPU" --out runs/h200/sm_90-h200.parquet --refine "${REFINE_S:-300}" \
              > "$OUT/refine.log" 2>&1
            log "refine: rc=$?"; tail -15 "$OUT/refine.log" | tee -a "$OUT/session.log" ;;
    dcp) timeout "$(( BUDGET_S - ($(date +%s) - T0) ))" torchrun --nproc_per_node "$NGPU" \
           benchmarks/dcp_step.py --out "$OUT/dcp-step.jsonl" > "$OUT/dcp-step.log" 2>&1
         log "dcp: rc=$?"; tail -12 "$OUT/dcp-step.log" | tee -a "$OUT/session.log" ;;
    gluon) { timeout 250 python3 benchmarks/gluon_check.py --out "$OUT/gluon-check" \
               --experimental --skip wgmma/gluon,seesaw/gluon --budget 220
             timeout 90 python3 benchmarks/gluon_splits.py --points bf16 --pdl --splits 16,32,64
             timeout 210 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon_gpu.py
           } > "$OUT/gluon.log" 2>&1
           log "gluon: rc=$?; $(grep -c 'FAIL\|error' "$OUT/gluon.log") FAIL/error lines"
           grep "): best gluon\|smoke:\|passed\|failed" "$OUT/gluon.log" | tee -a "$OUT/session.log" ;;
    seesaw) ( export CUDA_VISIBLE_DEVICES=0; sweep seesaw sweeps/h200.toml 1 --routes seesaw/gluon ) ;;
    resweep) for spec in h200 h200-traffic h200-heldout; do
               sweep "g-$spec" "sweeps/$spec.toml" "$NGPU" \
                 --routes "${RESWEEP_ROUTES:-seesaw/gluon,transposed/gluon}"
             done ;;
    fp8mma) timeout 200 python3 benchmarks/gluon_check.py --out "$OUT/gluon-fp8mma" --kv fp8 \
              ${EXPERIMENTAL:+--experimental} --budget 170 --smoke-timeout 90 \
              --skip "wgmma/gluon,seesaw/gluon,\
seesaw/gluon chunked,transposed/gluon plain,transposed/gluon reduce,transposed/gluon merge" \
              > "$OUT/fp8mma.log" 2>&1
            log "fp8mma: rc=$?"; grep "smoke:\|fp8mma\|best gluon" "$OUT/fp8mma.log" | tee -a "$OUT/session.log" ;;
    fp8sweep) for spec in ${FP8_SPECS:-h200 h200-traffic h200-heldout}; do
                sed -e 's/kv_dtype = \["bf16", "fp8_e4m3fn"\]/kv_dtype = ["fp8_e4m3fn"]/' \
                  "sweeps/$spec.toml" > "runs/$spec-fp8.toml"
                sweep "f-$spec" "runs/$spec-fp8.toml" "$NGPU" --routes transposed/gluon
              done ;;
    prefillsweep) sweep p-h200 sweeps/h200.toml "$NGPU" --routes fp8-ps/triton ;;
    decodepoints) timeout 150 python3 benchmarks/decode.py --points 0,2,3 --kv bf16,fp8 \
                    --routes transposed/gluon,dense/flashmla --out "$OUT/decode" \
                    > "$OUT/decode.log" 2>&1
                  log "decodepoints: rc=$?"; grep -i "target\|ratio\|^|" "$OUT/decode.log" \
                    | tail -20 | tee -a "$OUT/session.log" ;;
    points19) timeout 100 python3 benchmarks/decode.py --points 0,2,3 --kv bf16,fp8 \
                --routes seesaw/gluon,transposed/gluon,dense/flashmla --out "$OUT/decode" \
                > "$OUT/points19.log" 2>&1; rc=$?
              timeout 120 python3 benchmarks/decode.py --points 4,6,7,8,9 --kv bf16 \
                --routes seesaw/gluon,transposed/gluon,dense/flashmla --out "$OUT/decode" \
                >> "$OUT/points19.log" 2>&1
              log "points19: rc=$rc,$?"; grep -i "target" "$OUT/points19.log" | tee -a "$OUT/session.log" ;;
    seesawcheck) timeout 430 python3 benchmarks/gluon_check.py --out "$OUT/seesaw-check" \
                   --kv bf16 --experimental --budget 380 --smoke-timeout 180 --skip "wgmma/gluon,\
seesaw/gluon,transposed/gluon,transposed/gluon plain,transposed/gluon reduce,\
transposed/gluon merge,transposed/gluon fp8mma,transposed/gluon fp8mma 1term,\
transposed/gluon fp8mma deferred" > "$OUT/seesaw-check.log" 2>&1
                 log "seesawcheck: rc=$?"; grep "smoke:\|best gluon" "$OUT/seesaw-check.log" \
                   | tee -a "$OUT/session.log" ;;
    walks) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon_gpu.py \
             tests/test_triton_decode_gpu.py -k "split_partials or reduce_kernel" \
             > "$OUT/walks.log" 2>&1
           log "walks: rc=$?; $(tail -1 "$OUT/walks.log")"; grep "^FAILED" "$OUT/walks.log" \
             | tee -a "$OUT/session.log" ;;
    reduceblocks) timeout 150 python3 benchmarks/reduce_blocks.py --blocks 1x512,2x64 \
                    --out "$OUT/reduce-blocks" > "$OUT/reduce-blocks.log" 2>&1
                  log "reduceblocks: rc=$?"; tee -a "$OUT/session.log" < "$OUT/reduce-blocks.log" ;;
    seesawab) timeout 200 python3 benchmarks/decode.py --points 4,6,7,8,2 --kv bf16 \
                --routes seesaw/gluon,dense/flashmla --out "$OUT/seesawab" --forms \
                '{"seesaw/gluon": [{}, {"afresh_q": false}, {}, {"afresh_q": false}]}' \
                > "$OUT/seesawab.log" 2>&1
              log "seesawab: rc=$?"; grep -i "target" "$OUT/seesawab.log" | tee -a "$OUT/session.log" ;;
    smallab) pts=""
             for p in 1,32,1024,1 1,32,1024,4 1,32,4096,4 1,64,1024,4 1,64,4096,4 1,128,4096,3 \
                      1,16,16384,4; do pts="$pts --point $p"; done
             timeout 300 python3 benchmarks/decode.py $pts --kv bf16 --max-params 2 \
               --routes seesaw/gluon,transposed/gluon,dense/flashmla --out "$OUT/smallab" \
               --forms '{"seesaw/gluon": [{}, {"rope_regs": false}, {}, {"rope_regs": false}]}' \
               > "$OUT/smallab.log" 2>&1
             log "smallab: rc=$?"; grep "^form\|  best" "$OUT/smallab.log" | tee -a "$OUT/session.log" ;;
    smallsweep) ( export CUDA_VISIBLE_DEVICES=0
                  sweep small-alone benchmarks/small_check.toml 1 --routes seesaw/gluon
                  sweep small-three benchmarks/small_check.toml 1 \
                    --routes seesaw/gluon,transposed/gluon,dense/flashmla
                  pts=""
                  for p in 1,32,1024,1 1,32,1024,4 1,32,4096,1 1,32,4096,4 1,64,1024,1 \
                           1,64,1024,4 1,64,4096,1 1,64,4096,4; do pts="$pts --point $p"; done
                  timeout 200 python3 benchmarks/decode.py $pts --kv bf16 --max-params 3 \
                    --routes seesaw/gluon,transposed/gluon,dense/flashmla \
                    --out "$OUT/smallsweep" > "$OUT/smallsweep.log" 2>&1
                  log "smallsweep decode: rc=$?"; grep "  best" "$OUT/smallsweep.log" \
                    | tee -a "$OUT/session.log" ) ;;
    twoab) seesaw_form_ab twoab two '{"two_requests": true}' ;;
    ropeab) seesaw_form_ab ropeab rope '{"rope_regs": false}' ;;
    seesawtests) s=$(date +%s)
                 timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon_gpu.py \
                   -k "seesaw and not (slim or lone or two or rope)" \
                   > "$OUT/seesaw-tests.log" 2>&1
                 log "seesawtests: rc=$? wall=$(( $(date +%s) - s ))s; $(tail -1 "$OUT/seesaw-tests.log")"
                 grep "^FAILED" "$OUT/seesaw-tests.log" | tee -a "$OUT/session.log" ;;
    gluontests) s=$(date +%s)
                timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gluon_gpu.py \
                  > "$OUT/gluon-tests.log" 2>&1
                log "gluontests: rc=$? wall=$(( $(date +%s) - s ))s; $(tail -1 "$OUT/gluon-tests.log")" ;;
    gprefill) { timeout 180 python3 -m pytest -q -p no:cacheprovider -m gpu \
                  tests/test_prefill_gpu.py -k gluon; smoke=$?
                timeout 240 python3 benchmarks/prefill.py --out "$OUT/prefill" --sizes 1x4096 \
                  --heads 128 16 --no-fp8-comparison \
                  $( [ "$smoke" = 0 ] || echo --gluon-without ${GLUON_SUSPECT:-pingpong} )
              } > "$OUT/gprefill.log" 2>&1
              log "gprefill: rc=$?"
              grep "passed\|failed\|fp8-ps\|sdpa\|bf16-ps" "$OUT/gprefill.log" | tail -30 \
                | tee -a "$OUT/session.log" ;;
    prefilltests) timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
                    tests/test_prefill_gpu.py -k "not gluon" > "$OUT/prefill-tests.log" 2>&1
                  log "prefilltests: rc=$?; $(tail -1 "$OUT/prefill-tests.log")" ;;
    ncufp8) ncu_fp8 transposed_fp8_kernel transposed/gluon "$FP8_SET" ;;
    profilefp8) bash benchmarks/profile_sass.sh fp8-stacked transposed_fp8_kernel \
                  transposed/gluon 128 16 8192 fp8_e4m3fn "$FP8_SET" | tee -a "$OUT/session.log"
                ncu_fp8 transposed_fp8_kernel transposed/gluon "$FP8_SET"
                ncu_fp8 fwd dense/flashmla '{}' ;;
    wideab) fp8_form_ab wideab wide_vt
            bash benchmarks/profile_sass.sh fp8-wide transposed_fp8_kernel transposed/gluon \
              128 16 8192 fp8_e4m3fn "$FP8_SET" | tee -a "$OUT/session.log" ;;
    maxab) fp8_form_ab maxab warp_max ;;
    slimab) fp8_form_ab slimab slim ;;
    fp8splits) pts=""
               for p in 1,16,4096 2,16,8192 3,16,11000 4,16,4096 4,8,16384 8,16,8192 \
                        12,8,1500 16,16,1024 16,16,4096 24,16,2048 32,16,4096 64,8,1024; do
                 pts="$pts --point $p,1,fp8"; done
               timeout 200 python3 benchmarks/gluon_splits.py --kernel gluon_transposed_fp8 \
                 --options '{"pdl": true, "defer_sums": true, "stacked": true, "wide_vt": true,
                   "warp_max": true, "slim": true}' \
                 --splits 1,2,3,4,6,8,12,16,24,32,48,64 $pts > "$OUT/fp8-splits.log" 2>&1
               log "fp8splits: rc=$?"; grep -c " ok" "$OUT/fp8-splits.log" | tee -a "$OUT/session.log" ;;
    *) log "unknown step $step" ;;
  esac
done
wait_tests
# Journals and tables travel back gzipped in one tarball (files from $OUT: 8 at most).
tar czf "$OUT/runs.tgz" runs
log "done; runs.tgz $(du -h "$OUT/runs.tgz" | cut -f1)"
