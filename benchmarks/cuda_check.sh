#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run: the engine's invariants on the device
# (tests/test_cuda.py), the quality report on the GPU's kernels (tokenmill eval), and offline
# throughput against Hugging Face on the same GPU (bench_engine --device cuda).
#
#     bash benchmarks/cuda_check.sh OUT_DIR
#
# Needs tokenmill's Python packages and the default model installed (make setup does both).
# Each step's log and JSON go to OUT_DIR; a failing step does not stop the later ones.
set -uo pipefail
out=${1:?usage: cuda_check.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
status=0
step() {  # step NAME SECONDS COMMAND...: run it under a time limit, its output teed to a log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -40
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)" | tee -a "$out/gpu.txt"
step tests 180 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py
step eval 120 python3 -m tokenmill.cli eval --device cuda --dtype bfloat16 \
    --configs int8,int4-g128,gguf,kv-int8 --output-json "$out/eval_cuda.json"
step bench 180 python3 benchmarks/bench_engine.py --device cuda --dtypes bfloat16 \
    --output-json "$out/bench_engine_cuda.json"
exit $status
