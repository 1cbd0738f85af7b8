# session 9, run 2: the generated kernels with tensor-descriptor (TMA) loads, A/B against
# FLASHLIGHT_TMA=0 (pointer loads) in the same process, forward suite and training suite
set -o pipefail
export PYTHONUNBUFFERED=1
TRITON_INTERPRET=0 timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1; tail -3 $OUT/test_gpu.txt
timeout 260 python3 -m benchmarks.run --suite flex --quick --b-env FLASHLIGHT_TMA=0 --backends flashlight,flashlight_b,flex,sdpa_cudnn --no-plots --out $OUT/flex > $OUT/flex.txt 2>&1; tail -18 $OUT/flex.txt | cut -c1-200
timeout 240 python3 -m benchmarks.run --suite training --b-env FLASHLIGHT_TMA=0 --backends flashlight,flashlight_b,flex --no-plots --out $OUT/training > $OUT/training.txt 2>&1; tail -10 $OUT/training.txt | cut -c1-200
