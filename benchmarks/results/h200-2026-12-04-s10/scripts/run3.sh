# session 10, run 3: the final code (Gluon forward on by default where gluon_pays says so), with an
# in-process A/B against the Triton kernels (flashlight_b: FLASHLIGHT_GLUON=0): the whole flex suite
# with cold caches, the training suite, then the Gluon GPU tests
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 300 python3 -m benchmarks.run --suite flex --b-env FLASHLIGHT_GLUON=0 --backends flashlight,flashlight_b,flex,sdpa_cudnn,sdpa_flash --time-limit 275 --out $OUT/flex > $OUT/flex.txt 2>&1; echo "flex rc $?"
tail -51 $OUT/flex.txt | cut -c1-160
timeout 160 python3 -m benchmarks.run --suite training --b-env FLASHLIGHT_GLUON=0 --backends flashlight,flashlight_b,flex,inductor --no-plots --time-limit 120 --out $OUT/training > $OUT/training.txt 2>&1; echo "training rc $?"
tail -9 $OUT/training.txt | cut -c1-160
timeout 110 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k gluon > $OUT/test_gpu.txt 2>&1; tail -2 $OUT/test_gpu.txt
rm -f $OUT/flex/summary.txt $OUT/training/summary.txt
