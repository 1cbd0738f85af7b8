"""Score programs that add two products of different contraction lengths (decoupled RoPE,
DeepSeek-V3's absorbed MLA) and MQA written as an einsum: flashlight against plain
torch.compile (Inductor), forward and forward + backward, bf16.

    python -m benchmarks.joined [--b 4] [--h 16] [--n 4096] [--d 64] [--r 32]

Before ``capture/products.py`` the second product was computed outside the kernel as an
N x N tensor and read back; run the same command in an older tree for that side. Prints one line
per program (median ``do_bench`` ms, relative error of the output against fp32 eager) and writes
``$OUT/joined.csv`` when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import csv
import os

import torch

import flashlight
from flashlight.testing import rel_error

from .smoke import NAN, configure_dynamo, make_bench, to_fp32


def decoupled_rope(q, k, v, qr, kr):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + (qr @ kr.transpose(-1, -2)) * qr.shape[-1] ** -0.5
    return torch.softmax(s, -1) @ v


def absorbed_mla(q_nope, q_pe, kv, pe):
    scale = (q_nope.shape[-1] + q_pe.shape[-1]) ** -0.5
    scores = (torch.einsum("bshc,btc->bsht", q_nope, kv) + torch.einsum("bshr,btr->bsht", q_pe, pe)) * scale
    return torch.einsum("bsht,btc->bshc", scores.softmax(dim=-1), kv)


def mqa_einsum(q, k, v):
    s = torch.einsum("bhsd,btd->bhst", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("bhst,btd->bhsd", s.softmax(-1), v)


def shapes(a) -> dict:
    B, H, N, D, R = a.b, a.h, a.n, a.d, a.r
    return {"decoupled_rope": (decoupled_rope, [(B, H, N, D), (B, H, N, D), (B, H, N, D), (B, H, N, R), (B, H, N, R)]),
            # prefill of N // 4 queries (rows: the heads, FlashMLA's layout) against N latents
            "absorbed_mla": (absorbed_mla, [(B, N // 4, H, D), (B, N // 4, H, R), (B, N, D), (B, N, R)]),
            "mqa_einsum": (mqa_einsum, [(B, H, N, D), (B, N, D), (B, N, D)])}


def parser(doc: str, **defaults) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    for name, default in defaults.items():
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda")
    return p


def compare(programs: dict, device: str, csv_name: str) -> list[dict]:
    """Time every program, {name: (fn, input shapes)}, under flashlight and Inductor: one line
    each, and ``$OUT/csv_name`` when ``OUT`` is set."""
    configure_dynamo()
    bench = make_bench(device, 25, 100)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    rows = []
    for name, (fn, sizes) in programs.items():
        torch.manual_seed(0)
        xs = [torch.randn(s, device=device, dtype=dtype).requires_grad_() for s in sizes]
        with torch.no_grad():
            ref = fn(*[to_fp32(x) for x in xs])
        row = {"program": name}
        for system, compiled in (("flashlight", torch.compile(fn, backend="flashlight")), ("inductor", torch.compile(fn))):
            try:
                out = compiled(*xs)
                dout = torch.randn_like(out)
                row[f"err_{system}"] = rel_error(out, ref)
                if system == "flashlight":
                    flashlight.wait()
                    regions = flashlight.explain(fn, *xs).regions
                    row["features"] = " ".join(regions[0].features) if regions else "no region in explain()"
                    row["backward"] = regions[0].backward.split(" (")[0] if regions else ""
                row[f"ms_fwd_{system}"] = bench(lambda: compiled(*xs))
                row[f"ms_step_{system}"] = bench(lambda: torch.autograd.grad(compiled(*xs), xs, dout))
            except Exception as e:  # noqa: BLE001 — a failing system is a NaN row, the run goes on
                row[f"err_{system}"] = NAN
                row["notes"] = f"{system}: {type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(f"{name:15s} err {row.get('err_flashlight', NAN):.1e}/{row.get('err_inductor', NAN):.1e}  "
              f"fwd {row.get('ms_fwd_flashlight', NAN):.3f}/{row.get('ms_fwd_inductor', NAN):.3f}  "
              f"step {row.get('ms_step_flashlight', NAN):.3f}/{row.get('ms_step_inductor', NAN):.3f} ms  "
              f"[{row.get('features', '')}; backward {row.get('backward', '')}] {row.get('notes', '')}", flush=True)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        cols = sorted({k for r in rows for k in r}, key=lambda k: (k != "program", k))
        with open(os.path.join(os.environ["OUT"], csv_name), "w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows(rows)
    return rows


def main(argv=None) -> None:
    a = parser(__doc__, b=4, h=16, n=4096, d=64, r=32).parse_args(argv)
    compare(shapes(a), a.device, "joined.csv")


if __name__ == "__main__":
    main()
