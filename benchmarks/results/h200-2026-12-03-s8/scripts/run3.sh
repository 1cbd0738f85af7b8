export TRITON_INTERPRET=0 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 160 python -m benchmarks.run --suite training --out $OUT/training > $OUT/training.txt 2>&1; echo "training rc $?"
tail -9 $OUT/training.txt | cut -c1-150
timeout 330 python -m benchmarks.run --suite flex --backends flashlight,flex,flex_mask,sdpa_cudnn,sdpa_flash --time-limit 290 --out $OUT/flex > $OUT/flex.txt 2>&1; echo "flex rc $?"
tail -52 $OUT/flex.txt | cut -c1-150
