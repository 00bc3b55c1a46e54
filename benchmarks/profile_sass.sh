#!/usr/bin/env bash
# Per-instruction Nsight Compute counters (stall samples, executed instructions) of the
# kernels behind issue 19's remaining decode gaps, as CSV (SASS, one row per instruction).
# Usage on the device (PYTHONPATH kept):
#   bash benchmarks/profile_sass.sh                  seesaw/gluon at (128, 128, 4096, 1) bf16
#                                                    and transposed/gluon's ws widening at
#                                                    (128, 16, 8192, 1) fp8
#   bash benchmarks/profile_sass.sh NAME KERNEL-REGEX ROUTE BATCH HEADS KV DTYPE [PARAMS]
# writes $OUT/sass-NAME.csv.gz (read it with benchmarks/sass_stalls.py).
set -u -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
sass() {  # name kernel-regex route batch heads kv dtype [params]
  timeout 200 "$NCU" --clock-control none --kernel-name "regex:$2" --launch-skip 2 \
    --launch-count 1 --section SourceCounters --section WarpStateStats --page source \
    --print-source sass --csv python3 benchmarks/profile_decode.py --route "$3" --batch "$4" \
    --heads "$5" --kv-len "$6" --kv-dtype "$7" --params "${8:-{\}}" 2> "$OUT/sass-$1.err" \
    | gzip > "$OUT/sass-$1.csv.gz"
  echo "$1: rc=$? $(zcat "$OUT/sass-$1.csv.gz" | wc -l) lines"
}
if [ $# -gt 0 ]; then
  sass "$@"
else
  sass seesaw seesaw_kernel seesaw/gluon 128 128 4096 bf16
  sass transposed-ws transposed_ws_kernel transposed/gluon 128 16 8192 fp8_e4m3fn \
    '{"ws": true, "pdl": true}'
fi
