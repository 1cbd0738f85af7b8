# session 9, run 3 (run 3a failed: no PYTHONPATH): where the generated kernel's TMA slowdown is
PYTHONPATH=. PYTHONUNBUFFERED=1 timeout 400 python3 benchmarks/results/h200-2026-12-04-s9/scripts/tma_probe.py 2>&1 | grep -v Warning | tail -8
