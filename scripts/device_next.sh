# Session 36's plan (session 35: docs/notes.md "Session 35"; an H200 ran F, TR and the document rows again):
#   #5 is met on the H200; #6 misses on two host-bound document rows (16x1024 D=128, 4x4096 D=64) and
#   cuDNN at D=64 N=16384 (0.89). Leave kind out; first HOST (below, ~3 min, any GPU): where the document
#   mask's call spends its host time, and its rows under CUDA graphs. Then, after a host-path change, F.
# Session 35's plan (session 34: docs/notes.md "Session 34"; three H100 calls ran T33B and the GPU tests in
#   full, four tries got no machine, one of them asking only for the H200): leave kind out; if an H200 comes:
#   F (#6), then LIMIT=250 TR (#5). A failed start cost 90-180 s of device time in session 34 (a started
#   machine ~30 s beyond its command). On an H100 nothing is pending from session 34 (T33B ran).
# Session 34's plan (session 33: docs/notes.md "Session 33"; three H100 calls, no H200): leave kind out; if an H200
#   comes: F (#6), then LIMIT=250 TR (#5). On an H100: T33B (the decode suite's top-k row against Inductor, the
#   beyond rows after the inserting merge).
# Session 33's plan (session 32: docs/notes.md "Session 32": S32 ran on an H100, then the GPU tests in full (76
#   passed), TR, F twice, the top-k GPU test and beyond rows). Leave kind out; if an H200 comes: F (#6), then
#   LIMIT=250 TR (#5). On an H100: T33 (top-k's merge: the GPU test and the beyond row, k = 16 and 64).
# Session 32's plan (session 31: docs/notes.md "Session 31"): leave kind out. First
#   run(command="bash scripts/device_next.sh S32") (~6 min): the GPU tests of the scans and of session 31's
#   sums kernel, benchmarks.chained and benchmarks.scans against Inductor. Then on an H200: F (#6), then
#   LIMIT=250 TR (#5); S31 (carry .s30) for the scans' reference-VJP side.
# Session 31's plan (session 30: docs/notes.md "Session 30"; no call got a machine): leave kind out. First
#   run(command="bash scripts/device_next.sh S31", carry=[".s30"]) (~7 min; prepare .s30 with
#   git archive 39e9916 | (mkdir -p .s30 && tar -x -C .s30)): the scans' GPU tests through the generated
#   backward, benchmarks.scans (training, and a split-KV decode row) here and at 39e9916 (reference VJP).
#   Nothing of the scans has run on a GPU. Then F on an H200 (#6), TR with LIMIT=250 (#5); on an H100:
#   S28 (carry .s28), OLD=1 S29 (carry .s29).
# Session 30's plan (session 29: docs/notes.md "Session 29"; no call got a machine): leave kind out.
#   First S30 (~4 min: the scans' GPU tests, benchmarks.scans: stick-breaking against Inductor; nothing
#   of the scans has run on a GPU yet, the kernel only compiled offline for sm_90). If an H200 comes
#   after that: F (the flex suite, #6), then TR with LIMIT=250 (#5). On an H100: S28 (carry .s28), then
#   OLD=1 S29 (carry .s29).
# Session 29's plan (session 28: docs/notes.md "Session 28"; 3 of 14 calls ran, one H100: G 64 passed,
#   S29 without its old side): leave kind out. If an H200 comes: F (the flex suite, #6), then TR with
#   LIMIT=250 (#5). On an H100: S28 (carry .s28 = git archive e058c67: IPA D=128, joined D=128, fit_rows),
#   then OLD=1 S29 (carry .s29 = git archive f0684f6: benchmarks.shifts' old side, the reference VJP).
# Session 28 ran S29 (the explain bug failed 6 GPU tests), the 7 again (passed), then G (64 passed).
# Session 28's plan (session 27: docs/notes.md "Session 27"; three calls ran, all H100s; 54 GPU tests
#   passed in full): leave kind out. If an H200 comes: F (the flex suite, issue #6's table on the H200),
#   then TR with LIMIT=250 (issue #5's table). On an H100: S28 below (IPA at D=128 under the new
#   many-loads backward default, against --tune; benchmarks.joined at D=128, and at D=64 against
#   e058c67 for fit_rows, the 16-row backward tiles of the absorbed MLA: prepare .s28 with
#   git archive e058c67 | (mkdir -p .s28 && tar -x -C .s28), carry it), then G (the GPU tests in full).
# Session 27 ran S27A (an H100; its GPU tests and IPA --tune timed out, run again in a second call), then S27B.
# Session 27's plan (session 26: docs/notes.md "Session 26"; three calls ran, all H100s, six tries got no
#   machine): leave kind out (H100 or H200, whichever comes). First the GPU tests in full (part G; session
#   26 ran only the bf16-gradient, fused-dQ and group-loop ones), then C26 again for IPA's dK/dV config
#   (benchmarks.backward --tune on ipa: the default 64x64 spills 4.4 KB offline, 32x64 0.9 KB) and
#   post_softmax's unexplained forward (0.32 against 0.08 ms, same code), then TR and F if time is left.
# Session 26's plan (session 25: docs/notes.md "Session 25"; its R2 timed out, R3 never ran): prepare .s25
#   (see R3), then run(command="bash scripts/device_next.sh R3", carry=[".s25"]) (~2 min: T5's table
#   gradient, uniform tiles against per-score adds), then R2 (now per variant at N=1024; carry .s24
#   too, or drop its .s24 half), then F and TR (TR now has SDPA's columns), then the GPU tests in full.
# Session 25 ran F, TR, the GPU tests (50 passed, 1 failed: the misaligned-view test, fixed), R1, R2.
# Session 25's plan (session 24 ran eight calls, all on H100s; docs/notes.md "Session 24"): ask for the
#   H200 (kind="nvidia-h200"); whatever comes, run F (the flex suite, ~220 s; the first-call misses at
#   1x16384 D=128 should be gone: the quick start per scan bucket), then TR with LIMIT=250 (now with the
#   gqa_4 row), then the GPU tests in full (TRITON_INTERPRET=0 PYTHONPATH=. pytest tests/test_gpu.py,
#   ~340 s: the group loop's tests are in it). Leads: DiffAttn's two-score-tile dK/dV (0.90-0.92x
#   Inductor), the Gluon kernels' SCAN_BLOCKS per length.
# Session 24's plan (session 23 ran nine calls, all on H100s; docs/notes.md "Session 23"): the H200
#   has not come since session 19, and issues #5 and #6 ask for their tables on it. Ask for it
#   (kind="nvidia-h200"); whatever comes, run F (the flex suite, ~160 s on an H100), then TR with
#   LIMIT=250 (the training table), then the GPU tests in full (TRITON_INTERPRET=0 exported: the
#   script does it; a bare pytest call skipped everything in session 23). If GQA's dK/dV group loop
#   is built (the lead in "Session 23"), A/B it with benchmarks.kernels --variants gqa,vanilla
#   --d 128 --step against the atomics.
# Session 23's plan (session 22 ran V1 on an H100; V2 was taken back mid-run; docs/notes.md "Session 22"):
#   on an H200, R1 (the GPU tests in full: session 22's GT stopped at 220 s inside the Gluon forward's
#   gated case), then V2 (~9 min: the A/Bs against 85e2075, DiffAttn's two spellings, flex D=128), then
#   X (the document step's host time), then TR with LIMIT=300 (the training table on the H200, RoPE +
#   GQA's reference fixed). Prepare .s19 first: git archive 85e2075 | (mkdir -p .s19 && tar -x -C .s19)
# Session 22 (itself without a machine for its first tries): V1 (~9 min: the GPU tests the changes reach,
#   the training table), then V2 (~9 min: the A/Bs against 85e2075, DiffAttn's two spellings, flex D=128).
# Session 22's plan: session 21 got no machine (eight failed starts; docs/notes.md "Session 21"). With the
#   full budget: R1, then R2 (below); with less: U1 (the GPU tests the changes reach, the training table),
#   then U2 (ALiBi and DiffAttn against 85e2075, .s19 carried); U0 and Z are smaller cuts.
# Session 21's plan (session 20 had no device; docs/notes.md "Session 20"): R1 (~8 min: GPU tests,
#   ALiBi's forward against .s19 = 85e2075), R2 (~8 min: the training table, ALiBi's training rows at
#   85e2075, the K/V-leaf A/B on RoPE and RoPE + GQA), then F (the flex suite) if time is left.
#   Prepare the old tree first: git archive 85e2075 | (mkdir -p .s19 && tar -x -C .s19)
#   run(command="bash scripts/device_next.sh R1", carry=[".s19"])
# Session 20's plan (written in session 19; docs/notes.md "Session 19"). Session 19 ran N1-N5, three
# of them on H100s: the H200 numbers of this code are still to take.
#   P1 (~8 min): the GPU tests in full (the new Gluon-forward guard; RoPE is now a variant), then
#     issue #5's training table on the H200 (the row kernel's 32 rows; RoPE with K and V loaded as
#     leaves against FLASHLIGHT_KV_LEAVES=0, now an A/B that recaptures: measure.own_code).
#   P2 (~9.5 min): the whole flex suite in one run (part F), for #6's table at this code.
# Session 19's plan (written in session 18, after its GPU run; docs/notes.md "Session 18"):
#   N1 (~7.5 min): the GPU tests (the autocast test now reads the narrowed q, k, v; four fused-dQ
#     cases), then issue #5's training table with the dK/dV kernel adding dQ by fp32 atomics
#     (FLASHLIGHT_ATOMIC_DQ=1, flashlight_b) against the two-kernel default, same call: the lead
#     for ALiBi and the document mask at D=128 (1.09x / 1.08x Flex, target 1.1) and DiffAttn
#     (0.86x / 0.91x Inductor).
#   N2 (~3.5 min, chained at once): every dK/dV config of the fused kernel at D=128 (offline
#     sm_90 compiles spill 36-268 bytes) and the rows kernel's configs, against float64.
# The plan before it (written in sessions 15 and 16, which had no device). One part per `run`
# call, from the repository root: `bash scripts/device_next.sh S1` (the machine stays warm 30 s
# after a call: chain the next call at once).
#   S1 (~9 min): the GPU tests in full (the Gluon kernels now launch through FastLaunch with their
#     descriptors, never run on a GPU yet; test_gpu covers the forward, dK/dV and dQ, and, new in
#     session 16, CUDA graph replay under mode="reduce-overhead"), then part 3 (the document step,
#     this code against session 10's: carry .s10, see below).
#   S2 (~9 min): the sparsity suite (the new document_12_sdpa case: SDPA-spelled document mask,
#     fused, against torch.compile's SDPA call and Flex) and the cold first calls of session 14's
#     four misses with the new phase columns (timers, not cProfile), Flex beside them.
#   S3 (~9 min): issue #5's training table again, then the D=64 flex suite (cuDNN at 16384).
#   S4 (~6 min, session 16): Flashlight and Flex both under mode="reduce-overhead" (--cuda-graphs:
#     CUDA graph replay, no host path) on the host-bound cases: the flex suite at 16x1024 (the
#     document mask's 0.77x) and the training steps of causal and the document mask.
# Part 3 needs session 10's tree carried:
#   git archive ffd254c | (mkdir -p .s10 && tar -x -C .s10); echo /.s10/ >> .git/info/exclude
#   run(command="bash scripts/device_next.sh S1", carry=[".s10"])
# Older plans (parts 1-3 of session 14, A-D of session 12) follow.
# Session 14 wrote: part 3 first (~6 min): why the document mask's training step took 1.19 ms in
# session 14 against 0.56 in session 10 (docs/notes.md, "Session 14"). It profiles this code and
# session 10's (ffd254c) in one call; prepare the old tree here first, then carry it:
#   git archive ffd254c | (mkdir -p .s10 && tar -x -C .s10); echo /.s10/ >> .git/info/exclude
#   run(command="bash scripts/device_next.sh 3", carry=[".s10"])
# Then part D (the prefetch's and prebuild's A/Bs) and the Gluon tile kernels' per-kernel split
# (part A's last loop). Session 14 ran parts 1 and 2 (one `run` each; the machine stays warm 30 s
# after a call, so the second followed at once). Parts A-C are session 12's plan.
# The next device calls (planned in session 12, CPU only; see docs/notes.md "Session 12"). Session 13
# (CPU only again) checked the Gluon tile kernels' numerics and barrier protocol in an emulator
# (tests/test_gluon_emulated.py: all pass), so part A's smoke run is expected to pass; what only the
# GPU can say is layouts, registers, races the emulator does not hit, and speed.
# Run one part per `run` call, from the repository root: `bash scripts/device_next.sh A`.
#   A (~8 min): the Gluon tile kernels' first GPU run, one kernel at a time (a wrong barrier
#     phase hangs: the timeouts bound it), the GPU tests, and where the backward's time goes
#     with the Gluon dK/dV and dQ kernels on and off (torch.profiler, per kernel).
#   B (~9 min): the training suite with both Gluon tile kernels wherever they apply ("all": D=64
#     and the document mask too, where the forward keeps Triton's kernel) against neither (issue
#     #5's table: Flex and Inductor in the same run), and the cold first call against Flex and
#     against the same without the quick start (issue #6). Then choose the tile kernels'
#     default rule from the A/B.
#   C (~6 min): the D=128 half of the flex suite with cold caches, as session 11's run 1 (first
#     calls against Flex; steady state; cuDNN on full attention).
#   D (~5 min, if the budget allows): the launcher prebuild's A/B on cold first calls, and the
#     training step's cold first call against Flex and against FLASHLIGHT_PREFETCH=0 (the
#     backward's compiles started at the first forward).
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=.
nogrep() { grep -v "DEBUG" || true; }
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
case "$1" in
HOST)  # session 36: the document mask's host path at the short shapes (cProfile, per-layer host time), and the
    # document and full rows under --cuda-graphs (Flex's and our replay: no host path)
  timeout -k 10 150 python3 -m benchmarks.overhead --variants document_mask,causal --b 16 --n 1024 --d 128 --profile \
    > $OUT/overhead.txt 2>&1
  echo "overhead rc $?"; grep -v DEBUG $OUT/overhead.txt | head -80 | cut -c1-160
  timeout -k 10 200 python3 -m benchmarks.run --suite flex --only document_12,full --backends flashlight,flex,sdpa_cudnn \
    --cuda-graphs --no-plots --time-limit 180 --out $OUT/cg > $OUT/cg.txt 2>&1
  echo "cg rc $?"; tail -14 $OUT/cg.txt | cut -c1-175
  ;;
