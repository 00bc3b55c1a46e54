#!/usr/bin/env bash
# Clocks and power beside the points where the two Hopper tables disagree most (nvidia-smi every 100 ms;
# each point held 2 s), then Nsight Compute of each kernel: bash benchmarks/clock_probe.sh TAG (writes $OUT/TAG-*).
set -u
# A machine without network: vendor wheels carried in .whl are installed first.
[ -d .whl ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1; }
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a
tag=$1
nvidia-smi --query-gpu=name,driver_version,power.limit,enforced.power.limit,power.max_limit,clocks.max.sm,clocks.max.mem,clocks.applications.graphics --format=csv | tee $OUT/$tag-gpu.csv
FM='{"interface": "legacy"}'
SEG='{"block_m": 64, "block_n": 32, "num_segments": 8, "num_stages": 2, "num_warps": 8}'
PAD='{"block_m": 64, "block_n": 32, "num_splits": 8, "num_stages": 2, "num_warps": 8}'
SS='{"form": "pairs", "num_splits": 1}'
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,clocks_event_reasons.active --format=csv -lms 100 > $OUT/$tag-smi.csv &
smi=$!
pt() { echo "START $1 $2 $(date +%s.%N)"; python3 benchmarks/point.py "$@"; echo "END $1 $2 $(date +%s.%N)"; }
for round in $(seq ${ROUNDS:-2}); do
  pt dense/flashmla 256,128,16384,3,1 "$FM" 1
  pt dense/flashmla 64,128,4096,1,1 "$FM" 1
  pt seesaw/gluon 256,128,16384,3,1 "$SS" 1
  pt segmented/triton 1,128,4096,4,4 "$SEG" 1
  pt padded/triton 1,128,4096,4,4 "$PAD" 1
done 2>&1 | tee $OUT/$tag-points.txt
kill $smi
M=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,dram__cycles_elapsed.avg.per_second,gpc__cycles_elapsed.max,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,lts__t_sector_hit_rate.pct,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
NCU_SPECS=("dense/flashmla 256,128,16384,3,1 $FM" "segmented/triton 1,128,4096,4,4 $SEG" "seesaw/gluon 256,128,16384,3,1 $SS" "padded/triton 1,128,4096,4,4 $PAD")
for spec in "${NCU_SPECS[@]:0:${NCU_N:-4}}"; do
  set -- $spec; r=$1; s=$2; shift 2
  POINT_SECONDS=0.2 timeout 100 ncu --clock-control none --profile-from-start off --metrics $M --csv python3 benchmarks/point.py $r $s "$*" 2 > $OUT/$tag-ncu-${r//\//_}.csv 2>&1 || echo "ncu $r rc $?"
done
