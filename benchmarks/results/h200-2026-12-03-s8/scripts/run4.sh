export TRITON_INTERPRET=0 PYTHONPATH=.
mkdir -p $OUT/d128 $OUT/d64
timeout 80 python -m benchmarks.kernels --variants diff_attention --step --d 128 --h 16 --b 4 --n 4096 --out $OUT/d128 > $OUT/d128/kernels.txt 2>&1; echo "d128 rc $?"
timeout 80 python -m benchmarks.kernels --variants diff_attention --step --d 64 --h 32 --b 4 --n 4096 --out $OUT/d64 > $OUT/d64/kernels.txt 2>&1; echo "d64 rc $?"
grep -v Warn $OUT/d128/kernels.txt | tail -15 | cut -c1-160; grep -v Warn $OUT/d64/kernels.txt | tail -15 | cut -c1-160
timeout 60 python devrun/ind_prof.py 128 > $OUT/ind128.txt 2>&1; echo "ind128 rc $?"; grep -v Warn $OUT/ind128.txt | tail -12 | cut -c1-150
timeout 60 python devrun/ind_prof.py 64 > $OUT/ind64.txt 2>&1; echo "ind64 rc $?"; grep -v Warn $OUT/ind64.txt | tail -12 | cut -c1-150
