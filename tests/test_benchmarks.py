"""benchmarks/: exact FLOP counting, and one case of the suite end to end on CPU (interpreter)."""
import csv
import math
import threading

import pytest
import torch

from benchmarks import flex_equivalents as fe
from benchmarks import flops, measure, run
from benchmarks.suites import PROGRAMS, Case, make_inputs
from benchmarks.decode import mask_mod as decode_mask
from flashlight.examples.document_mask import doc_ids_for


def brute_pairs(mask_mod, B, M, N):
    q = torch.arange(M)[:, None]
    kv = torch.arange(N)[None, :]
    return sum(int(mask_mod(torch.tensor(b), torch.tensor(0), q, kv).expand(M, N).sum()) for b in range(B))


@pytest.mark.parametrize("M, N", [(300, 300), (37, 70), (1, 77)])
def test_unmasked_pairs_exact(monkeypatch, M, N):
    monkeypatch.setattr(flops, "CHUNK", 64)     # several row chunks, a ragged last one
    ids = doc_ids_for(3, max(M, N), generator=torch.Generator().manual_seed(0))
    offset = decode_mask((torch.empty(1, 1, M, 1), torch.empty(1, 1, N, 1)))    # kv <= q + N - M
    masks = [(fe.causal_mask, False), (fe.sliding_window_mask, False), (fe.prefix_lm_mask, False),
             (fe.document_mask_mod(ids), True), (offset, False)]
    for mask, per_batch in masks:
        assert flops.unmasked_pairs(mask, 3, M, N, batch_dependent=per_batch) == brute_pairs(mask, 3, M, N)
    assert flops.unmasked_pairs(None, 3, M, N) == 3 * M * N


def test_causal_count_and_formula():
    pairs = flops.unmasked_pairs(fe.causal_mask, 2, 4096, 4096)
    assert pairs == 2 * 4096 * 4097 // 2
    fwd = flops.forward_flops(pairs, 16, 4 * 64)
    assert fwd == 4 * 64 * 16 * pairs
    assert flops.total_flops(fwd, "fwd+bwd") == 3.5 * fwd


@pytest.mark.parametrize("program", [p for p, prog in PROGRAMS.items() if prog.flex or prog.sdpa])
def test_flex_and_sdpa_spellings_match_the_program(program):
    """The FlexAttention (eager, its reference path) and SDPA spellings compute the program."""
    case = Case("t", program, program, 2, 4, 1 if program.startswith("decode") else 37, 70, 16,
                extra=(("kv_heads", 2),) if program.startswith("decode") else ())
    xs = list(make_inputs(case, torch.float32, "cpu"))
    want = torch.nan_to_num(PROGRAMS[program].fn(*xs), nan=0.0)
    env = measure.Env(device="cpu", dtype=torch.float32)
    backends = [b for b in ("flex", "flex_mask") if PROGRAMS[program].flex]
    backends += ["sdpa_flash"] if PROGRAMS[program].sdpa and PROGRAMS[program].sdpa(xs) else []
    for b in backends:
        try:
            got = measure.build(b, case, xs, env, {})()
        except measure.NotApplicable:
            continue
        assert torch.allclose(got, want, atol=1e-5), (program, b)


