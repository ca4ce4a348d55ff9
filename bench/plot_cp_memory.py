"""Peak memory and saved activations per rank against the sequence length at cp = 1, 2, 4, as an SVG
(no plotting library needed), from bench/cp_memory.sh's tables.

usage: plot_cp_memory.py OUT_DIR "T1 T2 ..." OUT.svg

Left panel: the measured activations a training step saves per rank ("saved": held after the forward
pass above what the step started with), without and with --checkpoint-blocks. Right panel: the peak
tensor bytes per rank over the step (parameters, gradients, AdamW's moments and the activations).
Written for docs/BENCHMARKS.md ("Context parallelism").
"""
import sys

MESHES = (("tp=1", "#1f77b4"), ("cp=2", "#ff7f0e"), ("cp=4", "#2ca02c"))


def read(out, seqs):
    data = {}
    for tag in ("plain", "ckpt"):
        for seq in seqs:
            for line in open(f"{out}/mem_{tag}_{seq}.txt"):
                f = line.split()
                if f and f[0] in dict(MESHES) and len(f) > 12:
                    data[(tag, f[0], seq)] = (float(f[7]), float(f[10]))   # peak, saved
    return data


def panel(x0, y0, w, h, title, seqs, series, ymax):
    """series: [(label, colour, dashed, [(T, MiB)])]"""
    xmax = max(seqs)
    px = lambda t: x0 + 50 + (w - 70) * t / xmax
    py = lambda v: y0 + h - 40 - (h - 70) * v / ymax
    s = [f'<text x="{x0 + w / 2}" y="{y0 + 18}" text-anchor="middle" font-size="14">{title}</text>',
         f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(xmax)}" y2="{py(0)}" stroke="black"/>',
         f'<line x1="{px(0)}" y1="{py(0)}" x2="{px(0)}" y2="{py(ymax)}" stroke="black"/>']
    for t in seqs:
        s.append(f'<text x="{px(t)}" y="{py(0) + 16}" text-anchor="middle" font-size="11">{t}</text>')
    for k in range(5):
        v = ymax * k / 4
        s.append(f'<text x="{px(0) - 6}" y="{py(v) + 4}" text-anchor="end" font-size="11">{v:.0f}</text>')
        s.append(f'<line x1="{px(0)}" y1="{py(v)}" x2="{px(xmax)}" y2="{py(v)}" stroke="#ddd"/>')
    s.append(f'<text x="{x0 + w / 2}" y="{y0 + h - 8}" text-anchor="middle" font-size="12">sequence length T</text>')
    s.append(f'<text x="{x0 + 12}" y="{y0 + h / 2}" font-size="12" transform="rotate(-90 {x0 + 12} {y0 + h / 2})" '
             f'text-anchor="middle">MiB per rank</text>')
    for i, (label, colour, dashed, points) in enumerate(series):
        path = " ".join(f"{px(t):.1f},{py(v):.1f}" for t, v in points)
        dash = ' stroke-dasharray="6,4"' if dashed else ""
        s.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        for t, v in points:
            s.append(f'<circle cx="{px(t):.1f}" cy="{py(v):.1f}" r="3" fill="{colour}"/>')
        ly = y0 + 36 + 16 * i
        s.append(f'<line x1="{px(0) + 10}" y1="{ly}" x2="{px(0) + 34}" y2="{ly}" stroke="{colour}" stroke-width="2"{dash}/>')
        s.append(f'<text x="{px(0) + 40}" y="{ly + 4}" font-size="11">{label}</text>')
    return s


def main():
    out, seqs, svg = sys.argv[1], [int(s) for s in sys.argv[2].split()], sys.argv[3]
    data = read(out, seqs)
    saved = [(f"{m}{' --checkpoint-blocks' if tag == 'ckpt' else ''}", colour, tag == "ckpt",
              [(t, data[(tag, m, t)][1]) for t in seqs]) for tag in ("plain", "ckpt") for m, colour in MESHES]
    peak = [(f"{m}{' --checkpoint-blocks' if tag == 'ckpt' else ''}", colour, tag == "ckpt",
             [(t, data[(tag, m, t)][0]) for t in seqs]) for tag in ("plain", "ckpt") for m, colour in MESHES]
    top_saved = max(v for _, _, _, p in saved for _, v in p) * 1.1
    top_peak = max(v for _, _, _, p in peak for _, v in p) * 1.1
    parts = ['<svg xmlns="http://www.w3.org/2000/svg" width="960" height="420" font-family="sans-serif">',
             '<rect width="960" height="420" fill="white"/>']
    parts += panel(0, 0, 480, 420, "activations saved per rank (measured)", seqs, saved, top_saved)
    parts += panel(480, 0, 480, 420, "peak tensor memory per rank", seqs, peak, top_peak)
    parts.append("</svg>")
    open(svg, "w").write("\n".join(parts) + "\n")
    print(f"wrote {svg}")


if __name__ == "__main__":
    main()
