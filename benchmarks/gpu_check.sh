#!/usr/bin/env bash
# The prepared GPU check (issue #15, item 8): one script, under 8 minutes on one GPU.
#   bash benchmarks/gpu_check.sh            # from the repository root, in the project's venv
# 1. the CUDA tests (tests/gpu: NCCL parity matrix on 2+ GPUs, 3d on 4+, bf16 + compile on one, the context-parallel
#    attention forms on one and cp2 on 2+);
# 2. every strategy that fits the GPUs trains the ~125M GPT in bf16-mixed with compiled blocks,
#    beside plain Lightning on the same model: step time, tokens/s, peak memory (allocated and
#    reserved), MFU, ratios.
# Output goes to stdout and gpu_check/ (JSON), for docs/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p gpu_check
export OMP_NUM_THREADS=4 TORCH_NCCL_ASYNC_ERROR_HANDLING=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
python -c "import torch, lightning; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'lightning', lightning.__version__, 'gpus', torch.cuda.device_count())"
status=0
timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu --durations=10 | tee gpu_check/tests.txt || status=1
timeout 200 python benchmarks/bench_gpu.py --steps 20 --warmup 5 --batch 8 --json gpu_check/bench.json | tee gpu_check/bench.txt || status=1
exit $status
