# session 10, run 2: the first generated Gluon forward (on wherever it applied): its GPU tests, then
# an A/B in one process against the Triton kernels (flashlight_b: FLASHLIGHT_GLUON=0)
export TRITON_INTERPRET=0 FLASHLIGHT_STRICT=1
timeout 300 python -m pytest -x -q tests/test_gpu.py -k gluon 2>&1 | tail -25
timeout 250 python -m benchmarks.run --suite flex --only vanilla,causal,document_mask,softcap --shapes 4x4096,1x16384 --b-env FLASHLIGHT_GLUON=0 --no-plots --time-limit 200
