#!/usr/bin/env bash
# A/B of the CUDA library on one GPU: a baseline built from other CUDA sources against the working
# tree's library (built by `pip install -e .`, e.g. scripts/gpu_check.sh's build stage), alternated by
# swapping native/libringllm_cuda.so between runs of bench/gpu_speed.py (decode tg and prefill pp,
# no streams, no batches, no transformers). Results: bench/results/ab_{MODEL}_{new,base}_{ROUND}.*,
# logs and copies in /tmp/gpu_work.
#
#   git archive REF native | tar x -C .dev/base      # here: the baseline's sources (carry .dev)
#   bash scripts/gpu_ab.sh build                    # there: /tmp/base_lib/libringllm_cuda.so (sm_90 only)
#   bash scripts/gpu_ab.sh run                      # there, after the build of the working tree
#
# Env: BASE (default .dev/base/native), ROUNDS (default 1), AB_MODELS (default "qwen3 smollm2 gemma3":
# scripts/gpu_models.sh's names), TG, PP, REPEATS.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=/tmp/gpu_work; mkdir -p "$WORK" /tmp/models
BASE=${BASE:-.dev/base/native}
source scripts/gpu_models.sh
case ${1:-run} in
build)
    rm -rf /tmp/base_native && cp -r "$BASE" /tmp/base_native && rm -f /tmp/base_native/*.so
    t0=$(date +%s)
    RINGLLM_CUDA_ARCHS=90 python3 -c "import sys; sys.path.insert(0, '/tmp/base_native'); import build_cuda as b; b.compile_library(b.find_nvcc(), '/tmp/base_lib')" > "$WORK/base_build.log" 2>&1
    echo "baseline build rc=$? in $(( $(date +%s) - t0 )) s"
    ;;
run)
    cp native/libringllm_cuda.so /tmp/new_lib.so
    for r in $(seq "${ROUNDS:-1}"); do
      for spec in ${AB_MODELS:-qwen3 smollm2 gemma3}; do
        m=$(gpu_model "$spec") || continue
        for v in new base; do
            if [ $v = new ]; then cp /tmp/new_lib.so native/libringllm_cuda.so
            else cp /tmp/base_lib/libringllm_cuda.so native/libringllm_cuda.so; fi
            timeout 120 python3 bench/gpu_speed.py -m "$m" --tg "${TG:-128}" --pp "${PP:-512}" --repeats "${REPEATS:-2}" \
                --stream 0 --batch '' --hf-stream 0 --no-cpu --name "ab_${spec}_${v}_$r" > "$WORK/ab_${spec}_${v}_$r.log" 2>&1
            echo "ab $spec $v round $r rc=$?: $(grep -E '^\| (plain|graph) ' "$WORK/ab_${spec}_${v}_$r.log" | tr '\n' ' ')"
            cp bench/results/ab_${spec}_${v}_$r.* "$WORK/" 2>/dev/null
        done
      done
    done
    cp /tmp/new_lib.so native/libringllm_cuda.so
    ;;
*) echo "usage: bash scripts/gpu_ab.sh build|run"; exit 2 ;;
esac