H35)  # session 35's first call: on an H200 the flex suite (F, #6); on an H100 where DiffAttn's training step
    # spends its time against Inductor's, per kernel (the lead: 0.94-0.98x Inductor), D=64 and 128
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash "$0" F; exit; fi
  for d in 64 128; do
    timeout -k 10 200 python3 -m benchmarks.kernels --variants diff_attention,causal --step --inductor --d $d \
      > $OUT/diff_kernels_d$d.txt 2>&1
    echo "kernels d=$d rc $?"; grep -v DEBUG $OUT/diff_kernels_d$d.txt | head -60 | cut -c1-150
  done
  ;;
T33B)  # session 33 (~6 min): top-k's inserting merge and its split-KV decoding: the GPU tests (top-k, the
    # two-pass decodes with decode_top_k), the beyond rows again (top_k, threshold against Inductor), the decode
    # suite's top-k and causal rows, then split against one program per row (scripts/split_ab.py top_k)
  timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "top_k or two_pass_programs" \
    > $OUT/test_gpu_t33b.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/test_gpu_t33b.txt | cut -c1-250 | head -8
  timeout -k 5 150 python3 -m benchmarks.run --suite beyond --only top_k,threshold --backends flashlight,inductor \
    --no-plots --out $OUT/topk > $OUT/topk.txt 2>&1
  echo "topk rc $?"; grep -v "^W\|Warning" $OUT/topk.txt | cut -c1-170 | tail -5
  timeout -k 5 150 python3 -m benchmarks.run --suite decode --only decode_top_k,decode_causal \
    --backends flashlight,inductor,eager --out $OUT/decode --no-plots > $OUT/decode.txt 2>&1
  echo "decode rc $?"; grep -v "^W\|Warning" $OUT/decode.txt | cut -c1-200 | tail -5
  timeout -k 5 100 python3 scripts/split_ab.py top_k causal 2>&1 | grep -v "^W\|Warning" | tail -5
  ;;
