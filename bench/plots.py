"""Plots of the capacity sweep on a real Ollama (issue 30 item 3).

    python -m bench.plots SWEEP.json [--trace-budget K] [--out docs/img]

Reads what `python -m bench.ollama_capacity --sweep ...` wrote (sweep.json)
and writes two PNGs (matplotlib, the `bench` extra):

- capacity-trace.png: models resident and memory held (runner RSS plus the
  daemon's pool) over time, stock and kvcached, for the sweep point where
  stock keeps K models (default: the second point);
- capacity-sweep.png: models resident (time average) and reloads against
  the budget, both sides.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

GiB = 1 << 30
COLORS = {"stock": "#d62728", "kvcached": "#1f77b4"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def trace_plot(point: dict, path: pathlib.Path, title: str) -> pathlib.Path:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for side in ("stock", "kvcached"):
        s = point["samples"][side]
        t = [x["t"] for x in s]
        top.step(t, [x["resident"] for x in s], where="post", color=COLORS[side], label=side)
        bottom.plot(t, [x["held"] / GiB for x in s], color=COLORS[side], label=side)
    top.set_ylabel("models resident")
    top.set_title(title)
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    bottom.axhline(point["budget"] / GiB, color="gray", linestyle="--", linewidth=1, label="budget")
    bottom.set_ylabel("memory held, GiB")
    bottom.set_xlabel("seconds into the trace")
    bottom.legend(loc="upper right")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def sweep_plot(points: list[dict], path: pathlib.Path, title: str) -> pathlib.Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    budgets = [p["budget"] / GiB for p in points]
    for side in ("stock", "kvcached"):
        left.plot(budgets, [p["sides"][side]["resident_mean"] for p in points], marker="o", color=COLORS[side], label=side)
        right.plot(budgets, [p["sides"][side]["reloads"] for p in points], marker="o", color=COLORS[side], label=side)
    left.set_xlabel("budget, GiB")
    left.set_ylabel("models resident (time average)")
    left.grid(alpha=0.3)
    left.legend()
    right.set_xlabel("budget, GiB")
    right.set_ylabel("model reloads")
    right.grid(alpha=0.3)
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=pathlib.Path, help="sweep.json of bench.ollama_capacity --sweep")
    ap.add_argument("--trace-budget", type=int, default=0, help="the point where stock keeps K models (default: the second)")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent / "docs" / "img")
    a = ap.parse_args(argv)
    r = json.loads(a.sweep.read_text())
    points = r.get("sweep")
    if not points:
        raise SystemExit(f"{a.sweep}: no sweep points (made by bench.ollama_capacity --sweep)")
    if a.trace_budget:
        chosen = [p for p in points if p["stock_fits"] == a.trace_budget]
        if not chosen:
            raise SystemExit(f"no sweep point where stock keeps {a.trace_budget}: have {[p['stock_fits'] for p in points]}")
        point = chosen[0]
    else:
        point = points[min(1, len(points) - 1)]
    a.out.mkdir(parents=True, exist_ok=True)
    n = r["config"]["models"]
    t = trace_plot(point, a.out / "capacity-trace.png",
                   f"{n} models, budget {point['budget'] / GiB:.2f} GiB (stock keeps {point['stock_max_loaded_models']})")
    s = sweep_plot(points, a.out / "capacity-sweep.png", f"{n} models on a real Ollama: stock vs kvcached")
    print(f"wrote {t} and {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
