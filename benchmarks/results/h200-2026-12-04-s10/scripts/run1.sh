# session 10, run 1: the hand-written Gluon forward (benchmarks/gluon_forward.py with
# run1_gluon_forward.diff applied: its BLOCK_N=64 causal mask was wrong in this version, fixed since)
timeout 120 python -m benchmarks.gluon_forward --shapes 1x1024x128 --configs 128s2
timeout 420 python -m benchmarks.gluon_forward
