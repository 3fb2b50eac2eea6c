#!/usr/bin/env bash
# The GPU figures of BENCHMARKS.md "On a GPU" in one go: the GPU tests, the loop benchmarks in
# float32 (the seed MLP) and bfloat16 (ResNet-18 32x32, gpt_small, llama_tiny), and MFU of a
# ~1B Llama and a ~350M GPT. Run from the repository root on a machine whose python3 has
# jax with CUDA:   OUT=/tmp/gpu bash benchmarks/gpu.sh [all|tests|small|large]
# Wheels of missing packages (grain, omegaconf, tensorboardX, ...) may lie in .whl/.
# (-o addopts=-ra: the GPU tests run in one process, with or without pytest-xdist installed.)
set -u
OUT=${OUT:-/tmp/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
part=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax, flax, optax, orbax.checkpoint as o, grain; print('jax', jax.__version__, 'flax', flax.__version__,
'optax', optax.__version__, 'orbax', o.__version__, jax.devices())"
run() { echo "+ $*"; "$@"; }
case $part in
  tests|all)
    ENGINE_TEST_GPU=1 run python3 -m pytest -o addopts=-ra -q -s -p no:cacheprovider tests/integration/test_gpu.py tests/e2e/test_gpu_e2e.py 2>&1 | tee "$OUT/gpu_tests.log" ;;&
  small|all)
    JAX_PLATFORMS=cuda run python3 benchmarks/loop_overhead.py --models seed_mlp 2>&1 | tee "$OUT/seed_mlp.log"
    JAX_PLATFORMS=cuda run python3 benchmarks/loop_overhead.py --models resnet18 gpt_small llama_tiny --steps 200 \
      --warmup 20 train.compute_dtype=bfloat16 2>&1 | tee "$OUT/bf16.log" ;;&
  large|all)
    q="log.progress=false log.tensorboard=false"
    run python3 launch.py --config configs/llama_1b.yaml --workdir /tmp/llama_1b mesh.fsdp=1 \
      train.global_batch_size=8 train.steps=60 log.every_steps=10 train.steps_per_call=10 $q 2>&1 | tee "$OUT/llama_1b.log"
    run python3 launch.py --config configs/gpt_small.yaml --workdir /tmp/gpt_350m model.d_model=1024 \
      model.num_layers=24 model.num_heads=16 model.mlp_dim=4096 data.seq_len=1024 train.global_batch_size=16 \
      train.compute_dtype=bfloat16 model.remat=dots train.steps=200 log.every_steps=20 train.steps_per_call=10 $q \
      2>&1 | tee "$OUT/gpt_350m.log"
    for d in /tmp/llama_1b /tmp/gpt_350m; do grep '"split": "summary"' $d/metrics.jsonl > "$OUT/$(basename $d)_summary.json"; done ;;
esac
