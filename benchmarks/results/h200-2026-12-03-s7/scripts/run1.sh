set -x
export TRITON_INTERPRET=0
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -5
python -m benchmarks.kernels --variants document_mask,sliding_window,vanilla --b 16 --n 1024 --d 64 --flex --profile --out $OUT 2>&1 | tail -120
python -m benchmarks.kernels --variants document_mask,sliding_window --step --flex --profile --d 64 --out $OUT 2>&1 | tail -100
