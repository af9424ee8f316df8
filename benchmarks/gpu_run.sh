#!/usr/bin/env bash
# One full GPU session on the lent H200, in as few calls as possible (the device budget is 30 min):
#   bash benchmarks/gpu_run.sh [stages]      stages: comma list of env,tests,bench,calibrate,profile,suggest,apply,step,
#                                            diagnose (host vs GPU time per kernel; DIAG_ONLY=rms_norm,...), sweep (CE/LCE configs),
#                                            normsweep (norm launch configs), glusweep (bias+GELU backward configs), ncu (Nsight Compute on the kernels that miss), debug (benchmarks/debug_*.py)
# Everything lands under $OUT (logs, kernels.csv, calibration, profile summaries); the lead commits
# what matters to benchmarks/results/. Carry .whl (Liger Kernel wheel) with the call.
set -uo pipefail
OUT=${OUT:-/tmp/kprof-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KPROF_CACHE_DIR="$OUT/cache"
STAGES=${1:-env,tests,bench,calibrate,profile}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
if has env; then
  { date -u; nvidia-smi; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } >"$OUT/env.txt" 2>&1
  tail -3 "$OUT/env.txt"
fi
if has tests; then
  # Correctness in parallel processes (timings are not taken here). -v: each result is logged with
  # its name as it lands, so a run cut by its time limit still says what failed.
  # The 1B-model tests (marker gpu_large, ~25 GB each) run after the rest, one at a time: with 8
  # workers sharing the GPU they ran out of memory (2026-11-29 23:35, other workers held ~130 GB).
  timeout ${TEST_TIMEOUT:-280} python3 -m pytest -v -rfE -n 8 -m "not gpu_large" -p no:cacheprovider --junitxml="$OUT/junit.xml" tests 2>&1 | tee "$OUT/pytest.log" | tail -40
  pkill -f "sys[.]stdin[.]readline" 2>/dev/null; sleep 1  # xdist (execnet) workers may outlive a timed-out main process; match them only: "pytest" also matched the caller's command line (2026-11-29)
  timeout ${LARGE_TEST_TIMEOUT:-200} python3 -m pytest -v -rfE -m gpu_large -p no:cacheprovider --junitxml="$OUT/junit-large.xml" tests 2>&1 | tee "$OUT/pytest-large.log" | tail -20
fi
if has gputests; then
  # The tests of GPU_TESTS (default: all) marked TEST_MARK (default gpu; TEST_MARK= for all of them).
  MARK=${TEST_MARK-gpu}
  timeout ${TEST_TIMEOUT:-280} python3 -m pytest -v -rfE -n ${TEST_WORKERS:-4} ${MARK:+-m "$MARK"} -p no:cacheprovider --junitxml="$OUT/junit-gpu.xml" ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/pytest-gpu.log" | tail -30
  pkill -f "sys[.]stdin[.]readline" 2>/dev/null; sleep 1
fi
if has bench; then
  timeout ${BENCH_TIMEOUT:-540} python3 benchmarks/bench_kernels.py --csv "$OUT/kernels.csv" ${BENCH_ONLY:+--only $BENCH_ONLY} 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if has diagnose; then
  timeout ${DIAG_TIMEOUT:-150} python3 benchmarks/diagnose.py --cprofile ${DIAG_ONLY:+--only $DIAG_ONLY} 2>&1 | tee "$OUT/diagnose.log" | tail -150
fi
if has sweep; then
  timeout ${SWEEP_TIMEOUT:-200} python3 -m benchmarks.cases.loss ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | tail -100
fi
if has glusweep; then
  timeout ${GLUSWEEP_TIMEOUT:-150} python3 -m benchmarks.cases.glu ${GLUSWEEP_ARGS:-} 2>&1 | tee "$OUT/glusweep.log" | tail -45
fi
if has normsweep; then
  timeout ${NORMSWEEP_TIMEOUT:-150} python3 -m benchmarks.cases.norms ${NORMSWEEP_ARGS:-} 2>&1 | tee "$OUT/normsweep.log" | tail -20
fi
if has ncu; then
  timeout ${NCU_TIMEOUT:-120} ncu --kernel-name regex:"${NCU_KERNELS:-_ce_fwd|_rms_norm_bwd|_layer_norm_(fwd|bwd)|_bias_gelu_bwd}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum python3 benchmarks/ncu_kernels.py >"$OUT/ncu.log" 2>&1
  grep -E "_kernel|dram__bytes|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|DRAM Throughput|Block Size|Grid Size" "$OUT/ncu.log" | head -120
fi
if has debug; then
  for f in benchmarks/${DEBUG_GLOB:-debug_*.py}; do [ -f "$f" ] && timeout ${DEBUG_TIMEOUT:-120} python3 "$f" 2>&1 | tee -a "$OUT/debug.log" | tail -40; done
fi
if has calibrate; then
  timeout 90 kprof calibrate 2>&1 | tee "$OUT/calibrate.log" | tail -20
fi
if has profile; then
  timeout ${PROFILE_TIMEOUT:-200} kprof profile examples/llama_train.py --out "$OUT/runs" -- --preset 1b --device cuda 2>&1 | tee "$OUT/profile_llama.log" | tail -80
fi
if has suggest; then
  timeout 60 kprof suggest --out "$OUT/runs" 2>&1 | tee "$OUT/suggest_llama.log" | tail -40
fi
if has apply; then
  timeout ${APPLY_TIMEOUT:-240} kprof apply examples/llama_train.py --patch all --out "$OUT/runs" --write "$OUT/runs/keep_patches.py" -- --preset 1b --device cuda 2>&1 | tee "$OUT/apply_llama.log" | tail -60
fi
if has step; then
  timeout ${STEP_TIMEOUT:-300} python3 benchmarks/bench_llama_step.py --csv "$OUT/llama_step.csv" ${STEP_VARIANTS:+--variants $STEP_VARIANTS} ${STEP_ARGS:-} 2>&1 | tee "$OUT/llama_step.log" | tail -20
fi
if has compare_llama; then
  timeout ${COMPARE_TIMEOUT:-300} kprof apply examples/llama_train.py --compare --out "$OUT/runs" -- --preset 1b --device cuda 2>&1 | tee "$OUT/compare_llama.log" | tail -40
fi
if has compare_gpt; then
  timeout ${COMPARE_GPT_TIMEOUT:-200} kprof apply examples/gpt_train.py --compare --out "$OUT/runs" -- --device cuda --dtype bfloat16 ${COMPARE_GPT_ARGS:---batch-size 8 --seq-len 1024} 2>&1 | tee "$OUT/compare_gpt.log" | tail -40
fi
# At most 8 files come back: the CSVs as they are, everything else (logs, run dirs without their
# traces, the calibration cache) in one tarball.
( cd "$OUT" && tar czf artifacts.tgz --exclude='trace.json.gz' --exclude='*.csv' --exclude='artifacts.tgz' . 2>/dev/null \
  && find . -mindepth 1 -maxdepth 1 ! -name '*.csv' ! -name artifacts.tgz -exec rm -rf {} + )
ls -la "$OUT"
