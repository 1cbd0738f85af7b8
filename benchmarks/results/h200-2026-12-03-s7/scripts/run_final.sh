export TRITON_INTERPRET=0 PYTHONPATH=.
timeout 110 python devrun/check4096.py > $OUT/check4096.txt 2>&1; grep -v Warn $OUT/check4096.txt | tail -6
mkdir -p $OUT/new $OUT/old
timeout 100 python -m benchmarks.backward --d 64 --variants causal,alibi,document_mask,sliding_window --out $OUT/new > $OUT/new/bwd64.txt 2>&1; tail -6 $OUT/new/bwd64.txt
(cd devrun/old && timeout 100 python -m benchmarks.backward --d 64 --variants causal,alibi,document_mask,sliding_window --out $OUT/old > $OUT/old/bwd64.txt 2>&1; tail -6 $OUT/old/bwd64.txt)
