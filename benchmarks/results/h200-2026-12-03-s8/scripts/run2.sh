export TRITON_INTERPRET=0 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 100 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1; echo "test_gpu rc $?"; tail -1 $OUT/test_gpu.txt
BC="python -m benchmarks.backward_configs"
mkdir -p $OUT/diff128 $OUT/diff64 $OUT/d128
timeout 75 $BC --variants diff_attention --d 128 --b 2 --kernels dkdv --configs 32x64w4s3,32x64w8s3,32x32w4s3,64x64w8s3,16x64w4s3 --out $OUT/diff128 > $OUT/diff128/dkdv.txt 2>&1; echo "diff128 dkdv rc $?"
timeout 60 $BC --variants diff_attention --d 128 --b 2 --kernels rows,dq --configs 64x16w8s1,64x16w4s1,32x16w8s1,128x64w8s3,64x64w4s3,128x32w4s3,64x32w4s2 --out $OUT/diff128 > $OUT/diff128/dq.txt 2>&1; echo "diff128 rows/dq rc $?"
timeout 55 $BC --variants diff_attention --d 64 --b 2 --kernels dkdv --configs 64x64w4s3,32x64w4s3,64x64w8s3,32x64w8s3,32x32w4s3 --out $OUT/diff64 > $OUT/diff64/dkdv.txt 2>&1; echo "diff64 rc $?"
timeout 70 $BC --variants causal,alibi --d 128 --kernels dkdv --configs 32x64w4s3,32x64w8s3,32x32w4s3 --out $OUT/d128 > $OUT/d128/dkdv.txt 2>&1; echo "d128 rc $?"
cat $OUT/diff128/*.txt $OUT/diff64/*.txt $OUT/d128/*.txt | grep -E " ms " | cut -c1-80
mkdir -p $OUT/new $OUT/old
timeout 60 python -m benchmarks.run --suite training --only diff_attention --backends flashlight,inductor --no-plots --out $OUT/new > $OUT/new/train.txt 2>&1; echo "new rc $?"
(cd devrun/old && timeout 60 python -m benchmarks.run --suite training --only diff_attention --backends flashlight,inductor --no-plots --out $OUT/old > $OUT/old/train.txt 2>&1; echo "old rc $?")
tail -4 $OUT/new/train.txt; tail -4 $OUT/old/train.txt