T33)  # session 32's top-k attention (~2 min): its GPU test (ranks 16 and 100), then the beyond suite's top_k row
    # (the example: k = 16, causal) against Inductor at D = 64 and 128, beside threshold (a 2-pass program
    # without the merge) for scale
  timeout -k 10 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "top_k" > $OUT/test_gpu_t33.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/test_gpu_t33.txt | cut -c1-250 | head -6
  timeout -k 5 120 python3 -m benchmarks.run --suite beyond --only top_k,threshold --backends flashlight,inductor \
    --no-plots --out $OUT/topk > $OUT/topk.txt 2>&1
  echo "topk rc $?"; grep -v "^W\|Warning" $OUT/topk.txt | cut -c1-170 | tail -5
  ;;
S32)  # session 31 (~6 min, no carry): the GPU tests of the scans (session 30's backward) and of the sums a later
    # pass reads (session 31's sums kernel), then benchmarks.chained (threshold, sqrt weights, causal for scale)
    # and benchmarks.scans, each against Inductor; the scans' old side (S31, .s30) if time is left
    # (session 32 added: the multi-pass split-KV decode's GPU test, the decode suite's threshold and softpick rows)
  timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "scans or sums_read or two_pass_programs" \
    > $OUT/test_gpu_s32.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/test_gpu_s32.txt | cut -c1-250 | head -12
  OUT=$OUT/chained timeout -k 5 150 python3 -m benchmarks.chained > $OUT/chained.txt 2>&1
  echo "chained rc $?"; grep -v "^W\|Warning" $OUT/chained.txt | cut -c1-250 | tail -4
  OUT=$OUT/scans timeout -k 5 120 python3 -m benchmarks.scans > $OUT/scans.txt 2>&1
  echo "scans rc $?"; grep -v "^W\|Warning" $OUT/scans.txt | cut -c1-250 | tail -3
  timeout -k 5 120 python3 -m benchmarks.run --suite decode --only decode_threshold,decode_softpick,decode_causal \
    --backends flashlight,inductor,eager --out $OUT/decode --no-plots > $OUT/decode.txt 2>&1
  echo "decode rc $?"; grep -v "^W\|Warning" $OUT/decode.txt | cut -c1-200 | tail -7
  ;;
S31)  # session 30 (~7 min; carry .s30 = git archive 39e9916, the reference VJP's side): the scans' GPU tests (the
    # generated backward: one dQ kernel walking the keys twice, dK and dV atomic; 2048-key rows against eager
    # bf16's own error), then benchmarks.scans here and at 39e9916 (same forward, the step through the reference VJP)
  timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "scans" > $OUT/test_gpu_s31.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/test_gpu_s31.txt | cut -c1-250 | head -12
  OUT=$OUT/scans timeout -k 5 120 python3 -m benchmarks.scans > $OUT/scans.txt 2>&1
  echo "scans rc $?"; grep -v "^W\|Warning" $OUT/scans.txt | cut -c1-250 | tail -3
  OUT=$OUT/scans_old timeout -k 5 120 python3 scripts/with_tree.py .s30 benchmarks.scans > $OUT/scans_old.txt 2>&1
  echo "scans at 39e9916 rc $?"; grep -v "^W\|Warning" $OUT/scans_old.txt | cut -c1-250 | tail -3
  OUT=$OUT/scans4k timeout -k 5 100 python3 -m benchmarks.scans --b 2 --n 4096 > $OUT/scans4k.txt 2>&1
  echo "scans 4k rc $?"; grep -v "^W\|Warning" $OUT/scans4k.txt | cut -c1-250 | tail -3
  ;;
S30)  # session 29 (~4 min; then S28 in the same call if time is left): stick-breaking's scans over the keys
    # (Reduction.scan: tl.cumsum per key block, the blocks walked last to first) in bf16 against
    # float64, then benchmarks.scans (forward one kernel, the step through the reference VJP) against Inductor
  timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "scans_bf16 or shifts_bf16" \
    > $OUT/test_gpu_s30.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed|Error" $OUT/test_gpu_s30.txt | cut -c1-250 | head -12
  OUT=$OUT/scans timeout -k 5 150 python3 -m benchmarks.scans > $OUT/scans.txt 2>&1
  echo "scans rc $?"; grep -v "^W\|Warning" $OUT/scans.txt | cut -c1-250 | tail -3
  OUT=$OUT/scans4k timeout -k 5 120 python3 -m benchmarks.scans --b 2 --n 4096 > $OUT/scans4k.txt 2>&1
  echo "scans 4k rc $?"; grep -v "^W\|Warning" $OUT/scans4k.txt | cut -c1-250 | tail -3
  [ -n "$THEN" ] && bash "$0" "$THEN"
  ;;
S29)  # session 28's first call (~5 min; OLD=1 and carry .s29 = f0684f6 for the old side): the GPU tests of the shift rules and the
    # shift gradients (softpick's argmax kept under the compiled kernel's `if STATS`), the bf16 gradient
    # ones, then benchmarks.shifts here and at f0684f6 (softpick's max and isfinite mask as N x N
    # tensors, softmax_1 in two passes, all three trained through the reference VJP)
  timeout -k 10 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "shifts_bf16 or row_output_gradients or bf16_forward_and_gradients" \
    > $OUT/test_gpu_s29.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/test_gpu_s29.txt | cut -c1-200
  OUT=$OUT/shifts timeout -k 5 120 python3 -m benchmarks.shifts > $OUT/shifts.txt 2>&1
  echo "shifts rc $?"; grep -v "^W\|Warning" $OUT/shifts.txt | cut -c1-220 | tail -3
  [ -n "$OLD" ] || exit 0
  OUT=$OUT/shifts_old timeout -k 5 150 python3 scripts/with_tree.py .s29 benchmarks.shifts > $OUT/shifts_old.txt 2>&1
  echo "shifts at f0684f6 rc $?"; grep -v "^W\|Warning" $OUT/shifts_old.txt | cut -c1-220 | tail -4
  ;;
