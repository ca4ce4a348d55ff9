#!/usr/bin/env python3
"""Kill-and-resume soak: one training run with `--save-every 1`, killed with SIGKILL again and again
(during a step, during an async save's writing, during the commit) and each time resumed with
`--resume DIR`, must end exactly where the run never stopped ends.

Each cycle a seeded RNG picks the phase of the kill, the step it lands on and the moment within the
window. The checkpoint layer's test hook MESHGRAD_CHECKPOINT_TEST_DELAY_MS (src/checkpoint/commit.hpp)
holds the window open so that the kill lands in the phase on purpose, not by luck:
  step    no hook: once step T's checkpoint is committed, a few ms into step T+1's compute;
  write   write:MS or written:MS (drawn): every rank sleeps once the stage .step_T.tmp exists,
          before writing its files (write) or after writing and flushing them (written);
  commit  commit:MS: rank 0 sleeps once .step_T.tmp/manifest.json is written, before the rename.
Every process of the run is killed at once (mpirun and every rank under --mpi). What the kill left in
the directory tells which phase it hit, and is reported: no temporary (step), a stage without a
manifest (write), a stage with one (commit).

After every kill: the newest committed checkpoint is the one the kill allows (X-1 when the stage of
step X is left, and X must not be committed; at least T for a kill after T's commit; at least T-1
for one aimed at the save of T, whose stage it leaves when it hits) and it verifies.
At the end, after the last `--resume` runs to completion:
  - steps 1..STEPS are all committed, in commit order = step order, and every one verifies
    (`meshgrad checkpoint verify`) and holds bitwise the tensors of the uninterrupted run's
    checkpoint of the same step (the manifests' per-piece XXH3 and per-file SHA-256);
  - every metrics line of every attempt (the file continues across resumes; each resume starts with a
    header naming its first step) equals the uninterrupted run's line of that step in loss, lr and
    grad_norm, compared as the JSON text of the numbers (bitwise), and steps 1..STEPS are all there;
  - each resumed run removed the killed attempt's leftovers (a marker the soak puts in them is gone
    when the resumed run writes its metrics header, before its first step); the directory holds the
    lock and step_XXXXXXXX only (no temporaries are left), and the lock is free (flock succeeds);
  - every planned phase is hit (at least twice when planned twice or more): a kill that landed
    elsewhere (a slow machine reacts late: a kill aimed at a step lands in the next save, a stall
    outlasts a hook's window) is made up for by one more of its phase, a few at most.

usage: kill_resume_soak.py MESHGRAD WORKDIR [--cycles N] [--seed S] [--steps N] [--mesh M]
                           [--delay-ms MS] [--mpi "MPIRUN ARGS"] [--corrupt-one]
--corrupt-one flips a bit of one committed checkpoint's file before the final checks: the soak must
then fail (a check of the checker).
"""
import argparse
import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("meshgrad")
ap.add_argument("workdir")
ap.add_argument("--cycles", type=int, default=8, help="kills (each followed by --resume)")
ap.add_argument("--seed", type=int, default=1, help="seed of the phases, steps and moments of the kills")
ap.add_argument("--steps", type=int, default=0, help="steps of the run (default: enough for every kill)")
ap.add_argument("--mesh", default="tp=2", help="the mesh (2 ranks by default, both writing)")
ap.add_argument("--delay-ms", type=int, default=150, help="the hook's window for write and commit kills")
ap.add_argument("--mpi", help="run under this mpirun command line (2 processes, --backend mpi)")
ap.add_argument("--corrupt-one", action="store_true", help="flip a bit of a committed checkpoint: the soak must fail")
args = ap.parse_args()

MG = args.meshgrad
MAKE_UP = args.cycles // 3 + 1   # at most this many extra kills, for kills that landed elsewhere
# A kill gets the run 1.3 steps further on average (at most 3): twice that leaves ample room.
STEPS = args.steps or 2 * (args.cycles + MAKE_UP) + 6
# Steps of ~40 ms on 2 idle cores against saves of ~10-20 ms (fsyncs), which run beside the next step:
# the kill a few ms after a commit lands in the rest of that step, before the next save begins.
MODEL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "64", "--batch", "64", "--dropout", "0.1",
         "--warmup", "3", "--mesh", args.mesh]
