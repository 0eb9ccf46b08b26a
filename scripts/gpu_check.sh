#!/usr/bin/env bash
# The GPU session's device check, in one call: build the CUDA backend with the machine's nvcc, run
# every `gpu` test, then the GPU benchmarks. Every log and result goes to $WORK, which is packed into
# $OUT/bundle.tgz after each stage (a stage killed by its timeout loses only itself).
#
#   bash scripts/gpu_check.sh [STAGE...]     STAGE: env build test ab profile bench sanitize
#                                            (default: env build test bench)
#
#   ab       scripts/gpu_ab.sh: the library built from .dev/base/native (carried; e.g. `git archive REF
#            native | tar x -C .dev/base` here) against the working tree's, AB_ROUNDS (2) rounds of
#            AB_MODELS (qwen3 smollm2)
#   profile  bench/gpu_token_profile.py under ncu: one decoded token's kernels, Qwen3-1.7B's and
#            SmolLM2's shapes, tables written to $WORK
#
# Expects (carried by the caller, ignored by git):
#   .whl/   wheels of the Python packages the device image lacks (gguf, cffi, pycparser; llguidance only
#           for constrained decoding, which no GPU test uses), installed
#           into /tmp/site with --no-index (the device has no network);
#   .dev/smollm2-135m-8layers.gguf   bench/truncated_gguf.py's cut of the bundled SmolLM2 (its first
#           8 of 30 layers: the whole file does not fit the 64 MiB transfer). The parity tests run
#           on it; the benchmarks run on its tiling back to 30 layers (SmolLM2-135M's shapes, types
#           and bytes), on a random Gemma 3 270M bf16 checkpoint and on bench/synthetic_gguf.py's
#           Qwen3-1.7B Q4_K_M, all written on the device.
# Env: TEST_ARGS extra pytest arguments; TEST_TIMEOUT, T_SMOLLM2, T_GEMMA3, T_QWEN3, SANITIZE_TIMEOUT
# seconds per stage (T_SMOLLM2CUT, T_SMOLLM2CUT2: BENCH_MODELS smollm2cut and smollm2cut2, the 8-layer cut
# itself and its first 2 layers, for long streams); BENCH_MODELS (default "smollm2 gemma3 qwen3");
# TG, PP decode tokens and prompt lengths of the tg/pp figures; STREAM, HF_STREAM tokens per long
# stream (ringllm, transformers); CAPACITIES, POLICIES of the long streams (STREAM_CONCURRENT=1: all
# at once, one thread and engine each); BATCH sizes of the batched decode runs ("" skips them);
# REPEATS of each pp/tg figure.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
WORK=/tmp/gpu_work
mkdir -p "$OUT" "$WORK" /tmp/models
export PYTHONUNBUFFERED=1 NUMBA_CACHE_DIR=/tmp/numba_cache
STAGES=${*:-env build test bench}

source scripts/gpu_models.sh
SMOL=$(gpu_model smollm2cut)
stage() { echo "=== $1 $(date +%T)"; }
has() { [[ " $STAGES " == *" $1 "* ]]; }
bundle() { tar czf "$OUT/bundle.tgz" -C "$WORK" . ; }

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if has env; then
    stage env
    { nvidia-smi; nvcc --version; lscpu | head -20
      python3 -c "import sys, numpy, numba, torch, transformers, cffi; print(sys.version); print('numpy', numpy.__version__, 'numba', numba.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'cffi', cffi.__version__)"
    } > "$WORK/env.txt" 2>&1
    grep -E "Driver|H100|H200|release|Model name|numpy" "$WORK/env.txt"
    bundle
fi

if has build; then
    stage build
    t0=$(date +%s)
    python3 -m pip install --no-deps --no-build-isolation -v -e . > "$WORK/build.log" 2>&1
    echo "pip install rc=$? in $(( $(date +%s) - t0 )) s"; grep "ringllm:" "$WORK/build.log"
    python3 -c "import ringllm.native as n; print(n.build_info(), '| devices:', n.device_count())" 2>&1 | tee -a "$WORK/env.txt"
    bundle