S28)  # session 28 on an H100 (~6.5 min; carry .s28; then G in its own call): IPA at D=128 with the many-loads backward default (measured at
    # D=64 only) against --tune, benchmarks.joined at D=128 (the rotary part 64: DK 192 in pieces 128 + 64),
    # and at D=64 here and at e058c67 (fit_rows)
  for mode in default tune; do
    OUT=$OUT/ipa128_$mode timeout -k 5 120 python3 -m benchmarks.backward --n 1024 --b 4 --d 128 --variants ipa \
      $([ $mode = tune ] && echo --tune || echo --inductor) > $OUT/ipa128_$mode.txt 2>&1
    echo "ipa128_$mode rc $?"; grep -v "^backward:" $OUT/ipa128_$mode.txt | cut -c1-220
  done
  OUT=$OUT/joined128 timeout -k 5 90 python3 -m benchmarks.joined --d 128 --r 64 > $OUT/joined128.txt 2>&1
  echo "joined128 rc $?"; grep -v "^W\|Warning" $OUT/joined128.txt | cut -c1-200 | tail -4
  for tree in . .s28; do      # fit_rows (16-row backward tiles) against e058c67
    (cd $tree && OUT=$OUT/joined64_${tree#.} timeout -k 5 75 python3 -m benchmarks.joined > $OUT/joined64_${tree#.}.txt 2>&1)
    echo "joined64 at $tree rc $?"; grep -v "^W\|Warning" $OUT/joined64_${tree#.}.txt | cut -c1-200 | tail -3
  done
  ;;
S27B)  # session 27's second call (~6 min; carry .s27 = 499a14e): the new GPU tests (two products of
    # different lengths joined into one dot, einsums whose K and V lack the head letter) and the bf16
    # gradient ones (IPA at its new backward default: dK/dV 16x64 w4s4, dQ 64x32 w4s2), IPA's step at
    # that default against Inductor, then benchmarks.joined here and at 499a14e (the second product an
    # N x N tensor read back, the einsums unfused)
  timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "joined_products or bf16_forward_and_gradients" \
    > $OUT/test_gpu_s27b.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/test_gpu_s27b.txt | cut -c1-200
  OUT=$OUT/ipa timeout -k 5 60 python3 -m benchmarks.backward --n 1024 --b 4 --variants ipa --inductor > $OUT/ipa.txt 2>&1
  echo "ipa rc $?"; grep -v "^backward:" $OUT/ipa.txt | cut -c1-220
  for tree in . .s27; do
    name=joined_$([ $tree = . ] && echo new || echo old)
    (cd $tree && OUT=$OUT/$name timeout -k 5 75 python3 -m benchmarks.joined > $OUT/$name.txt 2>&1)
    echo "$name rc $?"; cut -c1-200 $OUT/$name.txt | grep -v "^W\|Warning" | tail -4
  done
  ;;
S27A)  # session 27's first call: the GPU tests in full (part G), then IPA's training step with every kernel
    # autotuned (--tune: is 64x64 dK/dV, which spills 4.4 KB offline, what the tuner keeps?) beside the
    # default, then post_softmax's forward in two processes (session 26: 0.32 against 0.08 ms, same code)
  bash "$0" G
  for mode in default tune; do
    name=s27_ipa_$mode
    OUT=$OUT/$name timeout -k 5 110 python3 -m benchmarks.backward --n 1024 --b 4 --variants ipa \
      $([ $mode = tune ] && echo --tune) $([ $mode = default ] && echo --inductor) > $OUT/$name.txt 2>&1
    echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-200
  done
  for rep in 1 2; do
    name=s27_post_softmax_$rep
    OUT=$OUT/$name timeout -k 5 60 python3 -m benchmarks.backward --n 1024 --b 4 --variants post_softmax,vanilla \
      > $OUT/$name.txt 2>&1
    echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-200
  done
  ;;
C26)  # session 26's third call (B26 timed before flashlight.wait() was in benchmarks.backward: a Gluon
    # kernel could take over mid-timing; sinks, ALiBi and DiffAttn, unchanged, moved 1.3-3x): the GPU
    # tests the gradient changes reach, then IPA's, Evoformer's and post_softmax's steps, this
    # code and bb1621f (.s26) alternating, then IPA's kernels one by one (benchmarks.kernels --step)
  timeout -k 10 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "bf16_forward_and_gradients or fused_dq or group_loop" \
    > $OUT/test_gpu_c26.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/test_gpu_c26.txt | cut -c1-160
  for rep in 1; do
    for v in ipa evoformer post_softmax; do
      for tree in . .s26; do
        name=c26_$([ $tree = . ] && echo new || echo old)_${v}_$rep
        (cd $tree && OUT=$OUT/$name timeout -k 5 60 python3 -m benchmarks.backward --n 1024 --b 4 \
          --variants $v $([ $v$tree$rep = ipa.1 ] && echo --inductor) > $OUT/$name.txt 2>&1)
        echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-120
      done
    done
  done
  for tree in . .s26; do
    name=c26_kernels_$([ $tree = . ] && echo new || echo old)
    (cd $tree && OUT=$OUT/$name timeout -k 5 60 python3 -m benchmarks.kernels --variants ipa --step --n 1024 --b 4 \
      > $OUT/$name.txt 2>&1)
    echo "$name rc $?"; tail -12 $OUT/$name.txt | cut -c1-150
  done
  ;;
B26)  # session 26's second call: body-load gradients summed across the loop (per-key in the dK/dV kernel,
    # per-query in the dQ kernel, factored sums) and a full-rank bias stored per tile, against bb1621f
    # (.s26: per-tile atomics), the training steps of the programs they reach, B=4 N=1024
  for v in ipa evoformer sinks diff_attention relative_position alibi; do
    for tree in . .s26; do
      name=b26_$([ $tree = . ] && echo new || echo old)_$v
      (cd $tree && OUT=$OUT/$name timeout -k 5 50 python3 -m benchmarks.backward --n 1024 --b 4 \
        --variants $v > $OUT/$name.txt 2>&1)
      echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-150
    done
  done
  ;;
A26)  # session 26's first call: R3 (T5's table gradient, uniform tiles against 4e92c47's per-score adds,
    # .s25 carried), then R2's variants at this code alone (the acq_rel half dropped: R1 measured it on GQA)
  bash "$0" R3
  for v in sinks diff_attention evoformer relative_position ipa; do
    name=atomics_$v
    OUT=$OUT/$name timeout -k 5 45 python3 -m benchmarks.backward --n 1024 \
      --variants $v --inductor > $OUT/$name.txt 2>&1
    echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-150
  done
  ;;
R3)  # session 25 (not run: the machine was taken back): T5's relative-position table gradient, one add per
    # tile where the tile reads one bucket (gradients.uniform_add, 696cd03), against 4e92c47 (.s25: one
    # relaxed add per score). Prepare: git archive 4e92c47 | (mkdir -p .s25 && tar -x -C .s25)
  for tree in . .s25; do
    name=relpos_$([ $tree = . ] && echo uniform || echo per_score_4e92c47)
    (cd $tree && OUT=$OUT/$name timeout -k 5 70 python3 -m benchmarks.backward --n 1024 --b 4 \
      --variants relative_position > $OUT/$name.txt 2>&1)
    echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-150
  done
  ;;