def run_case(tmp_path, monkeypatch, *argv):
    monkeypatch.setenv("FLASHLIGHT_CACHE_DIR", str(tmp_path / "cache"))   # main() points it elsewhere
    assert run.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), *argv]) == 0
    with open(tmp_path / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_flex_case_end_to_end(tmp_path, monkeypatch):
    """One forward case: Flashlight fused and matches fp32 eager, eager Flex agrees, cuDNN is
    n/a on CPU, TFLOP/s follows from the causal pair count, and the plots are written."""
    rows = run_case(tmp_path, monkeypatch, "--suite", "flex", "--only", "causal",
                    "--backends", "flashlight,flex,sdpa_cudnn")
    assert len(rows) == 1
    r = rows[0]
    assert (r["suite"], r["variant"], r["N"], r["fused"]) == ("flex", "causal", "40", "1")
    assert r["flashlight_ok"] == "True" and float(r["flashlight_err"]) < 1e-4
    assert r["flex_ok"] == "True" and float(r["flex_err"]) < 1e-4
    assert r["sdpa_cudnn_ms"] == "–" and r["sdpa_cudnn_note"].startswith("n/a")
    assert r["inductor_ms"] == ""                     # not selected
    B, H, N, D = 2, 2, 40, 32
    assert math.isclose(float(r["density"]), (N * (N + 1) / 2) / (N * N), rel_tol=1e-6)
    gflop = 4 * D * H * B * N * (N + 1) / 2 / 1e9
    assert math.isclose(float(r["gflop"]), gflop, rel_tol=1e-5)
    tf = gflop * 1e9 / (float(r["flashlight_ms"]) * 1e-3) / 1e12
    assert math.isclose(float(r["flashlight_tflops"]), tf, rel_tol=1e-4)
    assert math.isclose(float(r["flashlight_vs_flex"]), float(r["flex_ms"]) / float(r["flashlight_ms"]), rel_tol=1e-4)
    # the sparsity suite lists flex's measurement of the same case instead of measuring again
    rows = run_case(tmp_path, monkeypatch, "--suite", "sparsity", "--only", "causal",
                    "--backends", "flashlight,flex", "--no-plots")
    assert [x["suite"] for x in rows] == ["flex", "sparsity"]
    assert rows[1]["flashlight_ms"] == r["flashlight_ms"] and "measured in suite flex" in rows[1]["notes"]
    pytest.importorskip("matplotlib")
    assert (tmp_path / "speedup_flex.png").exists() and (tmp_path / "tflops_flex.png").exists()


def test_cuda_graphs_time_flashlight_and_flex_under_reduce_overhead(tmp_path, monkeypatch):
    """``--cuda-graphs`` adds flashlight_cg and flex_cg (both ``mode="reduce-overhead"``) after
    the case's backends, where their base backend runs; each is checked against the reference
    like the others (on CPU Inductor runs them without CUDA graphs: a plumbing check)."""
    rows = run_case(tmp_path, monkeypatch, "--suite", "flex", "--only", "causal", "--backends", "flashlight,flex",
                    "--cuda-graphs", "--no-plots")
    r = rows[0]
    for b in ("flashlight_cg", "flex_cg"):
        assert r[f"{b}_ok"] == "True" and float(r[f"{b}_err"]) < 1e-4, (b, r[f"{b}_note"])
    assert r["sdpa_flash_ms"] == ""                   # not selected, and so not graphed either
    rows = run_case(tmp_path / "beyond", monkeypatch, "--suite", "beyond", "--only", "diff_attention",
                    "--backends", "flashlight", "--cuda-graphs", "--no-plots")
    assert rows[0]["flashlight_cg_ok"] == "True" and rows[0]["flex_cg_ms"] == ""     # Flex was not run
    rows = run_case(tmp_path / "flashlight", monkeypatch, "--suite", "flex", "--only", "causal",
                    "--backends", "flashlight", "--cuda-graphs", "--no-plots")
    assert rows[0]["flashlight_cg_ok"] == "True" and rows[0]["flex_cg_ms"] == ""     # nor selected here


def test_training_case_checks_gradients(tmp_path, monkeypatch):
    """A fwd+bwd case compares the output and the q/k/v gradients and counts 3.5x the FLOPs."""
    rows = run_case(tmp_path, monkeypatch, "--suite", "training", "--only", "causal",
                    "--backends", "flashlight,eager", "--no-plots")
    r = rows[0]
    assert r["mode"] == "fwd+bwd"
    assert r["flashlight_ok"] == "True" and float(r["flashlight_err"]) < 1e-4
    assert r["eager_ok"] == "True"
    B, H, N, D = 2, 2, 40, 32
    assert math.isclose(float(r["gflop"]), 3.5 * 4 * D * H * B * N * (N + 1) / 2 / 1e9, rel_tol=1e-5)


def test_backward_config_sweep_checks_each_config_against_float64(tmp_path, monkeypatch):
    """benchmarks.backward_configs on CPU: every config of both tile kernels, run alone into
    fresh poisoned buffers, matches float64 autograd; a config that computed something else
    would show as a large error in the CSV."""
    import sys

    from benchmarks import backward_configs
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["backward_configs", "--device", "cpu", "--variants", "document_mask",
                                      "--b", "1", "--h", "2", "--n", "40", "--d", "16"])
    backward_configs.main()
    rows = list(csv.DictReader(open(tmp_path / "backward_configs_d16.csv")))
    assert [r["kernel"] for r in rows] == ["dkdv", "dkdv", "dq", "dq"]
    assert all(float(r["err"]) < 1e-5 and not r["note"] for r in rows)
    assert [r["default"] for r in rows] == ["True", "False", "True", "False"]


