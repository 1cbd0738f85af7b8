"""Results on disk and on screen: the CSV (one row per case, appended as each case finishes, so a
killed run keeps what it measured), its reader, one-line progress logs and the summary table.

Cells: a number; "–" where the backend cannot run the program (n/a); empty where it was not run
or failed (its ``_note`` column then says why).
"""
from __future__ import annotations

import csv
import math
import os

from .suites import BACKENDS

NA = "–"

META = ["suite", "variant", "program", "mode", "B", "H", "M", "N", "D", "shape", "dtype", "device",
        "density", "gflop", "fused", "ref", "flashlight_vs_sdpa", "flashlight_vs_compile",
        "flashlight_vs_eager", "notes"]
FIELDS = ["ms", "tflops", "vs_flex", "err", "ok", "first_s", "ready_s", "note"]
COLUMNS = META + [f"{b}_{f}" for b in BACKENDS for f in FIELDS]


def cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "inf" if math.isinf(v) else ("" if math.isnan(v) else f"{v:.6g}")
    return str(v)


class CsvSink:
    """Appends rows to ``path``; a file with another header is moved aside, not mixed in."""

    def __init__(self, path: str):
        self.path = path
        header = None
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, newline="") as f:
                header = next(csv.reader(f), None)
        if header is not None and header != COLUMNS:
            os.replace(path, path + ".old")
            header = None
        if header is None:
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(COLUMNS)

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.writer(f).writerow([cell(row.get(c)) for c in COLUMNS])


def read_csv(path: str) -> list[dict]:
    """Rows as dicts of strings; for a case measured twice (a rerun) the last row wins."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    latest = {}
    for r in rows:
        latest[(r["suite"], r["variant"], r["mode"], r["shape"], r["dtype"])] = r
    return list(latest.values())


def num(v) -> float | None:
    """A measured number, or None (n/a, failed, missing)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def ratio(row: dict, other: str, mine: str = "flashlight") -> float | None:
    a, b = num(row.get(f"{other}_ms")), num(row.get(f"{mine}_ms"))
    return a / b if a is not None and b else None


# ------------------------------------------------------------------------------ on screen
def marker(row: dict, backend: str) -> str:
    """Why ``backend`` has no time: "–" n/a, "err" failed, "" not run."""
    if row.get(f"{backend}_ms") == NA:
        return NA
    return "err" if (row.get(f"{backend}_note") or "").startswith("error") else ""


def vs(other: str):
    """Table cell: other ms / Flashlight ms, or why there is none."""
    return lambda r: ratio(r, other) or marker(r, other) or marker(r, "flashlight")


def fmt(v, spec: str) -> str:
    x = num(v)
    if x is not None:
        return "inf" if math.isinf(x) else format(x, spec)
    return str(v or "")


def backend_line(row: dict, backend: str) -> str:
    """``flex 0.424ms 324TF/s err 2e-03 first 2.6s`` or the reason it has no time."""
    ms = row.get(f"{backend}_ms")
    if num(ms) is None:
        note = row.get(f"{backend}_note") or "not run"
        return f"{backend} {note[:90]}"
    s = f"{backend} {num(ms):.3f}ms"
    if num(row.get(f"{backend}_tflops")) is not None:
        s += f" {num(row[f'{backend}_tflops']):.0f}TF/s"
    if num(row.get(f"{backend}_err")) is not None:
        s += f" err {num(row[f'{backend}_err']):.0e}" + ("" if row.get(f"{backend}_ok") in (True, "True") else " NOT OK")
    if num(row.get(f"{backend}_first_s")) is not None:
        s += f" first {num(row[f'{backend}_first_s']):.1f}s"
        ready = num(row.get(f"{backend}_ready_s"))
        if ready is not None and ready - num(row[f"{backend}_first_s"]) >= 0.05:
            s += f" (ready {ready:.1f}s)"
    return s


TABLE = [  # header, width, value(row), format
    ("suite", 8, lambda r: r["suite"], "s"),
    ("variant", 17, lambda r: r["variant"], "s"),
    ("B", 3, lambda r: r["B"], "s"), ("H", 3, lambda r: r["H"], "s"),
    ("N", 6, lambda r: r["N"], "s"), ("D", 4, lambda r: r["D"], "s"),
    ("fus", 3, lambda r: "" if r.get("fused") is None else r["fused"], "s"),
    ("fl_ms", 8, lambda r: num(r.get("flashlight_ms")) or marker(r, "flashlight"), ".3f"),
    ("TF/s", 5, lambda r: r.get("flashlight_tflops"), ".0f"),
    ("err", 7, lambda r: r.get("flashlight_err"), ".0e"),
    ("ok", 3, lambda r: {True: "y", False: "NO", "True": "y", "False": "NO"}.get(r.get("flashlight_ok"), ""), "s"),
    ("xflex", 6, vs("flex"), ".2f"),
    ("xflex+bm", 8, vs("flex_mask"), ".2f"),
    ("xsdpa", 6, lambda r: r.get("flashlight_vs_sdpa") or (NA if any(
        r.get(f"{b}_ms") == NA for b in ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient")) else ""), ".2f"),
    ("xcomp", 6, vs("inductor"), ".2f"),
    ("xeager", 6, vs("eager"), ".2f"),
    ("xB", 5, lambda r: ratio(r, "flashlight_b") or "", ".3f"),
    ("cg_ms", 7, lambda r: num(r.get("flashlight_cg_ms")) or "", ".3f"),
    ("xfx_cg", 6, lambda r: ratio(r, "flex_cg", "flashlight_cg") or "", ".2f"),
    ("1st_fl", 6, lambda r: r.get("flashlight_first_s"), ".1f"),
    ("1st_fx", 6, lambda r: r.get("flex_first_s"), ".1f"),
    ("rdy_fl", 6, lambda r: r.get("flashlight_ready_s"), ".1f"),
]

LEGEND = ("fl_ms: Flashlight median ms; TF/s: its TFLOP/s of unmasked work; err: max rel. error vs "
          "fp32 eager (output, and q/k/v grads in training); xNAME = NAME ms / Flashlight ms "
          "(> 1: Flashlight faster); flex+bm: create_block_mask inside the call; sdpa: fastest "
          "SDPA backend; comp: torch.compile; xB: --b-env's A/B, Flashlight under those variables (ms) / "
          "Flashlight (ms); cg_ms: Flashlight under --cuda-graphs (mode=\"reduce-overhead\"), xfx_cg: Flex's time "
          "under it / cg_ms; 1st_*: first-call seconds (compile + tune); rdy_fl: seconds until "
          "Flashlight's background compiles were done too (the Gluon forward takes over then); "
          "–: n/a; err: failed (the CSV's *_note says why); blank: not run")


def table(rows: list[dict]) -> str:
    def line(values):
        return " ".join(f"{v:<{w}}" if i < 2 else f"{v:>{w}}"
                        for i, ((_, w, _, _), v) in enumerate(zip(TABLE, values)))
    out = [line([h for h, _, _, _ in TABLE])]
    for r in rows:
        vals = []
        for _, w, get, spec in TABLE:
            v = get(r)
            vals.append((str(v) if spec == "s" else fmt(v, spec))[:w])
        out.append(line(vals))
    return "\n".join(out)
