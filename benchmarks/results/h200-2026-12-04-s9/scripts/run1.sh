# session 9, run 1: hand-written forward variants (deferred P @ V, TMA) against cuDNN
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv; PYTHONUNBUFFERED=1 python3 -m benchmarks.hand_forward 2>&1 | tee $OUT/hand_forward.log | grep -v "^("
