#!/usr/bin/env bash
# `meshgrad explain --config` describes a training run (issue 42): its metrics file or a checkpoint
# directory gives the model, the mesh and the parallel options (the optimizer's and the data's are not
# explain's), the command line overrides them, a named link costs them, and an FSDP unit's rows name
# the tensors they carry.
# usage: explain_config.sh MESHGRAD WORKDIR
set -euo pipefail
mg=$(realpath "$1") work=$2
rm -rf "$work" && mkdir -p "$work" && cd "$work"
fail() { echo "$1"; [ -n "${2:-}" ] && cat "$2"; exit 1; }
"$mg" train --mesh fsdp=2 --layers 1 --hidden 32 --heads 4 --seq 16 --batch 4 --steps 2 --lr 1e-3 --metrics m.jsonl \
  --checkpoint-dir ck --save-every 2 > t.log 2>&1 || fail "training failed" t.log
for source in m.jsonl ck/step_00000002; do
  "$mg" explain --config "$source" > x.log 2>&1 || fail "explain --config $source failed" x.log
  grep -q "model gpt, layers 1, hidden 32, ffn 128, heads 4, vocab 256, seq 16, batch 4" x.log ||
    fail "explain --config $source does not describe the run's model" x.log
  grep -q "^mesh fsdp=2" x.log || fail "explain --config $source does not take the run's mesh" x.log
  grep -qE "fsdp:h.0 +12 tensors: h.0.ln_1.weight" x.log || fail "the fsdp unit's rows do not name their tensors" x.log
done
"$mg" explain --config m.jsonl --mesh tp=2 --link ib-ndr > y.log 2>&1 || fail "explain with overrides failed" y.log
grep -q "^mesh tp=2" y.log || fail "the command line's --mesh does not win over the run's" y.log
grep -q "^link ib-ndr" y.log || fail "the named link is not used" y.log
if "$mg" explain --config missing.jsonl > z.log 2>&1; then fail "a missing run configuration was accepted" z.log; fi
grep -q "missing.jsonl" z.log || fail "the refusal does not name the file" z.log
echo "explain --config: all checks passed"