R2)  # session 25, after R1: the training steps whose backward adds into shared gradients (a learned
    # table, Evoformer's biases, sinks, IPA's terms, DiffAttn's lambda) here and at 97af4d5 (.s24: acq_rel).
    # Session 25's first form (all five variants in one process, B=4 N=4096, 150 s per tree) printed
    # nothing in 150 s in either tree: relative_position was first, and its table gradient is one atomic
    # add per score into 65 buckets per head (nearly all into the two clipped ends). Now each variant
    # alone, N=1024, its own timeout.
  for v in sinks diff_attention evoformer relative_position ipa; do
    for tree in . .s24; do
      name=atomics_$([ $tree = . ] && echo relaxed || echo acq_rel_97af4d5)_$v
      (cd $tree && OUT=$OUT/$name timeout -k 5 45 python3 -m benchmarks.backward --n 1024 \
        --variants $v --inductor > $OUT/$name.txt 2>&1)
      echo "$name rc $?"; grep -v "^backward:" $OUT/$name.txt | cut -c1-150
    done
  done
  ;;
R1)  # session 25: relaxed atomics (sem="relaxed": acq_rel fenced each add, MEMBAR.ALL.GPU + CCTL.IVALL in
    # the SASS). The GPU tests they reach and the fixed misaligned-view test; the training steps with
    # dQ added by the dK/dV kernel (B: FLASHLIGHT_ATOMIC_DQ=1) against the two kernels, SDPA beside them;
    # GQA's atomics path (FLASHLIGHT_GROUP_LOOP=0) here and at 97af4d5 (.s24 carried: acq_rel)
  timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    -k "misaligned or fused_dq or group_loop or gqa" > $OUT/test_gpu_r1.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/test_gpu_r1.txt | cut -c1-160
  timeout -k 10 200 python3 -m benchmarks.run --suite training --only causal,alibi,document_12,gqa_4 \
    --backends flashlight,sdpa_cudnn,sdpa_flash --b-env FLASHLIGHT_ATOMIC_DQ=1 --no-plots --time-limit 180 \
    --out $OUT/fused_dq > $OUT/fused_dq.txt 2>&1
  echo "fused_dq rc $?"; tail -9 $OUT/fused_dq.txt | cut -c1-170
  for tree in . .s24; do
    (cd $tree && FLASHLIGHT_GROUP_LOOP=0 timeout -k 10 70 python3 -m benchmarks.run --suite training --only gqa_4 \
      --backends flashlight --b-env FLASHLIGHT_GROUP_LOOP=auto --no-plots --time-limit 55 \
      --out $OUT/gqa_atomics_${tree#.} > $OUT/gqa_atomics_${tree#.}.txt 2>&1)
    echo "gqa atomics at ${tree} rc $?"; tail -2 $OUT/gqa_atomics_${tree#.}.txt | cut -c1-170
  done
  ;;
W3)  # session 23: where the document mask's first call goes at D=128 (#6's two misses, 10-24 ms) against
    # causal's and Flex's, phase timers (never run on a GPU); DiffAttn's forward against Inductor's
  timeout -k 10 170 python3 -m benchmarks.first_call --variants document_12,causal --d 128 --systems flashlight,flex \
    2>&1 | nogrep | tee $OUT/first_call.txt | tail -8
  timeout -k 10 100 python3 -m benchmarks.run --suite beyond --only diff_attention --shapes 4x4096 --backends flashlight,inductor \
    --no-plots --time-limit 80 --out $OUT/diff > $OUT/diff.txt 2>&1
  echo "diff rc $?"; tail -3 $OUT/diff.txt | cut -c1-150
  ;;
W2)  # session 23: issue #5's training table with W1's results in (the rotated Q loaded in training, the
    # backward's new defaults), then full attention D=64 at 1x16384 against cuDNN (#6's 0.9 target)
  LIMIT=250 bash "$0" TR
  timeout -k 10 80 python3 -m benchmarks.run --suite flex --only full --dims 64 --shapes 1x16384 \
    --backends flashlight,flex,sdpa_cudnn --no-plots --time-limit 60 --out $OUT/full64 > $OUT/full64.txt 2>&1
  echo "full D=64 rc $?"; tail -3 $OUT/full64.txt | cut -c1-150
  ;;
W1)  # session 23: RoPE's training rows with the rotated Q loaded (capture.rules.computed_operand) against
    # the code before it (.s22 = 53db442, carried), then launch-config sweeps for DiffAttn's forward and
    # dK/dV (offline sm_90: 128x64w8s3 forward spills 168 bytes, 64x64w8s3 none; dK/dV 32x64w4s3 180,
    # 16x64w4s3 none) and the document mask's dK/dV and dQ at D=128
  timeout -k 10 150 python3 -m benchmarks.run --suite training --only rope,rope_gqa_4 --backends flashlight,inductor \
    --no-plots --time-limit 130 --out $OUT/rope > $OUT/rope.txt 2>&1
  echo "rope training rc $?"; tail -6 $OUT/rope.txt | cut -c1-150
  (cd .s22 && PYTHONPATH=. timeout -k 10 110 python3 -m benchmarks.run --suite training --only rope --backends flashlight \
    --no-plots --time-limit 95 --out $OUT/rope_s22 > $OUT/rope_s22.txt 2>&1)
  echo "rope training at 53db442 rc $?"; tail -4 $OUT/rope_s22.txt | cut -c1-150
  timeout -k 10 90 python3 -m benchmarks.configs --variants diff_attention --d 128 \
    --configs 128x64w8s3,64x64w8s3,64x64w8s2,64x64w4s3,64x32w4s3,128x32w8s3 --out $OUT 2>&1 | nogrep | tail -9
  timeout -k 10 120 python3 -m benchmarks.backward_configs --variants diff_attention,document_mask --d 128 --kernels dkdv \
    --configs 32x64w4s3,16x64w4s3,16x64w4s4,32x128w8s3,16x128w8s3 --out $OUT/dkdv 2>&1 | nogrep | cut -c1-150 | tail -14
  timeout -k 10 90 python3 -m benchmarks.backward_configs --variants document_mask --d 128 --kernels dq \
    --out $OUT/dq 2>&1 | nogrep | cut -c1-150 | tail -10
  ;;
G)  # the GPU tests alone (~6 min on an H100: 79 tests; 330 s was too short in session 34)
  timeout -k 10 450 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1
  echo "test_gpu rc $?"; tail -12 $OUT/test_gpu.txt | cut -c1-300
  ;;
N1)  # session 19 (plan above)
  timeout -k 10 260 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "FAILED|ERROR|passed|failed|Error" | cut -c1-140
  timeout -k 10 170 python3 -m benchmarks.run --suite training --backends flashlight,flashlight_b,flex,inductor \
    --b-env FLASHLIGHT_ATOMIC_DQ=1 --no-plots --time-limit 150 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training (flashlight_b: fused dQ) rc $?"; tail -11 $OUT/training.txt | cut -c1-170
  ;;
