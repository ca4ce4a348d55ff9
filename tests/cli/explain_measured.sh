#!/usr/bin/env bash
# explain --link measured on a 2-rank threads mesh: the header prints a measured link (alpha >= 0 us,
# beta > 0 GB/s, the sizes probed, measured and fitted times, the fit's residual), the probe says how long it took,
# and every row is costed on the fitted figures (the json's full-precision alpha and beta give each
# row's predicted time back). Run by ctest as cli_explain_measured.
# usage: explain_measured.sh MESHGRAD WORKDIR
set -euo pipefail
mg=$1 work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work"
fail() { echo "FAIL: $1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
small=(--model mlp --layers 2 --hidden 64 --seq 16 --batch 4 --mesh tp=2)

"$mg" explain "${small[@]}" --link measured >t.txt 2>&1 || fail "explain --link measured" t.txt
python3 - t.txt <<'PY' || fail "the table's measured link" t.txt
import re, sys
text = open(sys.argv[1]).read()
m = re.search(r"^link measured: alpha (\S+) us per step, beta (\S+) GB/s per rank \(fitted to the ring all-reduce "
              r"t = 2\(n-1\)\(alpha \+ bytes/\(n beta\)\) of this run's 2 ranks, threads backend", text, re.M)
assert m, "no measured link line"
alpha, beta = float(m.group(1)), float(m.group(2))
# alpha >= 0: a loaded machine (the sanitizer runs) can time the small sizes slower than the large,
# and the fit then clamps alpha at 0 (said in the header); the rows must still be costed on it.
assert alpha >= 0 and beta > 0, (alpha, beta)
p = re.search(r"^  probe: float32 all_reduce on 2 ranks \(threads backend\) of 7 sizes: 1.0 KiB, 4.0 KiB, 16.0 KiB, "
              r"64.0 KiB, 256.0 KiB, 1.0 MiB, 4.0 MiB; .*; (\S+) s$", text, re.M)
assert p, "no probe line with the sizes"
assert float(p.group(1)) > 0, "the probe took %s s" % p.group(1)   # how long is the benchmark's business, not a test's
for label in ("bytes", "measured us", "fitted us"):
    assert re.search(r"^  %s( +[0-9.]+){7}$" % label, text, re.M), "no %s line of 7 values" % label
r = re.search(r"^  fit residual: rms (\S+)%, max (\S+)% of the measured times", text, re.M)
assert r and 0 <= float(r.group(1)) <= float(r.group(2)), "no fit residual line"
# The rows: an all_reduce over tp (n = 2) costs 2 alpha + bytes / beta (ring; the header's alpha and
# beta are rounded to 6 digits, the table's times to 0.01 us).
rows = re.findall(r"\s(all_reduce)\s+tp\s+2\s+\S+ \S+\s+(\d+) ring\s+([0-9.]+)$", text, re.M)
assert len(rows) >= 4, "found %d tp all_reduce rows" % len(rows)
for op, nbytes, us in rows:
    want = 2 * alpha + int(nbytes) / (beta * 1e3)
    assert abs(float(us) - want) <= 0.006 + 1e-5 * want, (nbytes, us, want)
assert "(predicted on measured:" in text
print("table: alpha %g us, beta %g GB/s, probe %s s, residual rms %s%%, %d rows checked"
      % (alpha, beta, p.group(1), r.group(1), len(rows)))
PY

"$mg" explain "${small[@]}" --link measured --format json >j.json 2>j.err || fail "explain --link measured --format json" j.err
python3 - j.json <<'PY' || fail "the json's measured link" j.json
import json, sys
rows = json.load(open(sys.argv[1]))
assert rows, "no rows"
checked = 0
for row in rows:
    link = row["link"]
    assert link["name"] == "measured" and link["alpha_us"] >= 0 and link["beta_gbs"] > 0, link
    m = link["measurement"]
    assert m["ranks"] == 2 and m["backend"] == "threads" and len(m["sizes_bytes"]) == 7, m
    assert m["seconds"] > 0, m["seconds"]
    if row["op"] == "all_reduce" and row["axis"] == "tp":
        want = 2 * link["alpha_us"] + row["bytes"] / (link["beta_gbs"] * 1e3)
        assert abs(row["predicted_us"] - want) <= 1e-9 * want, (row, want)
        checked += 1
assert checked >= 4, checked
print("json: %d rows carry the measured link, %d costed on it" % (len(rows), checked))
PY
echo "explain --link measured: a measured link on 2 rank threads, rows costed on it"
