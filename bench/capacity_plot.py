"""The plot of stage 5's capacity scenario (issue 44): models resident and
device memory per model, stock against kvcached.

    python -m bench.capacity_plot CAPACITY.json [--out docs/img/capacity-8b-cpu-scaled.png] [--title T]

Reads what tests/helpers/gpu_capacity.py run wrote (capacity.json: one phase
per side and slot count) and writes one PNG (matplotlib, the `bench` extra):
on the left the models each side kept resident per slot count, on the right
each resident model's device memory (the model's buffers and, on the
kvcached side, its daemon pages), in load order.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from .plots import COLORS, _pyplot

MiB = 1 << 20


def capacity_plot(rec: dict, path: pathlib.Path, title: str) -> pathlib.Path:
    plt = _pyplot()
    phases = rec["phases"]
    slots = sorted({p["parallel"] for p in phases})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), gridspec_kw={"width_ratios": [1, 2]})
    width = 0.38
    for k, side in enumerate(("stock", "kvcached")):
        xs = [i + (k - 0.5) * width for i in range(len(slots))]
        n = [next((p["resident"] for p in phases if p["side"] == side and p["parallel"] == s), 0) for s in slots]
        bars = left.bar(xs, n, width, color=COLORS[side], label=side)
        left.bar_label(bars)
        for p in phases:
            if p["side"] == side:
                mem = [m["device_delta"] / MiB for m in p["models"]]
                right.plot(range(1, len(mem) + 1), mem, marker="o" if p["parallel"] == 1 else "s",
                           linestyle="-" if p["parallel"] == 1 else "--", color=COLORS[side],
                           label=f"{side}, {p['parallel']} slot{'s' if p['parallel'] > 1 else ''}")
    left.set_xticks(range(len(slots)), [f"{s} slot{'s' if s > 1 else ''}" for s in slots])
    left.set_ylabel("models resident")
    left.legend()
    left.grid(alpha=0.3, axis="y")
    right.set_xlabel("model, in load order")
    right.set_ylabel("device memory per model, MiB")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("capacity_json")
    ap.add_argument("--out", default="docs/img/capacity-8b-cpu-scaled.png")
    ap.add_argument("--title", default="")
    a = ap.parse_args(argv)
    rec = json.loads(pathlib.Path(a.capacity_json).read_text())
    title = a.title or (f"{rec.get('shape')} model at Ollama {rec.get('ollama')}'s defaults, "
                        f"{rec.get('device_name', rec.get('device'))}")
    print(capacity_plot(rec, pathlib.Path(a.out), title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
