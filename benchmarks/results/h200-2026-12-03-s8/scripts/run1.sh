export TRITON_INTERPRET=0 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 150 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1; echo "test_gpu rc $?"; tail -3 $OUT/test_gpu.txt
timeout 110 python -m benchmarks.backward_configs --variants causal,alibi --d 128 --out $OUT > $OUT/bc128.txt 2>&1; echo "bc128 rc $?"; grep -E "ms|csv" $OUT/bc128.txt | grep -v Warn | cut -c1-90
timeout 100 python -m benchmarks.backward_configs --variants causal,document_mask,sliding_window --d 64 --out $OUT > $OUT/bc64.txt 2>&1; echo "bc64 rc $?"; grep -E "ms|csv" $OUT/bc64.txt | grep -v Warn | cut -c1-90
timeout 190 python -m benchmarks.run --suite training --no-plots --out $OUT/training > $OUT/training.txt 2>&1; echo "training rc $?"; tail -30 $OUT/training.txt
