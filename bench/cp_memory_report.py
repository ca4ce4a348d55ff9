"""The tables of bench/cp_memory.sh: peak and saved activations per rank against T at cp = 1, 2, 4, and
the longest sequence whose estimated peak fits a memory budget.

usage: cp_memory_report.py OUT_DIR "T1 T2 ..." BUDGET_GIB

How the longest sequence is estimated (a step at the limit, 20K-80K positions of GPT-2 small, takes
tens of minutes to hours on two cores, so it is not run): the activations a step saves are measured
exactly linear in T and exactly 1 / cp of one rank's (the "saved" column), and so is every per-token
transient (the logits, the attention's tiles). Peak per rank is therefore fixed + slope x T / cp,
with slope one rank's growth between the two largest T (where the activations, not AdamW's first
allocation, set the peak) and fixed each mesh's peak at the largest T less its slope's share. Two
budgets: all of a run's ranks on this one machine (the budget over the ranks: with the threads
backend cp adds no memory, it splits it, and every rank holds the replicated parameters and moments),
and one rank per machine of the budget's size, which is what cp is for.
"""
import sys

MESHES = (("tp=1", 1), ("cp=2", 2), ("cp=4", 4))


def read(out, tag, seqs):
    rows = {}
    for seq in seqs:
        row = {}
        for line in open(f"{out}/mem_{tag}_{seq}.txt"):
            f = line.split()
            if f and f[0] in dict(MESHES) and len(f) > 12:
                # mesh params states act ideal | resident peak peak/ideal | saved grads+act step-pmv | RSS
                row[f[0]] = dict(peak=float(f[7]), saved=float(f[10]))
        rows[seq] = row
    return rows


def main():
    out, seqs, budget = sys.argv[1], sorted(int(s) for s in sys.argv[2].split()), float(sys.argv[3])
    for tag in ("plain", "ckpt"):
        rows = read(out, tag, seqs)
        print(f"\n{'--checkpoint-blocks' if tag == 'ckpt' else 'without activation checkpointing'}: MiB per rank, "
              f"peak / saved activations (measured)")
        print(f"{'T':>7} " + " ".join(f"{m:>17}" for m, _ in MESHES))
        for seq in seqs:
            print(f"{seq:>7} " + " ".join(f"{rows[seq][m]['peak']:>8.0f} / {rows[seq][m]['saved']:>6.0f}"
                                         for m, _ in MESHES))
        print("saved activations against tp=1: " + "; ".join(
            f"T={s}: cp=2 {rows[s]['cp=2']['saved'] / rows[s]['tp=1']['saved']:.3f}, "
            f"cp=4 {rows[s]['cp=4']['saved'] / rows[s]['tp=1']['saved']:.3f}" for s in seqs))
        big, prev = seqs[-1], seqs[-2]
        slope = (rows[big]["tp=1"]["peak"] - rows[prev]["tp=1"]["peak"]) / (big - prev)   # MiB per position
        for m, ranks in MESHES:
            per_position = slope / ranks
            fixed = rows[big][m]["peak"] - per_position * big
            shared = int((budget * 1024 / ranks - fixed) / per_position)
            own = int((budget * 1024 - fixed) / per_position)
            print(f"  {m}: peak per rank ~ {fixed:.0f} MiB + {per_position * 1024:.0f} MiB per 1K positions; longest "
                  f"T ~ {shared} with its {ranks} rank(s) on this machine ({budget:.0f} GiB), ~ {own} with one "
                  f"rank per {budget:.0f} GiB machine")


if __name__ == "__main__":
    main()
