# session 11, run 1: the Gluon GPU tests (the forward compiling in the background), the
# hand-written Gluon dK/dV kernel's first GPU run (correctness against float64, time next to the
# generated dK/dV kernel), and the D=128 half of the flex suite with cold caches (first calls with
# the Gluon forward compiling in the background while the Triton kernel serves)
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=.
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k gluon > $OUT/test_gpu.txt 2>&1; tail -4 $OUT/test_gpu.txt | cut -c1-300
timeout 120 python3 -m benchmarks.gluon_backward > $OUT/gluon_backward.txt 2>&1; echo "gluon_backward rc $?"
tail -6 $OUT/gluon_backward.txt | cut -c1-400
timeout 230 python3 -m benchmarks.run --suite flex --dims 128 --backends flashlight,flex,sdpa_cudnn --time-limit 200 --out $OUT/flex128 > $OUT/flex128.txt 2>&1; echo "flex rc $?"
tail -27 $OUT/flex128.txt | cut -c1-170
rm -f $OUT/flex128/summary.txt