fi

if has test; then
    stage test
    RINGLLM_TEST_SMOLLM2=$SMOL NUMBA_NUM_THREADS=2 timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -p no:cacheprovider -n 12 \
        --timeout 240 -m gpu -rfE --junitxml "$WORK/junit.xml" ${TEST_ARGS:-} \
        tests/test_native.py tests/test_native_kv_types.py > "$WORK/pytest.log" 2>&1
    echo "pytest rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed" "$WORK/pytest.log" | tail -60
    bundle
fi

if has ab; then
    stage ab
    if [ -d .dev/base/native ]; then
        bash scripts/gpu_ab.sh build
        ROUNDS=${AB_ROUNDS:-2} AB_MODELS=${AB_MODELS:-qwen3 smollm2} timeout "${AB_TIMEOUT:-300}" bash scripts/gpu_ab.sh run
    else
        echo "no .dev/base/native: nothing to compare against"
    fi
    bundle
fi

if has profile; then
    stage profile
    for spec in qwen3 smollm2; do
        m=$(gpu_model $spec)
        timeout 90 ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
            python3 bench/gpu_token_profile.py step "$m" > "$WORK/token_profile_$spec.csv" 2> "$WORK/token_profile_$spec.err"
        echo "ncu $spec rc=$?"
        python3 bench/gpu_token_profile.py table "$WORK/token_profile_$spec.csv" --name "token_profile_$spec" | head -14
        cp "bench/results/token_profile_$spec.md" "$WORK/" 2>/dev/null
    done
    bundle
fi

bench_one() {   # name, model path, seconds, transformers stream tokens
    timeout "$3" python3 bench/gpu_speed.py -m "$2" --tg "${TG:-128}" --pp "${PP:-512,4096}" --repeats "${REPEATS:-3}" \
        --stream "${STREAM:-10000}" --capacities "${CAPACITIES:-512,4096}" --hf-stream "$4" --no-cpu \
        ${POLICIES:+--policies "$POLICIES"} ${STREAM_CONCURRENT:+--stream-concurrent} \
        --batch "${BATCH-1,2,4,8,16,32,64}" \
        --name "gpu_speed_$1" > "$WORK/bench_$1.log" 2>&1
    echo "bench $1 rc=$?"; grep -v "^\[\|^stream " "$WORK/bench_$1.log" | tail -30
    cp bench/results/gpu_speed_"$1".* "$WORK/" 2>/dev/null
    bundle
}

if has bench; then
    stage bench
    for name in ${BENCH_MODELS:-smollm2 gemma3 qwen3}; do
        m=$(gpu_model "$name") || continue
        case $name in
            smollm2) bench_one smollm2 "$m" "${T_SMOLLM2:-200}" "${HF_STREAM:-1000}" ;;
            gemma3) bench_one gemma3 "$m" "${T_GEMMA3:-200}" "${HF_STREAM:-1000}" ;;
            # the 8-layer cut itself: long streams at a quarter of the launches per token
            smollm2cut) bench_one smollm2cut "$m" "${T_SMOLLM2CUT:-200}" "${HF_STREAM:-0}" ;;
            # its first 2 layers: the long streams per policy at a fifteenth of the full model's launches
            smollm2cut2) bench_one smollm2cut2 "$m" "${T_SMOLLM2CUT2:-200}" "${HF_STREAM:-0}" ;;
            # transformers would dequantize the 1.7B Q4_K_M file in NumPy first: ringllm alone
            qwen3) bench_one qwen3 "$m" "${T_QWEN3:-200}" 0 ;;
        esac
    done
fi

if has sanitize; then
    stage sanitize
    RINGLLM_TEST_SMOLLM2=$SMOL timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool memcheck --print-limit 20 \
        python3 -m pytest -p no:cacheprovider -q -m gpu -x tests/test_native.py -k "dequant or matmul or attention or pick or norms" \
        > "$WORK/sanitize.log" 2>&1
    tail -30 "$WORK/sanitize.log"
    bundle
fi
stage done