def test_backward_config_sweep_times_the_row_kernel_too(tmp_path, monkeypatch):
    """``--kernels rows``: the row-gradient kernel writes the gradients of the epilogue's inputs
    (DiffAttn's λ and RMSNorm weight), checked against float64 like the tile kernels'."""
    import sys

    from benchmarks import backward_configs
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["backward_configs", "--device", "cpu", "--variants", "diff_attention",
                                      "--b", "1", "--h", "2", "--n", "24", "--d", "16", "--kernels", "rows,dq"])
    backward_configs.main()
    rows = list(csv.DictReader(open(tmp_path / "backward_configs_d16.csv")))
    assert [r["kernel"] for r in rows] == ["rows", "rows", "dq", "dq"]
    assert all(float(r["err"]) < 1e-5 and not r["note"] for r in rows)


def test_first_call_phases_come_from_timers(monkeypatch):
    """benchmarks.first_call's columns are timers (Dynamo's, Flashlight's report, Triton's
    listener), not cProfile's cumulative times, which read 0 on the device's Python 3.12: on the
    CPU the compile phases are positive, nested ones fit inside their parent, and Triton's
    listener is counted per thread."""
    from benchmarks import first_call
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    row = first_call.child("flashlight", "causal", 1, 40, 16, "cpu")
    assert set(first_call.PHASES) <= set(row)
    assert row["dynamo"] > 0 and row["backend"] > 0 and row["trace"] > 0 and row["lower"] > 0
    assert row["trace"] + row["lower"] <= row["backend"] <= row["dynamo"] <= row["wall"]
    assert row["rest"] == pytest.approx(row["wall"] - row["dynamo"] - row["triton"])
    times = first_call.TritonTimes()
    elapsed = type("T", (), {"total": 250_000})()
    times(src=None, metadata={}, metadata_group={}, times=elapsed, cache_hit=False)
    times(src=None, metadata={}, metadata_group={}, times=elapsed, cache_hit=True)
    other = threading.Thread(target=lambda: times(src=None, metadata={}, metadata_group={}, times=elapsed,
                                                  cache_hit=False))
    other.start()
    other.join()
    assert (times.main, times.other) == (0.25, 0.25)


def test_sdpa_document_case_fuses_and_agrees_with_flex(tmp_path, monkeypatch):
    """The sparsity suite's SDPA-spelled document mask (the next GPU run's new case): the
    program fuses (one region, so SDPA was decomposed), matches fp32 eager, and eager Flex with
    the same document mask agrees; its FLOPs count only the unmasked pairs."""
    rows = run_case(tmp_path, monkeypatch, "--suite", "sparsity", "--only", "document_12_sdpa",
                    "--backends", "flashlight,flex", "--no-plots")
    (r,) = rows
    assert (r["variant"], r["program"], r["fused"]) == ("document_12_sdpa", "sdpa_document", "1")
    assert r["flashlight_ok"] == "True" and float(r["flashlight_err"]) < 1e-4
    assert r["flex_ok"] == "True" and float(r["flex_err"]) < 1e-4
    assert 0 < float(r["density"]) < 0.5


def test_flashlight_b_captures_under_its_own_environment():
    """flashlight_b (``run --b-env``) compiles a copy of the program with a code object of its
    own: Dynamo caches compiled graphs on the code object, and the second compile of the same
    function reused the first's graph, captured without the B environment (session 19's void
    A/B)."""
    from benchmarks.measure import own_code, with_environ
    from flashlight.examples import VARIANTS
    from flashlight.runtime.op import REGISTRY
    mod = VARIANTS["rope"]
    xs = mod.make_inputs(B=1, H=2, M=33, D=16)
    REGISTRY.clear()
    a = torch.compile(mod.attention, backend="flashlight", dynamic=False)
    b = torch.compile(own_code(mod.attention), backend="flashlight", dynamic=False)
    out_a = a(*xs)
    out_b = with_environ({"FLASHLIGHT_KV_LEAVES": "0"}, lambda: b(*xs))
    assert sorted(c.region.dots[0].k.op for c in REGISTRY.values()) == ["add", "load"]
    assert torch.allclose(out_a, out_b, atol=1e-5)


def test_the_reference_keeps_every_head_of_a_grouped_case():
    """The fp32 reference runs the first heads of a head-sliceable program, but not of a GQA case:
    K and V have H / group heads there, and cutting all three to the same heads would pair query
    heads with the wrong K/V head (session 22: RoPE + GQA read 2.1 for every backend)."""
    rope = Case("training", "rope", "rope", 4, 16, 64, 64, 32, "fwd+bwd")
    assert measure.ref_heads(rope) == measure.REF_HEADS
    gqa = Case("training", "rope_gqa_4", "rope", 4, 16, 64, 64, 32, "fwd+bwd", (("group", 4),))
    assert measure.ref_heads(gqa) is None