N3)  # session 19: the GPU tests N1's time limit cut, the gradient tests again (the tile kernels read
    # dO: DotGrads.direct), then the training table at this code and at ff3e694 (.s18, carried)
  timeout -k 10 270 python3 -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py \
    -k "gluon_tile or bf16_forward_and_gradients or fused_dq or quick_start or first_forward or reduce_overhead or autocast" \
    2>&1 | tee $OUT/test_gpu.txt | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | cut -c1-140
  timeout -k 10 130 python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit 115 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -10 $OUT/training.txt | cut -c1-150
  (cd .s18 && PYTHONPATH=. timeout -k 10 110 python3 -m benchmarks.run --suite training --backends flashlight,flex \
    --no-plots --time-limit 95 --out $OUT/training_s18 > $OUT/training_s18.txt 2>&1)
  echo "training at ff3e694 rc $?"; tail -10 $OUT/training_s18.txt | cut -c1-150
  ;;
N4)  # session 19: issue #5's table at the code that stays (the row kernel's 32 rows; no DotGrads.direct)
  timeout -k 10 150 python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit 130 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -10 $OUT/training.txt | cut -c1-150
  ;;
N5)  # session 19: K and V operands computed outside the kernel (capture.rules.key_operand) against
    # in it (FLASHLIGHT_KV_LEAVES=0, flashlight_b), RoPE forward and training, one run
  timeout -k 10 200 python3 -m benchmarks.run --suite beyond,training --only rope \
    --backends flashlight,flashlight_b,inductor --b-env FLASHLIGHT_KV_LEAVES=0 \
    --no-plots --time-limit 170 --out $OUT/rope > $OUT/rope.txt 2>&1
  echo "rope rc $?"; tail -6 $OUT/rope.txt | cut -c1-150
  ;;
P1)  # session 20 (plan above)
  timeout -k 10 300 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "FAILED|ERROR|passed|failed|Error" | cut -c1-140
  timeout -k 10 150 python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit 130 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -12 $OUT/training.txt | cut -c1-170
  bash "$0" N5
  ;;
P2)
  bash "$0" F
  ;;
AF)  # ALiBi's forward, D=128, this code (causal beside it) against 85e2075 (.s19 carried)
  timeout -k 10 80 python3 -m benchmarks.run --suite flex --only alibi,causal --dims 128 --backends flashlight,flex \
    --no-plots --time-limit 65 --out $OUT/alibi_fwd > $OUT/alibi_fwd.txt 2>&1
  echo "alibi fwd rc $?"; tail -9 $OUT/alibi_fwd.txt | cut -c1-150
  (cd .s19 && PYTHONPATH=. timeout -k 10 60 python3 -m benchmarks.run --suite flex --only alibi --dims 128 --backends flashlight \
    --no-plots --time-limit 45 --out $OUT/alibi_fwd_s19 > $OUT/alibi_fwd_s19.txt 2>&1)
  echo "alibi fwd at 85e2075 rc $?"; tail -6 $OUT/alibi_fwd_s19.txt | cut -c1-150
  ;;
T19)  # ALiBi's and DiffAttn's training rows at 85e2075 (.s19 carried)
  (cd .s19 && PYTHONPATH=. timeout -k 10 110 python3 -m benchmarks.run --suite training --only alibi,diff_attention \
    --backends flashlight --no-plots --time-limit 95 --out $OUT/training_s19 > $OUT/training_s19.txt 2>&1)
  echo "training alibi, diff_attention at 85e2075 rc $?"; tail -8 $OUT/training_s19.txt | cut -c1-150
  ;;
Z)  # session 21 (~300 s left): the bf16 forward-and-gradient GPU tests (ALiBi, DiffAttn's stored halves), then
    # ALiBi's D=128 training row against Flex
  timeout -k 10 100 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py -k "bf16_forward_and_gradients" 2>&1 \
    | tee $OUT/test_gpu.txt | grep -E "PASSED|FAILED|ERROR|passed|failed|Error" | cut -c1-140
  timeout -k 10 70 python3 -m benchmarks.run --suite training --only alibi --dims 128 --backends flashlight,flex \
    --no-plots --time-limit 55 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -5 $OUT/training.txt | cut -c1-170
  ;;
U0)  # session 21 (six failed starts left ~500 s): the GPU tests of the changed code paths, then ALiBi's
    # and DiffAttn's training rows
  timeout -k 10 170 python3 -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py \
    -k "bf16_forward_and_gradients or (gluon_forward_matches and alibi) or gluon_tile_kernels" 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "FAILED|ERROR|passed|failed|Error" | cut -c1-140
  timeout -k 10 110 python3 -m benchmarks.run --suite training --only alibi,diff_attention --backends flashlight,flex,inductor \
    --no-plots --time-limit 95 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -8 $OUT/training.txt | cut -c1-170
  ;;
U1)  # session 21 (failed starts left ~700 s): the GPU tests the score rewrites and stored slices reach,
    # then issue #5's training table
  bash "$0" GT
  LIMIT=150 bash "$0" TR
  ;;
GT)  # the GPU tests that sessions 20-22's changes reach
  timeout -k 10 220 python3 -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py \
    -k "bf16_forward_and_gradients or gluon_forward_matches or gluon_tile_kernels or fused_dq" 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "FAILED|ERROR|passed|failed|Error" | cut -c1-140
  ;;
G1)  # session 24: the dK/dV group loop (GradPlan.group): its GPU tests and the GQA ones, then GQA and
    # RoPE + GQA training with the loop (A) against atomics (B: FLASHLIGHT_GROUP_LOOP=0), Gluon tile
    # kernels (default), then the Triton dK/dV kernel's A/B (FLASHLIGHT_GLUON_DKDV=0), then the kernel split
  timeout -k 10 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "group_loop or gqa" \
    > $OUT/test_gpu_group.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/test_gpu_group.txt | cut -c1-160
  timeout -k 10 200 python3 -m benchmarks.run --suite training --only gqa_4,rope_gqa_4 \
    --backends flashlight,flex,inductor --b-env FLASHLIGHT_GROUP_LOOP=0 --no-plots --time-limit 170 \
    --out $OUT/group > $OUT/group.txt 2>&1
  echo "group rc $?"; tail -6 $OUT/group.txt | cut -c1-170
  FLASHLIGHT_GLUON_DKDV=0 timeout -k 10 100 python3 -m benchmarks.run --suite training --only gqa_4 \
    --backends flashlight --b-env FLASHLIGHT_GROUP_LOOP=0 --no-plots --time-limit 80 \
    --out $OUT/group_triton > $OUT/group_triton.txt 2>&1
  echo "group_triton rc $?"; tail -3 $OUT/group_triton.txt | cut -c1-170
  for g in auto 0; do
    FLASHLIGHT_GROUP_LOOP=$g timeout -k 10 90 python3 -m benchmarks.kernels --variants gqa --d 128 --step \
      > $OUT/kernels_gqa_group_$g.txt 2>&1
    echo "kernels FLASHLIGHT_GROUP_LOOP=$g rc $?"; grep -iE "dkdv|dq|step|total" $OUT/kernels_gqa_group_$g.txt | head -12 | cut -c1-150
  done
  ;;
