# The GPU benchmarks' models, sourced by scripts/gpu_check.sh and scripts/gpu_ab.sh:
#   gpu_model NAME   prints the path of model NAME under /tmp/models, writing it first if missing.
# NAME: smollm2 (the carried 8-layer SmolLM2 cut tiled back to 30 layers: SmolLM2-135M's shapes, types
# and bytes), smollm2cut (the cut itself), smollm2cut2 (its first 2 layers, for long streams), gemma3
# (a random Gemma 3 270M bf16 checkpoint), qwen3 (bench/synthetic_gguf.py's Qwen3-1.7B Q4_K_M).
# Run from the repository root.
gpu_model() {
    local cut=.dev/smollm2-135m-8layers.gguf m
    mkdir -p /tmp/models
    case $1 in
        smollm2) m=/tmp/models/smollm2-135m-tiled30.gguf
                 [ -f $m ] || python3 bench/truncated_gguf.py "$cut" 8 $m --tile 30 > /dev/null ;;
        smollm2cut) m=$PWD/$cut ;;
        smollm2cut2) m=/tmp/models/smollm2-135m-2layers.gguf
                     [ -f $m ] || python3 bench/truncated_gguf.py "$cut" 2 $m > /dev/null ;;
        gemma3) m=/tmp/models/gemma3-270m-random
                [ -d $m ] || python3 bench/random_hf_checkpoint.py gemma3-270m $m > /dev/null 2>&1 ;;
        qwen3) m=$(RINGLLM_BENCH_CACHE=/tmp/models python3 bench/synthetic_gguf.py qwen3-1.7b) ;;
        *) echo "unknown model $1" >&2; return 2 ;;
    esac
    echo "$m"
}
