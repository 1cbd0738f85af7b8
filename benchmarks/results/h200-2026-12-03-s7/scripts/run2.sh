export TRITON_INTERPRET=0
timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1; tail -3 $OUT/test_gpu.txt
mkdir -p $OUT/tune128 $OUT/tune64
timeout 330 python -m benchmarks.backward --tune --d 128 --variants causal,alibi --out $OUT/tune128 > $OUT/tune128.txt 2>&1; tail -4 $OUT/tune128.txt
timeout 150 python -m benchmarks.backward --tune --d 64 --variants causal --out $OUT/tune64 > $OUT/tune64.txt 2>&1; tail -3 $OUT/tune64.txt