G2)  # session 24, after G1: the Triton dK/dV kernel's group loop flattened into its block loops (no loop
    # nest: offline no spills); the loop forced (A: FLASHLIGHT_GROUP_LOOP=1) against atomics (B), default
    # tile kernels (D=64: Triton; D=128: Gluon), then the Triton tile kernels at both head dims
  export FLASHLIGHT_GROUP_LOOP=1
  timeout -k 10 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "group_loop or gqa" \
    > $OUT/test_gpu_group.txt 2>&1
  echo "test_gpu rc $?"; grep -E "FAILED|ERROR|passed|failed" $OUT/test_gpu_group.txt | cut -c1-160
  timeout -k 10 170 python3 -m benchmarks.run --suite training --only gqa_4,rope_gqa_4 \
    --backends flashlight,flex --b-env FLASHLIGHT_GROUP_LOOP=0 --no-plots --time-limit 150 \
    --out $OUT/g2 > $OUT/g2.txt 2>&1
  echo "g2 rc $?"; tail -4 $OUT/g2.txt | cut -c1-170
  FLASHLIGHT_GLUON_DKDV=0 timeout -k 10 150 python3 -m benchmarks.run --suite training --only gqa_4,rope_gqa_4 \
    --backends flashlight --b-env FLASHLIGHT_GROUP_LOOP=0 --no-plots --time-limit 130 \
    --out $OUT/g2_triton > $OUT/g2_triton.txt 2>&1
  echo "g2_triton rc $?"; tail -4 $OUT/g2_triton.txt | cut -c1-170
  ;;
TR)  # issue #5's training table, starting no case after $LIMIT seconds (SDPA where it expresses the row)
  timeout -k 10 $((LIMIT + 20)) python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor,sdpa_cudnn,sdpa_flash \
    --no-plots --time-limit $LIMIT --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -17 $OUT/training.txt | cut -c1-170
  ;;
U2)  # session 21: ALiBi (forward and training) and DiffAttn (training) at 85e2075 (.s19) against this code
  bash "$0" AF
  timeout -k 10 110 python3 -m benchmarks.run --suite training --only alibi,diff_attention --backends flashlight,inductor \
    --no-plots --time-limit 95 --out $OUT/training_ad > $OUT/training_ad.txt 2>&1
  echo "training alibi, diff_attention rc $?"; tail -8 $OUT/training_ad.txt | cut -c1-150
  bash "$0" T19
  ;;
V1)  # session 22 (failed starts): the GPU tests the changes reach (DiffAttn both ways, stored slices, ALiBi's
    # score rewrite), then issue #5's training table (with the DIFF Transformer's own spelling)
  bash "$0" GT
  LIMIT=300 bash "$0" TR
  ;;
V2)  # session 22: ALiBi's forward and ALiBi's and DiffAttn's training at 85e2075 (.s19), DiffAttn's two
    # spellings' forwards, then the flex suite's D=128 half (the first-call misses)
  bash "$0" AF
  bash "$0" T19
  timeout -k 10 90 python3 -m benchmarks.run --suite beyond --only diff_attention,diff_transformer --backends flashlight,inductor \
    --no-plots --time-limit 75 --out $OUT/diff > $OUT/diff.txt 2>&1
  echo "diff rc $?"; tail -10 $OUT/diff.txt | cut -c1-150
  timeout -k 10 200 python3 -m benchmarks.run --suite flex --dims 128 --backends flashlight,flex,sdpa_cudnn \
    --time-limit 180 --out $OUT/flex128 > $OUT/flex128.txt 2>&1
  echo "flex128 rc $?"; tail -30 $OUT/flex128.txt | cut -c1-170
  ;;
X)  # session 22 (V2 was taken back mid-run; ~390 s left): where the document mask's training step spends
    # its host time (D=64: 1.03 ms against Flex's 0.69 on an H100), causal beside it, then ALiBi's A/B
  timeout -k 10 120 python3 -m benchmarks.overhead --step --variants document_mask,causal --d 64 --profile \
    > $OUT/overhead_step.txt 2>&1
  echo "overhead rc $?"; grep -E "^variant=" $OUT/overhead_step.txt
  bash "$0" AF
  ;;
R1)  # session 20: the GPU tests in full, then ALiBi's relative-position split (codegen.emit.relative_positions)
    # against the code before it (85e2075, .s19 carried), forward, D=128, same call
  timeout -k 10 370 python3 -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "FAILED|ERROR|passed|failed|Error" | cut -c1-140
  bash "$0" AF
  ;;
R2)  # session 20: issue #5's training table at this code (RoPE and Llama's RoPE + GQA rows too), ALiBi's
    # rows and (session 21: DiffAttn's half-width heads stored, not atomic) DiffAttn's at 85e2075 (.s19),
    # then the K/V-leaf A/B on RoPE and RoPE + GQA (rope_gqa_4: the leaf is k at its 4 K/V heads, against
    # the rotation in the kernel on the repeated k)
  timeout -k 10 170 python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit 150 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -14 $OUT/training.txt | cut -c1-170
  bash "$0" T19
  timeout -k 10 200 python3 -m benchmarks.run --suite beyond --only rope,rope_gqa_4 \
    --backends flashlight,flashlight_b,inductor --b-env FLASHLIGHT_KV_LEAVES=0 \
    --no-plots --time-limit 180 --out $OUT/rope > $OUT/rope.txt 2>&1
  echo "rope rc $?"; tail -8 $OUT/rope.txt | cut -c1-150
  ;;
Q1)  # session 20: P1 split to fit a call's 600 s: the GPU tests in full, then N5 (RoPE A/B)
  timeout -k 10 370 python3 -m pytest -v -p no:cacheprovider --durations=0 tests/test_gpu.py 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "FAILED|ERROR|passed|failed|Error" | cut -c1-140
  bash "$0" N5
  ;;
Q2)  # session 20: issue #5's training table at the final code
  timeout -k 10 150 python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit 130 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -12 $OUT/training.txt | cut -c1-170
  ;;
N2)
  FLASHLIGHT_ATOMIC_DQ=1 timeout -k 10 140 python3 -m benchmarks.backward_configs --variants alibi,document_mask \
    --d 128 --kernels dkdv --out $OUT/fused 2>&1 | nogrep | tee $OUT/fused_configs.txt | cut -c1-150 | tail -24
  timeout -k 10 60 python3 -m benchmarks.backward_configs --variants alibi,document_mask --d 128 --kernels rows \
    --out $OUT 2>&1 | nogrep | tee $OUT/rows_configs.txt | cut -c1-150 | tail -12
  ;;
H)  # session 18: T with the tests' results streamed (a call in session 18 got "stopped answering" in T),
    # and the benchmarks without the fast launch path if the tests hung
  timeout -k 10 230 python3 -m pytest -x -v -p no:cacheprovider tests/test_gpu.py 2>&1 | tee $OUT/test_gpu.txt \
    | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | cut -c1-140
  rc=${PIPESTATUS[0]}; echo "test_gpu rc $rc"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then export FLASHLIGHT_FAST_LAUNCH=0; fi
  timeout -k 10 ${TRAIN_S:-200} python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit $(( ${TRAIN_S:-200} - 25 )) --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -14 $OUT/training.txt | cut -c1-170
  ;;
T)  # session 17 (device time scarce): the GPU tests, then issue #5's training table (~8.5 min)
  timeout -k 10 230 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1
  echo "test_gpu rc $?"; tail -8 $OUT/test_gpu.txt | cut -c1-300
  timeout -k 10 ${TRAIN_S:-200} python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit $(( ${TRAIN_S:-200} - 25 )) --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -14 $OUT/training.txt | cut -c1-170
  ;;
F)  # session 17: the whole flex suite, both head dims, in one run (issue #6: "measured in one run")
  timeout -k 10 570 python3 -m benchmarks.run --suite flex --backends flashlight,flex,sdpa_cudnn \
    --time-limit 540 --out $OUT/flex > $OUT/flex.txt 2>&1
  echo "flex rc $?"; tail -56 $OUT/flex.txt | cut -c1-170
  ;;
