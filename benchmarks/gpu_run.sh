#!/usr/bin/env bash
# One full GPU session on the lent H200, in as few calls as possible (the device budget is 30 min):
#   bash benchmarks/gpu_run.sh [stages]      stages: comma list of env,tests,gputests,bench,calibrate,profile,suggest,apply,step,
#                                            compare_llama,compare_gpt, diagnose (host vs GPU time per kernel; DIAG_ONLY=rms_norm,...),
#                                            sweep (CE/LCE configs), normsweep (norm launch configs), glusweep (bias+GELU configs),
#                                            cudagraphs (issue 19 item 3: the cuda_graphs patch on the small MLP)
# Reproduces the files indexed in benchmarks/results/README.md: env -> env-h200-*.txt; tests ->
# pytest-h200-*-full.log.gz and *-gpu_large.log; bench -> bench-h200-*.log and rows of kernels.csv
# (the kernel table of the top README); step -> llama-step-h200-*.log and rows of llama_step.csv
# (the 1B Llama step, kprof vs Liger); calibrate, profile, suggest, apply, compare_* -> the
# calibration, profile, plan, apply and compare files; diagnose, sweep, normsweep, glusweep -> the
# diagnose-, sweep-, normsweep- and glusweep- files.
# Everything lands under $OUT (logs, kernels.csv, calibration, profile summaries); the lead commits
# what matters to benchmarks/results/. Carry .whl (Liger Kernel wheel) with the call.
set -uo pipefail
OUT=${OUT:-/tmp/kprof-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KPROF_CACHE_DIR="$OUT/cache"
STAGES=${1:-env,tests,bench,calibrate,profile}
has() { [[ ",$STAGES," == *",$1,"* ]]; }
# run_group LOG LINES CMD...: run CMD in a session (and process group) of its own, its output to
# LOG, then print LOG's last LINES lines. pytest-xdist's workers (execnet) can outlive a main
# process that `timeout` stopped (2026-11-29), so whatever is left of that group is then killed by
# its id: only processes this script started, never a match on names. The background job is not a
# group leader, so setsid makes it one without forking: $! is the new group's id.
run_group() {
  local log=$1 lines=$2 pid rc
  shift 2
  setsid "$@" >"$log" 2>&1 &
  pid=$!
  wait "$pid"; rc=$?
  kill -KILL -- "-$pid" 2>/dev/null
  tail -n "$lines" "$log"
  return "$rc"
}
# At most 8 files come back: the CSVs and HTML reports as they are, everything else (logs, run
# dirs without their traces, the calibration cache) in one tarball, re-made after each stage so
# that a call cut at its limit still returns what finished.
pack() {
  ( cd "$OUT" && tar czf .artifacts.tgz --exclude='trace.json.gz' --exclude='*.csv' --exclude='*.html' \
      --exclude='artifacts.tgz' --exclude='.artifacts.tgz' --exclude='*.pickle' --exclude='.cache' --exclude='cache' . 2>/dev/null && mv .artifacts.tgz artifacts.tgz )
}
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
  run_group "$OUT/pytest.log" 40 timeout ${TEST_TIMEOUT:-280} python3 -m pytest -v -rfE -n 8 -m "not gpu_large" \
    -p no:cacheprovider --junitxml="$OUT/junit.xml" tests
  run_group "$OUT/pytest-large.log" 20 timeout ${LARGE_TEST_TIMEOUT:-200} python3 -m pytest -v -rfE -m gpu_large \
    -p no:cacheprovider --junitxml="$OUT/junit-large.xml" tests
fi
if has gputests; then
  # The tests of GPU_TESTS (default: all) marked TEST_MARK (default gpu; TEST_MARK= for all of them).
  MARK=${TEST_MARK-gpu}
  # --timeout (pytest-timeout, in the device image): a hung test fails with its stack instead of
  # the stage's limit cutting pytest before it prints any traceback (test_compare_llama_tiny_on_gpu
  # hung twice on 2026-12-02 and took the failures' tracebacks with it).
  run_group "$OUT/pytest-gpu.log" 30 timeout ${TEST_TIMEOUT:-280} python3 -m pytest -v -rfE -n ${TEST_WORKERS:-4} \
    --timeout=${PER_TEST_TIMEOUT:-100} \
    ${MARK:+-m "$MARK"} -p no:cacheprovider --junitxml="$OUT/junit-gpu.xml" ${GPU_TESTS:-tests}
  pack
fi
if has large; then
  # The gpu_large tests alone, one at a time (run gputests with TEST_MARK="gpu and not gpu_large").
  run_group "$OUT/pytest-large.log" 20 timeout ${LARGE_TEST_TIMEOUT:-200} python3 -m pytest -v -rfE -m gpu_large \
    -p no:cacheprovider --junitxml="$OUT/junit-large.xml" tests
  pack
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
if has ablation; then
  # Issue 18: apply's ablation per workload (benchmarks/bench_apply_ablation.py); its JSON and
  # markdown are rewritten after each workload, so a cut call keeps the finished ones.
  timeout ${ABL_TIMEOUT:-420} python3 benchmarks/bench_apply_ablation.py --out "$OUT/ablation" \
    --workloads ${ABL_WORKLOADS:-llama1b,llama150m,mixtral,decoder} --timeout ${ABL_CALL_TIMEOUT:-300} ${ABL_ARGS:-} \
    >"$OUT/ablation.log" 2>&1; tail -60 "$OUT/ablation.log"; pack
fi
# The stages below read the 1B Llama's plan run that `ablation` (workload llama1b) profiled.
RUN1B=$(ls -d "$OUT"/ablation/runs/llama1b/*/ 2>/dev/null | grep -v apply | head -1)
if has html && [[ -n "$RUN1B" ]]; then
  # Issue 24: the 1B Llama's self-contained HTML report, kept as the example under docs/.
  timeout 120 kprof report "$RUN1B" --html "$OUT/report-llama1b.html" 2>&1 | tail -5
  timeout 60 kprof report "$RUN1B" --memory >"$OUT/memory-llama1b.txt" 2>&1; tail -40 "$OUT/memory-llama1b.txt"
  timeout 60 kprof report "$RUN1B" --memory --json >"$OUT/memory-llama1b.json" 2>/dev/null; pack
fi
if has drift; then
  if [[ -z "$RUN1B" ]]; then
    timeout 200 kprof profile examples/llama_train.py --out "$OUT/ablation/runs/llama1b" --warmup 3 --steps 5 \
      -- --preset 1b --device cuda --steps 400 >"$OUT/drift-profile.log" 2>&1
    RUN1B=$(ls -d "$OUT"/ablation/runs/llama1b/*/ 2>/dev/null | head -1)
  fi
  # the plan must know the planted rule: suggest with --rules writes it into the run's plan
  timeout 60 kprof suggest "$RUN1B" --out "$OUT/ablation/runs/llama1b" --rules benchmarks/planted >"$OUT/drift-suggest.log" 2>&1
  # Issue 22: a planted drifting RMSNorm (benchmarks/planted/), kept with --keep-losers: the
  # whole-run loss watch must call it diverged (exit 3) and write nothing.
  timeout ${DRIFT_TIMEOUT:-240} kprof apply examples/llama_train.py --run "$RUN1B" --out "$OUT/ablation/runs/llama1b" \
    --rules benchmarks/planted --patch drift_rms_norm --keep-losers --json --write "$OUT/drift-keep.py" \
    -- --preset 1b --device cuda --steps 400 >"$OUT/drift.json" 2>"$OUT/drift.err"; echo "drift exit $?"
  tail -5 "$OUT/drift.err"; pack
fi
if has hostcost; then
  timeout ${HOSTCOST_TIMEOUT:-120} python3 benchmarks/host_cost_per_kernel.py --csv "$OUT/host-cost-per-kernel.csv" \
    >"$OUT/hostcost.log" 2>&1; tail -30 "$OUT/hostcost.log"; pack
fi
if has moe; then
  timeout ${MOE_TIMEOUT:-150} python3 benchmarks/bench_moe_kernels.py --csv "$OUT/moe-router.csv" \
    >"$OUT/moe.log" 2>&1; tail -30 "$OUT/moe.log"; pack
fi
if has compiled; then
  timeout ${COMPILED_TIMEOUT:-240} python3 benchmarks/compiled_attribution.py --out "$OUT/compiled" \
    >"$OUT/compiled.log" 2>&1; tail -40 "$OUT/compiled.log"; pack
fi
if has memfix; then
  # Issue 28: kprof's checkpointing pick against every layer on the 1B Llama; largest batch on GPT-2 small.
  timeout ${MEMFIX_TIMEOUT:-420} python3 benchmarks/bench_memory_fixes.py --out "$OUT/memfix" ${MEMFIX_ARGS:-} \
    >"$OUT/memfix.log" 2>&1; tail -30 "$OUT/memfix.log"; pack
fi
if has cudagraphs; then
  # Issue 19 item 3: the cuda_graphs patch on the small fp32 MLP (benchmarks/workloads/mlp_cuda_graphs.py):
  # the step time eager / kprof's patch / torch.compile (target >= 2x eager), then kprof's own path end
  # to end: profile, suggest (the launch_bound and cuda_graphs rows), apply --patch cuda_graphs.
  timeout ${CG_BENCH_TIMEOUT:-240} python3 benchmarks/bench_cuda_graphs.py --out "$OUT/cuda_graphs.csv" \
    >"$OUT/cudagraphs-bench.log" 2>&1; tail -6 "$OUT/cudagraphs-bench.log"
  timeout 120 kprof profile benchmarks/workloads/mlp_cuda_graphs.py --out "$OUT/cudagraphs/runs" \
    >"$OUT/cudagraphs-profile.log" 2>&1; tail -25 "$OUT/cudagraphs-profile.log"
  timeout 60 kprof suggest --out "$OUT/cudagraphs/runs" >"$OUT/cudagraphs-suggest.log" 2>&1; tail -30 "$OUT/cudagraphs-suggest.log"
  timeout ${CG_APPLY_TIMEOUT:-300} kprof apply benchmarks/workloads/mlp_cuda_graphs.py --patch cuda_graphs \
    --out "$OUT/cudagraphs/runs" --json >"$OUT/cudagraphs-apply.json" 2>"$OUT/cudagraphs-apply.err"; echo "apply exit $?"
  tail -5 "$OUT/cudagraphs-apply.err"; pack
fi
if has ncu; then
  timeout ${NCU_TIMEOUT:-300} python3 benchmarks/ncu_agreement.py --out "$OUT/ncu" ${NCU_ARGS:-} \
    >"$OUT/ncu.log" 2>&1; tail -40 "$OUT/ncu.log"; pack
fi
pack
ls -la "$OUT"
