#!/usr/bin/env python3
"""Checkpoints of `meshgrad train` as a user meets them, with real processes and real signals:

1. SIGKILL: a run killed right after a checkpoint resumes with `--resume DIR`, and the losses of the
   resumed steps are bit for bit those of the run never stopped (dropout on). Compared as the JSON
   text of the doubles, which meshgrad writes with round-trip precision.
2. A kill in the middle of a save (MESHGRAD_CHECKPOINT_FAULT=before-rename exits as SIGKILL would,
   after the files and the manifest are written but before the rename): the earlier checkpoints are
   intact, nothing is under the new step's name, and the next run cleans the leftover up and resumes.
3. SIGTERM: the run finishes its step, writes a checkpoint, exits 0 naming it; resuming completes the
   run with the same losses. A second SIGINT while the first is handled aborts.
4. Random kills: killed at random moments while saving every step, every committed checkpoint
   verifies (`meshgrad checkpoint verify`).

5. With --mpi MPIRUN: the same checkpoint written by MPI processes (np 2, tp=2) resumes bitwise under
   MPI and resharded on rank threads (tp=1), and SIGTERM to mpirun checkpoints and exits 0.

usage: checkpoint_cli.py MESHGRAD WORKDIR [--mpi MPIRUN]
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

MG, WORK = sys.argv[1], sys.argv[2]
MPIRUN = sys.argv[4].split() if len(sys.argv) > 4 and sys.argv[3] == "--mpi" else None
MODEL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "4", "--dropout", "0.1",
         "--warmup", "3", "--mesh", "tp=2"]
STEPS = 40
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)


def losses(path):
    """{step: loss as its JSON text} of the last line per step (a resumed run appends)."""
    out = {}
    with open(path) as f:
        for line in f:
            raw = json.loads(line)
            if "loss" in raw:
                # The text of the number, not a float: bitwise comparison.
                text = line.split('"loss":', 1)[1].split(",", 1)[0].strip()
                out[raw["step"]] = text
    return out


def wait_for(path, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.01)
    return False


def fresh(name):
    d = os.path.join(WORK, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def run(args, **kw):
    return subprocess.run([MG, "train"] + args, capture_output=True, text=True, timeout=300, **kw)


def mpi_checks():
    root = fresh("mpi")
    mpi = MPIRUN + ["-np", "2", MG, "train", "--backend", "mpi"]
    ref = os.path.join(root, "ref.jsonl")
    r = subprocess.run(mpi + MODEL + ["--steps", "12", "--metrics", ref], capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, f"mpi reference: {r.stderr[-500:]}")
    ck = os.path.join(root, "ck")
    r = subprocess.run(mpi + MODEL + ["--steps", "12", "--metrics", os.path.join(root, "a.jsonl"), "--checkpoint-dir", ck,
                                      "--save-every", "6"], capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, f"mpi checkpointed run: {r.stderr[-500:]}")
    shutil.rmtree(os.path.join(ck, "step_00000012"))
    out = os.path.join(root, "b.jsonl")
    r = subprocess.run(mpi + ["--resume", ck, "--metrics", out], capture_output=True, text=True, timeout=300)
    check(r.returncode == 0, f"mpi resume: {r.stderr[-500:]}")
    a, b = losses(ref), losses(out)
    check(len(b) == 6 and all(b[s] == a[s] for s in b), f"mpi resume not bitwise: {b} vs {a}")
    # Written by MPI processes at tp=2, resumed on one rank thread.
    shutil.rmtree(os.path.join(ck, "step_00000012"))
    out = os.path.join(root, "c.jsonl")
    r = run(["--resume", ck, "--mesh", "tp=1", "--metrics", out])
    check(r.returncode == 0, f"threads resume of an mpi checkpoint: {r.stderr[-500:]}")
    c = losses(out)
    check(len(c) == 6 and all(abs(float(c[s]) - float(a[s])) < 1e-4 for s in c), f"resharded mpi resume: {c} vs {a}")
    # SIGTERM to mpirun reaches the ranks: they checkpoint together and exit 0.
    ck = os.path.join(root, "ck_term")
    metrics = os.path.join(root, "t.jsonl")
    p = subprocess.Popen(mpi + MODEL + ["--steps", "2000", "--metrics", metrics, "--checkpoint-dir", ck],
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and (not os.path.exists(metrics) or len(losses(metrics)) < 3):
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    # mpirun forwards the signal to the ranks and then exits 1 itself (OpenMPI's convention for a
    # signalled job), whatever the ranks return: the ranks' message and the checkpoint are the test.
    check("stopped by SIGTERM" in err, f"mpi SIGTERM: rc {p.returncode} {err[-500:]}")
    check(len([d for d in os.listdir(ck) if d.startswith("step_")]) == 1, f"mpi SIGTERM checkpoints: {os.listdir(ck)}")


if MPIRUN:
    mpi_checks()
    if failures:
        print(f"{len(failures)} failure(s)")
        sys.exit(1)
    print("all MPI checkpoint checks passed")
    sys.exit(0)

root = fresh("")
reference = os.path.join(root, "reference.jsonl")
r = run(MODEL + ["--steps", str(STEPS), "--metrics", reference])
check(r.returncode == 0, f"reference run failed: {r.stderr}")
ref = losses(reference)
check(len(ref) == STEPS, f"reference has {len(ref)} steps")

# 1. SIGKILL after a checkpoint, then resume.
ck = os.path.join(root, "ck_kill")
metrics = os.path.join(root, "kill.jsonl")
p = subprocess.Popen([MG, "train"] + MODEL + ["--steps", str(STEPS), "--metrics", metrics, "--checkpoint-dir", ck,
                                              "--save-every", "10"], stderr=subprocess.DEVNULL)
check(wait_for(os.path.join(ck, "step_00000010", "manifest.json"), p), "no checkpoint at step 10 before the kill")
p.send_signal(signal.SIGKILL)
p.wait()
check(p.returncode == -signal.SIGKILL, f"the run was not killed (rc {p.returncode})")
r = run(["--resume", ck])
check(r.returncode == 0, f"resume after SIGKILL failed: {r.stderr}")
resumed = losses(metrics)
newest = sorted(d for d in os.listdir(ck) if d.startswith("step_"))
check(newest[-1] == "step_00000040", f"the resumed run's checkpoints: {newest}")
for step in range(1, STEPS + 1):
    if step not in resumed or resumed[step] != ref[step]:
        check(False, f"SIGKILL + resume: step {step} loss {resumed.get(step)} != uninterrupted {ref[step]}")
        break

# 2. Killed during a save, between the files and the rename.
ck = os.path.join(root, "ck_fault")
r = run(MODEL + ["--steps", "12", "--metrics", os.path.join(root, "f.jsonl"), "--checkpoint-dir", ck, "--save-every",
                 "4", "--sync-checkpoints"], env=dict(os.environ, MESHGRAD_CHECKPOINT_FAULT="before-rename"))
check(r.returncode == 137, f"the fault did not end the run like a kill (rc {r.returncode}): {r.stderr[-500:]}")
entries = sorted(os.listdir(ck))
check("step_00000004" not in entries, f"a checkpoint killed before its rename is under its final name: {entries}")
check(any(e.startswith(".step_00000004.tmp") for e in entries), f"no leftover of the killed save: {entries}")
# With a committed earlier checkpoint: save at 4 normally, then fault at 8.
shutil.rmtree(ck)
r = run(MODEL + ["--steps", "6", "--metrics", os.path.join(root, "f.jsonl"), "--checkpoint-dir", ck, "--save-every",
                 "4"])
check(r.returncode == 0, f"run to 6 failed: {r.stderr}")
before = open(os.path.join(ck, "step_00000004", "manifest.json")).read()
r = run(["--resume", os.path.join(ck, "step_00000004"), "--steps", "12", "--save-every", "4"],
        env=dict(os.environ, MESHGRAD_CHECKPOINT_FAULT="before-rename"))
check(r.returncode == 137, f"fault run rc {r.returncode}")
check(open(os.path.join(ck, "step_00000004", "manifest.json")).read() == before, "the earlier checkpoint changed")
check(subprocess.run([MG, "checkpoint", "verify", os.path.join(ck, "step_00000004")]).returncode == 0,
      "the earlier checkpoint no longer verifies")
check(not os.path.exists(os.path.join(ck, "step_00000008")), "the killed save left step_00000008")
r = run(["--resume", ck, "--steps", "12"])
check(r.returncode == 0, f"resume after the killed save failed: {r.stderr}")
check(not any(e.startswith(".step_") for e in os.listdir(ck)), f"leftovers not cleaned: {os.listdir(ck)}")

# 3. SIGTERM: checkpoint, exit 0 naming it, resume to the end with the same losses.
ck = os.path.join(root, "ck_term")
metrics = os.path.join(root, "term.jsonl")
p = subprocess.Popen([MG, "train"] + MODEL + ["--steps", "400", "--metrics", metrics, "--checkpoint-dir", ck],
                     stderr=subprocess.PIPE, text=True)
deadline = time.time() + 60
while time.time() < deadline and (not os.path.exists(metrics) or len(losses(metrics)) < 5):
    time.sleep(0.01)
p.send_signal(signal.SIGTERM)
_, err = p.communicate(timeout=120)
check(p.returncode == 0, f"SIGTERM: rc {p.returncode}, stderr {err[-500:]}")
stopped = [l for l in err.splitlines() if "stopped by SIGTERM" in l]
check(len(stopped) == 1 and "step_" in stopped[0], f"SIGTERM: no message naming the checkpoint: {err[-500:]}")
done = len(losses(metrics))
check(os.path.exists(os.path.join(ck, f"step_{done:08d}", "manifest.json")), f"no checkpoint after step {done}")
r = run(["--resume", ck])
check(r.returncode == 0, f"resume after SIGTERM failed: {r.stderr}")
long_ref = os.path.join(root, "term_ref.jsonl")
r = run(MODEL + ["--steps", "400", "--metrics", long_ref])
term, full = losses(metrics), losses(long_ref)
check(len(term) == 400 and all(term[s] == full[s] for s in full),
      "SIGTERM + resume: the losses differ from the uninterrupted run's")

# Second SIGINT aborts.
ck = os.path.join(root, "ck_int")
# Steps of about a second: the second signal lands while the first step is still running.
BIGGER = ["--layers", "6", "--hidden", "384", "--heads", "6", "--seq", "128", "--batch", "8", "--mesh", "tp=2"]
p = subprocess.Popen([MG, "train"] + BIGGER + ["--steps", "400",
                                              "--metrics", os.path.join(root, "int.jsonl"), "--checkpoint-dir", ck],
                     stderr=subprocess.DEVNULL,
                     # The stop's checkpoint held open 5 s (the test-only hook of src/checkpoint/commit.hpp):
                     # the second signal lands while the first is handled even when the first came at the
                     # end of a step (the run then stopped and saved within the 0.1 s, rc 0, now and then).
                     env=dict(os.environ, MESHGRAD_CHECKPOINT_TEST_DELAY_MS="write:5000"))
deadline = time.time() + 60
while time.time() < deadline and not (os.path.exists(os.path.join(root, "int.jsonl")) and
                                      len(losses(os.path.join(root, "int.jsonl"))) >= 1):
    time.sleep(0.01)
p.send_signal(signal.SIGINT)
time.sleep(0.1)   # two signals sent at once may arrive as one
p.send_signal(signal.SIGINT)
p.wait(timeout=60)
check(p.returncode == -signal.SIGINT, f"a second SIGINT did not abort (rc {p.returncode})")

# 4. Random kills while saving every step: whatever is committed verifies.
ck = os.path.join(root, "ck_random")
rng = random.Random(7)
for attempt in range(6):
    p = subprocess.Popen([MG, "train"] + MODEL + ["--steps", "200", "--metrics", os.path.join(root, "rnd.jsonl"),
                                                  "--checkpoint-dir", ck, "--save-every", "1", "--keep", "3"],
                         stderr=subprocess.DEVNULL)
    time.sleep(0.3 + rng.random() * 1.5)
    p.send_signal(signal.SIGKILL)
    p.wait()
    for d in sorted(os.listdir(ck)):
        if d.startswith("step_"):
            v = subprocess.run([MG, "checkpoint", "verify", os.path.join(ck, d)], capture_output=True, text=True)
            check(v.returncode == 0, f"attempt {attempt}: {d} does not verify: {v.stderr}")

if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print("all checkpoint CLI checks passed")
