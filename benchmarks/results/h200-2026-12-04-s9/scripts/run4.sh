# session 9, run 4: the generated causal D=128 forward with deferred P @ V (hand-edited source)
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 300 python3 benchmarks/results/h200-2026-12-04-s9/scripts/defer_probe.py 2>&1 | grep -v Warning | tail -6