S1)
  timeout -k 10 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1
  echo "test_gpu rc $?"; tail -6 $OUT/test_gpu.txt | cut -c1-300
  bash "$0" 3
  ;;
S2)
  timeout -k 10 280 python3 -m benchmarks.run --suite sparsity --backends flashlight,flex,inductor \
    --time-limit 250 --no-plots --out $OUT/sparsity > $OUT/sparsity.txt 2>&1
  echo "sparsity rc $?"; tail -22 $OUT/sparsity.txt | cut -c1-170
  timeout -k 10 220 python3 -m benchmarks.first_call --variants alibi,causal,document_12,prefix_lm_256 --d 128 \
    --systems flashlight,flashlight_b,flex --b-env FLASHLIGHT_PREBUILD=0 2>&1 | nogrep | tee $OUT/first_call.txt | tail -14
  ;;
S3)
  timeout -k 10 250 python3 -m benchmarks.run --suite training --backends flashlight,flex,inductor \
    --no-plots --time-limit 230 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -14 $OUT/training.txt | cut -c1-170
  timeout -k 10 250 python3 -m benchmarks.run --suite flex --dims 64 --backends flashlight,flex,sdpa_cudnn \
    --time-limit 230 --out $OUT/flex64 > $OUT/flex64.txt 2>&1
  echo "flex64 rc $?"; tail -27 $OUT/flex64.txt | cut -c1-170
  ;;
S4)
  timeout -k 10 150 python3 -m benchmarks.run --suite flex --shapes 16x1024 --backends flashlight,flex --cuda-graphs \
    --no-plots --time-limit 130 --out $OUT/cg_flex > $OUT/cg_flex.txt 2>&1
  echo "cuda graphs, flex rc $?"; tail -22 $OUT/cg_flex.txt | cut -c1-190
  timeout -k 10 90 python3 -m benchmarks.run --suite training --only causal,document_mask --backends flashlight,flex \
    --cuda-graphs --no-plots --time-limit 75 --out $OUT/cg_training > $OUT/cg_training.txt 2>&1
  echo "cuda graphs, training rc $?"; tail -10 $OUT/cg_training.txt | cut -c1-190
  ;;
1)  # session 14's first call (~9.5 min): the smoke gates the Gluon tile kernels' half of the A/B
  tiles=all
  for k in dkdv dq; do
    timeout -k 10 90 python3 -m benchmarks.gluon_smoke --kernels $k 2>&1 | nogrep | tee $OUT/smoke_$k.txt | cut -c1-160 | tail -8
    rc=${PIPESTATUS[0]}; echo "smoke $k rc $rc"; [ "$rc" = 0 ] || tiles=0
  done
  FLASHLIGHT_GLUON_DKDV=$tiles FLASHLIGHT_GLUON_DQ=$tiles timeout -k 10 300 python3 -m benchmarks.run --suite training \
    --b-env FLASHLIGHT_GLUON_DKDV=0,FLASHLIGHT_GLUON_DQ=0 --backends flashlight,flashlight_b,flex,inductor \
    --no-plots --time-limit 250 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training (tiles $tiles against 0) rc $?"; tail -14 $OUT/training.txt | cut -c1-170
  timeout -k 10 130 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k "gluon or quick or first_forward" > $OUT/test_gpu.txt 2>&1
  tail -3 $OUT/test_gpu.txt | cut -c1-300
  ;;
3)  # the document mask's step, per kernel and host time (torch.profiler, cProfile): this code, then session 10's
  for tree in . .s10; do
    (cd $tree && PYTHONPATH=. timeout -k 10 120 python3 -m benchmarks.kernels --variants document_mask,causal --d 64 \
      --step --flex --profile --out $OUT/kernels_$(basename $tree) 2>&1 | nogrep > $OUT/kernels_$(basename $tree).txt)
    echo "== $tree"; grep -E "do_bench| fl_|host" $OUT/kernels_$(basename $tree).txt | cut -c1-150 | head -30
  done
  ;;
2)  # the D=128 flex suite cold (first calls against Flex, steady state, cuDNN), then the quick start's A/B
  timeout -k 10 330 python3 -m benchmarks.run --suite flex --dims 128 --backends flashlight,flex,sdpa_cudnn \
    --time-limit 300 --out $OUT/flex128 > $OUT/flex128.txt 2>&1
  echo "flex rc $?"; tail -27 $OUT/flex128.txt | cut -c1-170
  timeout -k 10 170 python3 -m benchmarks.first_call --variants causal,alibi,document_12,full --d 128 \
    --systems flashlight,flashlight_b,flex --b-env FLASHLIGHT_QUICK=0 2>&1 | nogrep | tee $OUT/first_call_quick.txt | tail -20
  ;;
A)
  for k in dkdv dq; do
    timeout -k 10 110 python3 -m benchmarks.gluon_smoke --kernels $k 2>&1 | nogrep | tee $OUT/smoke_$k.txt | cut -c1-200
    echo "smoke $k rc ${PIPESTATUS[0]}"
  done
  timeout -k 10 170 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "gluon or quick or first_forward" > $OUT/test_gpu.txt 2>&1
  tail -4 $OUT/test_gpu.txt | cut -c1-300
  for on in all 0; do     # "all": also where the forward keeps Triton's kernel (the document mask)
    FLASHLIGHT_GLUON_DKDV=$on FLASHLIGHT_GLUON_DQ=$on timeout -k 10 90 python3 -m benchmarks.kernels \
      --variants causal,vanilla,document_mask --d 128 --step --out $OUT/kernels_gluon$on 2>&1 | nogrep > $OUT/kernels_gluon$on.txt
    echo "gluon tiles $on:"; grep -E "do_bench| fl_" $OUT/kernels_gluon$on.txt | cut -c1-150 | head -24
  done
  ;;
B)
  FLASHLIGHT_GLUON_DKDV=all FLASHLIGHT_GLUON_DQ=all timeout -k 10 330 python3 -m benchmarks.run --suite training \
    --b-env FLASHLIGHT_GLUON_DKDV=0,FLASHLIGHT_GLUON_DQ=0 --backends flashlight,flashlight_b,flex,inductor \
    --no-plots --time-limit 300 --out $OUT/training > $OUT/training.txt 2>&1
  echo "training rc $?"; tail -14 $OUT/training.txt | cut -c1-170
  timeout -k 10 180 python3 -m benchmarks.first_call --variants causal,alibi,document_12,full --d 128 \
    --systems flashlight,flashlight_b,flex --b-env FLASHLIGHT_QUICK=0 2>&1 | nogrep | tee $OUT/first_call_quick.txt | tail -20
  ;;
C)
  timeout -k 10 330 python3 -m benchmarks.run --suite flex --dims 128 --backends flashlight,flex,sdpa_cudnn \
    --time-limit 300 --out $OUT/flex128 > $OUT/flex128.txt 2>&1
  echo "flex rc $?"; tail -27 $OUT/flex128.txt | cut -c1-170
  ;;
D)
  timeout -k 10 150 python3 -m benchmarks.first_call --variants causal,document_12 --d 128 \
    --systems flashlight,flashlight_b --b-env FLASHLIGHT_PREBUILD=0 2>&1 | nogrep | tee $OUT/first_call_prebuild.txt | tail -6
  timeout -k 10 200 python3 -m benchmarks.first_call --step --variants causal,document_12 --d 128 \
    --systems flashlight,flashlight_b,flex --b-env FLASHLIGHT_PREFETCH=0 2>&1 | nogrep | tee $OUT/first_call_step.txt | tail -8
  ;;
esac
