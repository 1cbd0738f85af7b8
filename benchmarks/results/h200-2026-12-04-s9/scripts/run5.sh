# session 9, run 5: the final code (descriptor loads opt-in, off by default): GPU tests (with a
# FLASHLIGHT_TMA=1 group), the whole flex suite with cold caches (its own Triton / Inductor cache
# dirs: first calls compile cold for every system), then the training suite
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1; tail -2 $OUT/test_gpu.txt
timeout 330 python3 -m benchmarks.run --suite flex --backends flashlight,flex,flex_mask,sdpa_cudnn,sdpa_flash --time-limit 290 --out $OUT/flex > $OUT/flex.txt 2>&1; echo "flex rc $?"
tail -51 $OUT/flex.txt | cut -c1-150
timeout 200 python3 -m benchmarks.run --suite training --backends flashlight,flex,sdpa_cudnn,inductor --no-plots --out $OUT/training > $OUT/training.txt 2>&1; echo "training rc $?"
tail -9 $OUT/training.txt | cut -c1-150
rm -f $OUT/flex/summary.txt $OUT/training/summary.txt
