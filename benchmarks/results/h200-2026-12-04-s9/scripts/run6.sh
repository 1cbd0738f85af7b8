# session 9, run 6: the document-mask forward, kernel and host time per call (run 5 read it slow)
export PYTHONPATH=. TRITON_INTERPRET=0; timeout 100 python3 -m benchmarks.kernels --variants document_mask --d 128 --flex --out $OUT 2>&1 | grep -v Warn | head -12; timeout 80 python3 -m benchmarks.kernels --variants document_mask --d 64 --b 16 --n 1024 --flex --out $OUT 2>&1 | grep "do_bench"
