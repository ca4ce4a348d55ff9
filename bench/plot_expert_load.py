"""The expert load of a mixture-of-experts run over time, as an SVG (no plotting library needed).

usage: plot_expert_load.py METRICS.jsonl OUT.svg [--window N] [--top-k K]

One panel per MoE layer: each expert's share of the layer's assignments per step (the metrics file's
"expert_load", tokens x k per step), averaged over the last N steps (default 10); a dashed line at
1 / experts is the balanced share. A last panel draws the load-balancing loss ("aux_loss",
E x sum over the k slots and the experts of f_{j,e} P_e, Hugging Face's load_balancing_loss_func): its
minimum is k (--top-k, default 2), reached whenever the mean router probabilities are uniform, even
while the top-k counts are not. Written for docs/BENCHMARKS.md ("Mixture of experts").
"""
import json
import sys

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"]


def read(path):
    steps, loads, aux = [], [], []
    for line in open(path):
        row = json.loads(line)
        if "expert_load" not in row:
            continue
        steps.append(row["step"])
        loads.append(row["expert_load"])
        aux.append(row.get("aux_loss", 0.0))
    if not steps:
        sys.exit(f"{path}: no step line with expert_load (a mixture-of-experts run's metrics file is needed)")
    return steps, loads, aux


def moving(values, window):
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def panel(x0, y0, w, h, steps, series, y_max, title, reference=None, y_label_fmt="{:.2f}"):
    s = [f'<g><text x="{x0}" y="{y0 - 6}" font-size="13">{title}</text>',
         f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    first, last = steps[0], steps[-1]
    sx = lambda t: x0 + (t - first) / max(last - first, 1) * w
    sy = lambda v: y0 + h - min(v, y_max) / y_max * h
    for k in range(5):
        v = y_max * k / 4
        s.append(f'<text x="{x0 - 6}" y="{sy(v) + 4:.1f}" font-size="10" text-anchor="end">{y_label_fmt.format(v)}</text>')
        s.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" stroke="#eee"/>')
    if reference is not None:
        s.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{sy(reference):.1f}" y2="{sy(reference):.1f}" stroke="#333" '
                 f'stroke-dasharray="4 3"/>')
    for i, ys in enumerate(series):
        pts = " ".join(f"{sx(t):.1f},{sy(v):.1f}" for t, v in zip(steps, ys))
        s.append(f'<polyline fill="none" stroke="{COLOURS[i % len(COLOURS)]}" stroke-width="1.3" points="{pts}"/>')
    for t in (first, (first + last) // 2, last):
        s.append(f'<text x="{sx(t):.1f}" y="{y0 + h + 14}" font-size="10" text-anchor="middle">{t}</text>')
    s.append("</g>")
    return "\n".join(s)


def main(path, out, window=10, top_k=2):
    steps, loads, aux = read(path)
    layers, experts = len(loads[0]), len(loads[0][0])
    w, h, left, top, gap = 760, 150, 60, 40, 50
    parts = []
    for layer in range(layers):
        shares = []
        for e in range(experts):
            raw = [row[layer][e] / max(sum(row[layer]), 1) for row in loads]
            shares.append(moving(raw, window))
        y_max = max(0.05, max(max(s) for s in shares) * 1.1)
        parts.append(panel(left, top + layer * (h + gap), w, h, steps, shares, y_max,
                           f"layer {layer}: each expert's share of the assignments ({window}-step mean; dashed: 1/{experts})",
                           reference=1.0 / experts))
    y = top + layers * (h + gap)
    parts.append(panel(left, y, w, h, steps, [moving(aux, window)], max(aux) * 1.1 or 1.0,
                       f"load-balancing loss ({window}-step mean; dashed: its minimum, k = {top_k})",
                       reference=float(top_k)))
    height = y + h + 40
    legend = " ".join(f'<tspan fill="{COLOURS[e % len(COLOURS)]}">expert {e}</tspan>' for e in range(experts))
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + w + 20}" height="{height}" font-family="sans-serif">\n'
           f'<rect width="100%" height="100%" fill="white"/>\n<text x="{left}" y="18" font-size="12">{legend}</text>\n'
           + "\n".join(parts) + f'\n<text x="{left + w / 2}" y="{height - 8}" font-size="11" text-anchor="middle">step'
           f'</text>\n</svg>\n')
    open(out, "w").write(svg)
    print(f"{out}: {layers} layers x {experts} experts over steps {steps[0]}..{steps[-1]}")


if __name__ == "__main__":
    args = sys.argv[1:]
    window, top_k = 10, 2
    if "--window" in args:
        i = args.index("--window")
        window = int(args[i + 1])
        del args[i:i + 2]
    if "--top-k" in args:
        i = args.index("--top-k")
        top_k = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 2:
        sys.exit(__doc__)
    main(args[0], args[1], window, top_k)