if args.mpi:
    LAUNCH = args.mpi.split() + ["-np", "2", MG, "train", "--backend", "mpi"]
else:
    LAUNCH = [MG, "train"]
failures = []
fatal = False         # a failure after which the run cannot go on (the later checks are skipped)
t_start = time.time()


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    return cond


def fresh(name):
    d = os.path.join(os.path.abspath(args.workdir), name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def metrics_lines(path):
    """The metrics file as (header or None, step lines) segments, one per attempt. Numbers are kept as
    their JSON text, so that equal means bitwise equal."""
    segments = []
    with open(path) as f:
        for raw in f:
            obj = json.loads(raw, parse_float=str, parse_int=str)
            if obj.get("type") == "header":
                segments.append((obj, []))
            else:
                check(segments != [], f"{path}: a step line before any header")
                segments[-1][1].append(obj)
    return segments


BITWISE_FIELDS = ("loss", "lr", "grad_norm")
MARKER = "soak-leftover-marker"
# Seconds before a command or a wait counts as hung: generous, as shared machines stall (this one has
# stalled every process for ~45 s at a time: kernel "workqueue lockup" reports).
TIMEOUT = 300


def committed(ck):
    """`meshgrad checkpoint list` as [(step, commit, path)] in commit order (the last is what --resume
    takes); [] when nothing is committed."""
    r = subprocess.run([MG, "checkpoint", "list", ck], capture_output=True, text=True, timeout=TIMEOUT)
    out = []
    for line in r.stdout.splitlines():
        words = line.split()
        out.append((int(words[words.index("step") + 1]), int(words[words.index("commit") + 1]), words[0]))
    return out


def verify(path):
    r = subprocess.run([MG, "checkpoint", "verify", path], capture_output=True, text=True, timeout=TIMEOUT)
    return r.returncode == 0, (r.stdout + r.stderr).strip()


def tensor_hashes(step_dir):
    """What the checkpoint's bytes are: every file's SHA-256 and every piece's XXH3 by tensor."""
    with open(os.path.join(step_dir, "manifest.json")) as f:
        m = json.load(f)
    files = {f["name"]: f["sha256"] for f in m["files"]}
    pieces = {t["name"]: [p["xxh3"] for p in t["pieces"]] for t in m["tensors"]}
    return files, pieces


def wait_until(ready, proc, timeout=TIMEOUT):
    """Polls ready() while proc runs: True once it holds, False if proc ended or time ran out."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.002)
    return False


def headers(path):
    """How many attempts have opened the metrics file so far (each writes a header line first)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if '"type":"header"' in line)


