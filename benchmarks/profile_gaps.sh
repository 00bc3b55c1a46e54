#!/usr/bin/env bash
# Nsight Compute profiles of the remaining issue-19 gaps, one kernel launch each (the third
# of benchmarks/profile_decode.py's runs), mlatune's kernel beside FlashMLA's at one point:
#   fp8 cache at (128, 16, 8192, 1): transposed/gluon's one-warpgroup widening ("plain"), its
#     warp-specialized widening (the route's fp8 form), its bf16 form, FlashMLA's fp8 path;
#   128 heads at (128, 128, 4096, 1): seesaw/gluon (chunked) and FlashMLA.
# Usage on the device (sgl-flash-mla installed, PYTHONPATH kept): bash benchmarks/profile_gaps.sh
# Writes $OUT/ncu-gaps.txt (every profile, each headed by its command).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine" | tee "$OUT/ncu-gaps.txt"; exit 1; }
SECTIONS="--section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
profile() {  # kernel-regex route batch heads kv dtype params
  local cmd="$NCU --clock-control none --kernel-name regex:$1 --launch-skip 2 --launch-count 1 \
$SECTIONS python3 benchmarks/profile_decode.py --route $2 --batch $3 --heads $4 --kv-len $5 \
--kv-dtype $6 --params '$7'"
  echo "=== $cmd" >> "$OUT/ncu-gaps.txt"
  eval "timeout 150 $cmd" > /tmp/ncu-one.txt 2>&1
  echo "=== rc=$? $(date -u +%H:%M:%S)" >> /tmp/ncu-one.txt
  cat /tmp/ncu-one.txt >> "$OUT/ncu-gaps.txt"
  if ! grep -q "Speed Of Light" /tmp/ncu-one.txt; then  # the regex missed: name the kernels
    timeout 100 "$NCU" --launch-count 12 --section LaunchStats python3 benchmarks/profile_decode.py \
      --route "$2" --batch "$3" --heads "$4" --kv-len "$5" --kv-dtype "$6" --params "$7" 2>&1 \
      | grep -E "^  [a-zA-Z_].*\(" >> "$OUT/ncu-gaps.txt"
  fi
}
date -u >> "$OUT/ncu-gaps.txt"
profile '^transposed_kernel' transposed/gluon 128 16 8192 fp8_e4m3fn '{"ws": false}'
profile transposed_ws_kernel transposed/gluon 128 16 8192 fp8_e4m3fn '{}'
profile '^transposed_kernel' transposed/gluon 128 16 8192 bf16 '{}'
profile splitkv dense/flashmla 128 16 8192 fp8_e4m3fn '{}'
profile seesaw_kernel seesaw/gluon 128 128 4096 bf16 '{}'
profile splitkv dense/flashmla 128 128 4096 bf16 '{}'
grep -c "Section: GPU Speed Of Light" "$OUT/ncu-gaps.txt"
