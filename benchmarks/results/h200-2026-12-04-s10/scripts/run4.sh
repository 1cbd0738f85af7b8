# session 10, run 4: the final selection rule (gluon_pays with the band and length thresholds), the
# D=128 half of the flex suite (the only half the rule changes), with the in-process A/B
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=.
timeout 230 python3 -m benchmarks.run --suite flex --dims 128 --b-env FLASHLIGHT_GLUON=0 --backends flashlight,flashlight_b,flex,sdpa_cudnn --time-limit 200 --out $OUT/flex128 > $OUT/flex128.txt 2>&1; echo "flex rc $?"
tail -27 $OUT/flex128.txt | cut -c1-160
rm -f $OUT/flex128/summary.txt