def session_members(sid):
    """The live (not zombie) processes of session sid: mpirun and its ranks, which OpenMPI puts in
    process groups of their own but leaves in the session the soak started mpirun in."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()   # after "pid (comm)": state ppid pgrp session
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def kill_group(proc):
    """SIGKILL to the process and everything in its session (mpirun and every rank at once, as a lost
    node would die); waits until all are gone, so that no rank still holds the lock or writes."""
    for pid in session_members(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    deadline = time.time() + TIMEOUT
    while time.time() < deadline:
        if not session_members(proc.pid):
            return
        time.sleep(0.01)
    check(False, f"processes of session {proc.pid} survive SIGKILL for {TIMEOUT} s: {session_members(proc.pid)}")


def leftovers(ck):
    return sorted(e for e in os.listdir(ck) if e.startswith(".step_")) if os.path.isdir(ck) else []


def what_was_left(ck):
    """The phase a kill hit, from what it left: (phase, description)."""
    tmp = leftovers(ck)
    if not tmp:
        return "step", "no temporary"
    parts = []
    phase = "write"
    for t in tmp:
        inside = sorted(os.listdir(os.path.join(ck, t))) if os.path.isdir(os.path.join(ck, t)) else ["(a file)"]
        if "manifest.json" in inside:
            phase = "commit"
        parts.append(f"{t}: {', '.join(inside) or 'empty'}")
    return phase, "; ".join(parts)


root = fresh("soak_mpi" if args.mpi else "soak")
ck, metrics = os.path.join(root, "ck"), os.path.join(root, "run.jsonl")
ref_ck, ref_metrics = os.path.join(root, "ref_ck"), os.path.join(root, "ref.jsonl")
first_command = LAUNCH + MODEL + ["--steps", str(STEPS), "--save-every", "1"]
print(f"kill-and-resume soak: {args.cycles} cycles, seed {args.seed}, {STEPS} steps, mesh {args.mesh}"
      f"{', under ' + args.mpi if args.mpi else ', rank threads'}", flush=True)

# The hook refuses a malformed value: a typo in a test must not quietly drop its windows.
r = subprocess.run(first_command[:-4] + ["--steps", "2", "--save-every", "1", "--checkpoint-dir",
                                         os.path.join(root, "bad_hook"), "--no-metrics"],
                   capture_output=True, text=True, timeout=300,
                   env=dict(os.environ, MESHGRAD_CHECKPOINT_TEST_DELAY_MS="write=10"))
check(r.returncode != 0 and "MESHGRAD_CHECKPOINT_TEST_DELAY_MS" in r.stderr,
      f"a malformed MESHGRAD_CHECKPOINT_TEST_DELAY_MS was accepted (rc {r.returncode}): {r.stderr[-300:]}")

# The uninterrupted run, with the same options (its checkpoints are the bitwise reference too).
t0 = time.time()
r = subprocess.run(first_command + ["--metrics", ref_metrics, "--checkpoint-dir", ref_ck], capture_output=True,
                   text=True, timeout=600)
if not check(r.returncode == 0, f"the uninterrupted run failed: {r.stderr[-1000:]}"):
    sys.exit(1)
ref_lines = {}
for _, lines in metrics_lines(ref_metrics):
    for line in lines:
        ref_lines[int(line["step"])] = line
check(sorted(ref_lines) == list(range(1, STEPS + 1)), f"the uninterrupted run has steps {sorted(ref_lines)}")
print(f"uninterrupted run: {STEPS} steps in {time.time() - t0:.1f} s", flush=True)

# The phases, balanced and shuffled; each cycle's step and moment are drawn as it starts.
rng = random.Random(args.seed)
phases = [("step", "write", "commit")[i % 3] for i in range(args.cycles)]
rng.shuffle(phases)
hits = []             # (planned, inferred) per cycle
resumed_after = []    # the checkpoint step each resume starts from
newest = 0
log = os.path.join(root, "attempts.log")
for cycle, phase in enumerate(phases, 1):
    # The step whose save (write, commit) or whose following step (step) the kill lands in.
    # The first attempt is killed after step 1 is committed at least, so that there is one to resume.
    target = min(newest + rng.randint(2 if newest == 0 else 1, 3), STEPS - 1)
    if not check(target > newest, f"cycle {cycle}: the run is at its last step ({STEPS}): give more --steps"):
        fatal = True
        break
    env = dict(os.environ)
    point = {"step": None, "write": rng.choice(["write", "written"]), "commit": "commit"}[phase]
    if point:
        env["MESHGRAD_CHECKPOINT_TEST_DELAY_MS"] = f"{point}:{args.delay_ms}"
    command = first_command + ["--metrics", metrics, "--checkpoint-dir", ck] if newest == 0 else \
        LAUNCH + ["--resume", ck]
    attempts_so_far = headers(metrics) if newest else 0   # the first attempt starts the file afresh
    # A marker in each leftover of the killed attempt: the resumed run must remove the leftover whole
    # before its first step (a new stage of the same name has no marker; a reused one would).
    marked = [os.path.join(ck, t, MARKER) for t in leftovers(ck) if os.path.isdir(os.path.join(ck, t))]
    for m in marked:
        open(m, "w").close()
    with open(log, "a") as out:
        out.write(f"=== cycle {cycle}: {' '.join(command)}\n")
        out.flush()
        proc = subprocess.Popen(command, stdout=out, stderr=out, env=env, start_new_session=True)
    name = f"step_{target:08d}"
    if phase == "step":
        trigger = os.path.join(ck, name, "manifest.json")
        pause = rng.uniform(0.0, 0.006)
    elif phase == "write":
        trigger = os.path.join(ck, "." + name + ".tmp")
        pause = rng.uniform(0.1, 0.7) * args.delay_ms / 1000
    else:
        trigger = os.path.join(ck, "." + name + ".tmp", "manifest.json")
        pause = rng.uniform(0.1, 0.7) * args.delay_ms / 1000
    # The attempt's saver has taken the lock and removed the killed one's leftovers once its metrics
    # file has one more header (a run opens its metrics last), so a leftover stage of the same name
    # is not taken for the new save's.
    opened = wait_until(lambda: headers(metrics) >= attempts_so_far + 1, proc)
    kept = [m for m in marked if os.path.exists(m)]
    check(not kept, f"cycle {cycle}: the resumed run started without removing the killed attempt's leftovers: {kept}")
    reached = opened and wait_until(lambda: os.path.exists(trigger), proc)
    if reached:
        time.sleep(pause)
    kill_group(proc)
    if not check(reached and proc.returncode == -signal.SIGKILL,
                 f"cycle {cycle}: the run ended (rc {proc.returncode}) before {trigger} appeared; see {log}"):
        fatal = True
        break
    inferred, left = what_was_left(ck)
    hits.append((phase, inferred))
    # A kill may land elsewhere when the machine is slow to react (one aimed at a step lands in the
    # next save; a stall outlasts a hook's window; a watcher starved past the window sees the trigger
    # so late that the kill lands in the same phase of a later save): still a fair kill, and one more
    # of the phase is planned in its place (MAKE_UP at most: a phase the kills keep missing fails the
    # coverage check at the end).
    stage_steps = [int(t[len(".step_"):len(".step_") + 8]) for t in leftovers(ck)]
    late = phase != "step" and any(x > target for x in stage_steps)
    if (inferred != phase or late) and len(phases) < args.cycles + MAKE_UP:
        phases.append(phase)
    now = committed(ck)
    check(now != [], f"cycle {cycle}: nothing is committed after the kill")
    newest_step = now[-1][0] if now else 0
    # Saves run one at a time (a save waits for the one before): a stage left for step X means X is
    # not committed and X-1 is the newest. Step T was committed before a step kill; T-1 before a save
    # kill aimed at T, which must have left T's stage if it hit its phase.
    for t in leftovers(ck):
        x = int(t[len(".step_"):len(".step_") + 8])
        check(not os.path.exists(os.path.join(ck, f"step_{x:08d}")), f"cycle {cycle}: {t} is left, yet step {x} "
              f"is committed (a kill inside a save left both)")
        check(newest_step == x - 1, f"cycle {cycle}: {t} is left, yet the newest committed step is {newest_step}")
        # The trigger of save `target` appeared before the kill, so no earlier save's stage can be left.
        check(inferred != phase or phase == "step" or x >= target,
              f"cycle {cycle}: aimed at the save of step {target}, the kill left {t}, an earlier save's stage")
    floor = target if phase == "step" else target - 1
    check(newest_step >= floor, f"cycle {cycle}: newest committed step {newest_step}, but step {floor} was committed "
          f"before the kill")
    ok, text = verify(ck)
    check(ok, f"cycle {cycle}: the newest checkpoint does not verify after the kill: {text}")
    where = f"step {target + 1}" if phase == "step" else f"save {target}, hook {point}"
    print(f"cycle {cycle:2d}/{len(phases)}: planned {phase:6s} hit {inferred:6s} ({where}, +{pause * 1000:.0f} ms): "
          f"left {left}; newest committed step {newest_step}", flush=True)
    resumed_after.append(newest_step)
    newest = newest_step

# The last resume, without the hook, runs to the end.
if not fatal:
    with open(log, "a") as out:
        out.write("=== final resume\n")
        out.flush()
        r = subprocess.run(LAUNCH + ["--resume", ck], stdout=out, stderr=out, timeout=600, start_new_session=True)
    fatal = not check(r.returncode == 0, f"the final --resume failed (rc {r.returncode}); see {log}")

if args.corrupt_one and not fatal:
    victim = os.path.join(ck, "step_00000001")
    rank_file = sorted(f for f in os.listdir(victim) if f.endswith(".bin"))[0]
    with open(os.path.join(victim, rank_file), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    print(f"--corrupt-one: flipped a bit of {victim}/{rank_file} at offset 100", flush=True)

if not fatal:
    # Every step committed once more, in order, verified, and bitwise the uninterrupted run's.
    final = committed(ck)
    steps = [s for s, _, _ in final]
    check(steps == list(range(1, STEPS + 1)),
          f"committed steps in commit order {steps}, expected 1..{STEPS} (lost or out-of-order checkpoints)")
    commits = [c for _, c, _ in final]
    check(commits == sorted(set(commits)), f"commit numbers not strictly increasing: {commits}")
    other_bytes = []   # (step, the first tensor or file that differs)
    for step, _, path in final:
        ok, text = verify(path)
        check(ok, f"{path} does not verify: {text}")
        ref_path = os.path.join(ref_ck, os.path.basename(path))
        (files, pieces), (ref_files, ref_pieces) = tensor_hashes(path), tensor_hashes(ref_path)
        differs = [t for t in sorted(set(pieces) | set(ref_pieces)) if pieces.get(t) != ref_pieces.get(t)]
        differs += [f for f in sorted(set(files) | set(ref_files)) if files.get(f) != ref_files.get(f)]
        if differs:
            other_bytes.append((step, differs[0]))
    check(not other_bytes, f"{len(other_bytes)} checkpoints hold other bytes than the uninterrupted run's of the same "
          f"step (in {ref_ck}); the first: step {other_bytes[0][0] if other_bytes else ''}, "
          f"{other_bytes[0][1] if other_bytes else ''}")

    # Every attempt's every line is the uninterrupted run's; the file continues across resumes.
    segments = metrics_lines(metrics)
    other_lines = []
    check(len(segments) == len(resumed_after) + 1,
          f"{len(segments)} metrics headers for {len(resumed_after) + 1} attempts (every resume appends one)")
    for i, (header, lines) in enumerate(segments):
        if i > 0 and i - 1 < len(resumed_after):
            check(header.get("first_step") == str(resumed_after[i - 1] + 1),
                  f"attempt {i + 1}: header first_step {header.get('first_step')}, resumed after step "
                  f"{resumed_after[i - 1]}")
        first = int(header.get("first_step", "1"))
        got = [int(line["step"]) for line in lines]
        check(got == list(range(first, first + len(got))), f"attempt {i + 1}: steps {got} do not run on from {first}")
        for line in lines:
            step = int(line["step"])
            want = ref_lines.get(step, {})
            diff = [f"{k} {line.get(k)} != {want.get(k)}" for k in BITWISE_FIELDS if line.get(k) != want.get(k)]
            if diff:
                other_lines.append(f"attempt {i + 1}, step {step}: {', '.join(diff)}")
    check(not other_lines, f"{len(other_lines)} metrics lines differ from the uninterrupted run's (bitwise): "
          f"{'; '.join(other_lines[:3])}{' ...' if len(other_lines) > 3 else ''}")
    last = {int(line["step"]): line for _, lines in segments for line in lines}
    check(sorted(last) == list(range(1, STEPS + 1)), f"the metrics end with steps {sorted(last)}")
    check(last.get(STEPS, {}).get("loss") == ref_lines[STEPS]["loss"], "the final loss differs")

    # Nothing left behind, the lock free.
    extra = sorted(e for e in os.listdir(ck) if e != ".lock" and not (e.startswith("step_") and len(e) == 13))
    check(extra == [], f"left in {ck} after the run completed: {extra}")
    with open(os.path.join(ck, ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            check(False, f"{ck}/.lock is still held after every run ended")

planned = {p: sum(1 for q in phases[:args.cycles] if q == p) for p in ("step", "write", "commit")}
hit = {p: sum(1 for _, q in hits if q == p) for p in ("step", "write", "commit")}
for p in planned:
    check(hit[p] >= min(2, planned[p]), f"phase {p} planned {planned[p]} times, hit {hit[p]} times")
missed = [(c + 1, q, h) for c, (q, h) in enumerate(hits) if q != h]
print(f"phases hit: {hit} (planned {planned}; {len(missed)} landed elsewhere, made up for: {missed})")
print(f"{len(hits)} kills, {STEPS} steps, {time.time() - t_start:.1f} s in all; attempts' output in {log}")
if failures:
    print(f"{len(failures)} failure(s)")
    sys.exit(1)
print(f"soak passed: every checkpoint verifies and equals the uninterrupted run's, every loss is bitwise the same")
