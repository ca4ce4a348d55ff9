#!/usr/bin/env python3
"""`meshgrad train --backend mpi` across two hosts that talk over TCP only.

The two hosts are network namespaces made here (`ip netns`), each with its own host name (a UTS
namespace), joined by a veth pair (10.77.0.1 <-> 10.77.0.2) and by a second, slow link with latency
and loss (10.77.1.1 <-> 10.77.1.2, tests/cli/multihost_link.py). mpirun runs on host 1 and starts
the rank of host 2 through a small rsh agent (what ssh is on a cluster: `agent HOST COMMAND`) that
enters host 2's namespaces. Only TCP carries MPI traffic: `--mca pml ob1 --mca btl tcp,self` (no
shared memory, no UCX) with the interfaces restricted to the link's subnet. Checked:

1. Where the ranks ran: each rank records its host name, network namespace and pid before it
   becomes meshgrad: rank 0 on host 1, rank 1 on host 2, in the namespaces made here. The MPI
   traffic crossed the link (the veth's byte counters), OpenMPI selected no btl but tcp and self,
   and its tcp btl used no interface but the veth.
2. tp=2 and dp=2 across the hosts: every step's loss and gradient norm equal, bit for bit (the JSON
   text of the doubles), those of the same run on rank threads of one process.
3. Checkpoints: the tp=2 run saves every 4 steps into one folder both hosts write (a shared file
   system: `ip netns exec` gives a process its own mount namespace only to remount /sys; every other
   mount, this folder's included, is the root namespace's, as an NFS export is every node's). Each
   checkpoint holds both ranks' files and passes `meshgrad checkpoint verify`, and a resume from step
   4 under mpirun across the hosts gives the remaining steps bit for bit.
4. Latency and loss (5 ms each way, 1% of the frames dropped each way: what `tc qdisc ... netem
   delay 5ms loss 1%` on both ends does): tp=2 still equals the threads run bit for bit, and the link
   counted the frames it carried and dropped. Step times are printed, never asserted (a test must not
   depend on the machine's speed).
5. A host's rank killed (SIGKILL to rank 1 on host 2, MESHGRAD_COMM_TIMEOUT_MS=5000 handed to the
   remote host with -x as on a cluster): under plain mpirun the job ends at once, rank 0 gone, mpirun
   naming rank 1 as killed; under `mpirun --enable-recovery` (which lets the survivor run on) rank 0
   stops with meshgrad's deadline error. Both within the deadline plus 10 s. (Under load OpenMPI
   sometimes ends the survivor itself before its deadline, silently: that attempt is run again, up to
   3 times; see kill_test.)

Where the machine cannot make network namespaces (not root, no CAP_SYS_ADMIN / CAP_NET_ADMIN, a
container without them) the test exits 77, which ctest reports as skipped, saying why; likewise,
after every other check passed, when /dev/net/tun (the slow link) cannot be opened. Every other
failure (of ip, of mpirun, of a run) fails the test.

  multihost.py MESHGRAD WORKDIR MPIRUN                      the test (about 20 s on 2 cores)
  multihost.py MESHGRAD WORKDIR MPIRUN --bench [--steps N] [--repeats R] [--meshes 'tp=2;dp=2;pp=2']
               [--pp-micro-batches M]
      step times of N-step runs (default 40), R of each (default 3), on each link, as a table
      (docs/BENCHMARKS.md)
  multihost.py --cleanup
      removes the namespaces of runs that were killed before they could remove them (ctest runs it
      after the test, as a fixture's clean-up: its timeout kills the test with SIGKILL)

Clean-up: on success, a failure, an exception, SIGTERM or SIGINT the test removes its namespaces
(and with them the veth) and stops the slow link (whose TAP devices vanish with it). Every process it
starts gets SIGTERM if the test itself dies (PR_SET_PDEATHSIG), so after a SIGKILL only the empty
namespaces stay behind, for the next run or `--cleanup` to remove.
"""
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
CLEANUP = sys.argv[1:] == ["--cleanup"]
MG, WORK, MPIRUN = (None, None, None) if CLEANUP else (sys.argv[1], os.path.abspath(sys.argv[2]), sys.argv[3])
BENCH = "--bench" in sys.argv[4:]
BENCH_STEPS = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 40
BENCH_REPEATS = int(sys.argv[sys.argv.index("--repeats") + 1]) if "--repeats" in sys.argv else 3
# The meshes the bench compares (";"-separated); a pp mesh runs its batch as BENCH_PP_MICRO micro-batches.
BENCH_MESHES = (sys.argv[sys.argv.index("--meshes") + 1] if "--meshes" in sys.argv else "tp=2;dp=2").split(";")
BENCH_PP_MICRO = int(sys.argv[sys.argv.index("--pp-micro-batches") + 1]) if "--pp-micro-batches" in sys.argv else 2
# A tiny model with dropout (the masks must agree across hosts too): a few ms a step on rank threads.
MODEL = ["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "16", "--batch", "4", "--dropout", "0.1",
         "--warmup", "3"]
STEPS = 8
DEADLINE_MS = 5000
# Subnets of the two links: .1 is host 1, .2 host 2.
LINKS = {"veth": "10.77.0", "slow": "10.77.1"}
DELAY_MS, LOSS = 5, 0.01
failures = []


class Skip(Exception):
    pass


def check(cond, what):
    if not cond:
        failures.append(what)
        print("FAIL:", what, flush=True)
    return cond


def die_with_parent():
    """preexec_fn of every process the test starts: SIGTERM to it when the test dies, even by SIGKILL
    (mpirun then stops its job on both hosts; the slow link's TAP devices go with the link process).
    It stays set across exec (ip netns exec, unshare and sh exec mpirun, all as the same root)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def own_group():
    """preexec_fn of a run: its own process group, for killpg, but in the test's session. Not a
    session of its own (setsid): the kernel schedules each session as one group (autogroup), and a
    test alone in a session that mostly sleeps while it polls gets so small a share beside the
    ranks' busy session that on a loaded machine it was not scheduled for 60-117 s while the
    ranks ran on (the kill test's 100,000-step run finished before the test could kill it)."""
    os.setpgid(0, 0)
    die_with_parent()


def sh(*args, ok=True):
    """Runs a command of the set-up (ip, ...); a failure stops the test naming the command."""
    r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    if ok and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed (rc {r.returncode}): {r.stderr.strip()}")
    return r


def run(cmd, label, env=None, timeout=60):
    """Runs cmd in its own process group; on a timeout the whole group is killed, not only mpirun."""
    t0 = time.time()
    # stdin: mpirun forwards its standard input to rank 0, and a process group that is not the
    # terminal's foreground one is stopped (SIGTTIN) when it reads the terminal.
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, preexec_fn=own_group)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        err += f"\n(killed after {timeout} s)"
    except BaseException:   # SIGTERM's SystemExit, SIGINT: nothing of this run outlives the test
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    print(f"{time.time() - t0:6.1f} s  {label}", flush=True)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def metrics(path):
    """{step: (loss, grad_norm) as the JSON text of the numbers} and {step: elapsed_s}; a resumed
    run's file starts with a header line without a loss."""
    texts, elapsed = {}, {}
    with open(path) as f:
        for line in f:
            raw = json.loads(line)
            if "loss" in raw:
                # The text, not the float: a bitwise comparison.
                loss = line.split('"loss":', 1)[1].split(",", 1)[0].strip()
                norm = line.split('"grad_norm":', 1)[1].split(",", 1)[0].strip().rstrip("}")
                texts[raw["step"]] = (loss, norm)
                elapsed[raw["step"]] = raw["elapsed_s"]
    return texts, elapsed


def steps_so_far(path):
    """How many steps a running job's metrics file holds, from its first 64 KiB only: the file grows by
    a line a millisecond, and on a loaded machine a reader that follows it to its end may not get
    there before the run does (seen: 48 s to read 100,000 lines)."""
    try:
        with open(path, "rb") as f:
            return f.read(65536).count(b'"loss":')
    except FileNotFoundError:
        return 0


def same_steps(got, want, what, steps):
    """Every step of `steps` in got equals want's, bit for bit."""
    for s in steps:
        if s not in got or got[s] != want.get(s):
            return check(False, f"{what}: step {s} (loss, grad norm) {got.get(s)} != threads {want.get(s)}")
    return True


def step_times_ms(elapsed):
    """Per-step wall times from the cumulative elapsed_s, the first step (start-up) left out."""
    steps = sorted(elapsed)
    return [1000 * (elapsed[b] - elapsed[a]) for a, b in zip(steps, steps[1:])]


class Hosts:
    """Two network namespaces, a veth pair and a slow link between them; removed again on exit,
    whatever happened. Names carry this process's pid, so concurrent runs do not meet, and
    namespaces of an earlier run that was killed before it could clean up are removed first."""

    def __init__(self, work):
        self.tag = f"mghost{os.getpid()}"
        self.ns = [f"{self.tag}-1", f"{self.tag}-2"]
        self.names = [f"{self.tag}-h1", f"{self.tag}-h2"]   # host names (UTS namespaces)
        self.veth = [f"mgv{os.getpid()}a", f"mgv{os.getpid()}b"]   # at most 15 bytes
        self.work = work
        self.link = None
        self.no_slow_link = None   # why the slow link cannot be made here, if it cannot

    def __enter__(self):
        remove_stale_namespaces()
        r = sh("ip", "netns", "add", self.ns[0], ok=False)
        if r.returncode != 0:
            if re.search(r"Permission denied|Operation not permitted", r.stderr):
                raise Skip(f"this machine cannot make network namespaces (`ip netns add` as uid {os.getuid()}: "
                           f"{r.stderr.strip()}); the test needs root, or CAP_SYS_ADMIN and CAP_NET_ADMIN")
            raise RuntimeError(f"`ip netns add {self.ns[0]}` failed: {r.stderr.strip()}")
        try:
            sh("ip", "netns", "add", self.ns[1])
            sh("ip", "link", "add", self.veth[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.veth[1],
               "netns", self.ns[1])
            for i in (0, 1):
                sh("ip", "-n", self.ns[i], "link", "set", "lo", "up")
                sh("ip", "-n", self.ns[i], "addr", "add", f"{LINKS['veth']}.{i + 1}/24", "dev", self.veth[i])
                sh("ip", "-n", self.ns[i], "link", "set", self.veth[i], "up")
            try:
                os.close(os.open("/dev/net/tun", os.O_RDWR))
            except OSError as e:
                self.no_slow_link = f"/dev/net/tun cannot be opened ({e.strerror})"
            self.write_scripts()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def start_slow_link(self, delay_ms, loss):
        """The link between LINKS['slow'].1 and .2, replacing the one before."""
        self.stop_slow_link()
        ready = os.path.join(self.work, "link.ready")
        if os.path.exists(ready):
            os.remove(ready)
        self.link_out = open(os.path.join(self.work, "link.out"), "w+")
        self.link = subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_link.py"),
                                      self.ns[0], f"{LINKS['slow']}.1/24", self.ns[1], f"{LINKS['slow']}.2/24",
                                      "--delay-ms", str(delay_ms), "--loss", str(loss), "--seed", "1",
                                      "--ready", ready], stdout=self.link_out, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=die_with_parent)
        deadline = time.time() + 20
        while not os.path.exists(ready):
            if self.link.poll() is not None or time.time() > deadline:
                self.link_out.seek(0)
                raise RuntimeError(f"the slow link did not come up: {self.link_out.read().strip()}")
            time.sleep(0.05)

    def stop_slow_link(self):
        """Stops the slow link; returns its counts {"frames", "bytes", "dropped"}."""
        if self.link is None:
            return {}
        self.link.send_signal(signal.SIGTERM)
        self.link.wait(timeout=20)
        self.link = None
        self.link_out.seek(0)
        lines = self.link_out.read().strip().splitlines()
        self.link_out.close()
        return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}

    def write_scripts(self):
        """The rsh agent: OpenMPI runs `AGENT HOST COMMAND...` to start its daemon (orted) on a host,
        as it would run ssh; this one maps HOST (an address of either link) to its namespaces and
        runs COMMAND there under the host's name. mpirun's environment reaches it, as ssh's would
        not: the runs hand variables over with -x, as on a cluster."""
        self.agent = os.path.join(self.work, "agent.sh")
        cases = "\n".join(f"  {LINKS['veth']}.{i + 1}|{LINKS['slow']}.{i + 1}) ns={self.ns[i]}; name={self.names[i]} ;;"
                          for i in (0, 1))
        with open(self.agent, "w") as f:
            f.write(f"""#!/bin/sh
host=$1; shift
case "$host" in
{cases}
  *) echo "multihost agent: no namespace for host '$host'" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$1" && exec sh -c "$2"' sh "$name" "$*"
""")
        os.chmod(self.agent, 0o755)
        # Each rank records where it runs (host name, network namespace, pid), then becomes meshgrad.
        self.rank_sh = os.path.join(self.work, "rank.sh")
        with open(self.rank_sh, "w") as f:
            f.write('#!/bin/sh\nout=$1; shift\n'
                    'echo "$(hostname) $(readlink /proc/self/ns/net) $$" > "$out.rank$OMPI_COMM_WORLD_RANK"\n'
                    'exec "$@"\n')
        os.chmod(self.rank_sh, 0o755)

    def netns_inode(self, i):
        return os.stat(f"/run/netns/{self.ns[i]}").st_ino

    def veth_tx_bytes(self):
        """Bytes both hosts sent on the veth (the kernel's counters)."""
        total = 0
        for i in (0, 1):
            out = sh("ip", "-n", self.ns[i], "-s", "-j", "link", "show", "dev", self.veth[i]).stdout
            total += json.loads(out)[0]["stats64"]["tx"]["bytes"]
        return total

    def __exit__(self, *exc):
        try:
            self.stop_slow_link()
        except BaseException:
            if self.link is not None and self.link.poll() is None:
                self.link.kill()
                self.link.wait()
            raise
        finally:
            for ns in self.ns:
                kill_namespace(ns)
        left = [ns for ns in self.ns if ns in sh("ip", "netns", "list").stdout.split()]
        if left:
            raise RuntimeError(f"namespaces left behind: {left}")
        return False

    def mpirun(self, out, args, label, link="veth", extra=(), env=None, popen=False):
        """`meshgrad train --backend mpi ARGS` as rank 0 on host 1 and rank 1 on host 2, over one link;
        the ranks write OUT.jsonl (metrics) and OUT.rank0/1 (where they ran)."""
        net = LINKS[link]
        hostfile = os.path.join(self.work, f"hosts.{link}")
        with open(hostfile, "w") as f:
            f.write(f"{net}.1 slots=1\n{net}.2 slots=1\n")
        cmd = ["ip", "netns", "exec", self.ns[0], "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
               self.names[0], MPIRUN, "--allow-run-as-root", "--hostfile", hostfile, "-np", "2",
               "--mca", "plm_rsh_agent", self.agent,
               # TCP only: the ob1 messaging layer over the tcp btl (self for a rank's messages to
               # itself); no vader (shared memory), no UCX; daemons and ranks on the link's subnet.
               "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
               "--mca", "oob_tcp_if_include", f"{net}.0/24", "--mca", "btl_tcp_if_include", f"{net}.0/24",
               # The two hosts share this machine's cores: OpenMPI counts one rank per host, so say
               # that two share the node (meshgrad's BLAS policy takes the larger of this and
               # OMPI_COMM_WORLD_LOCAL_SIZE) and each rank uses one BLAS thread, as rank threads do.
               "-x", "MPI_LOCALNRANKS=2",
               # For the same reason no binding: each host's mpirun binds its first rank to core 0,
               # so both ranks would share core 0 (an 8 KiB exchange took 1-5 ms instead of 50 us).
               "--bind-to", "none", *extra,
               self.rank_sh, out, MG, "train", "--backend", "mpi", *args, "--metrics", out + ".jsonl"]
        if popen:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, preexec_fn=own_group)
        return run(cmd, label, env=env)

    def check_placement(self, out, what):
        """Rank 0 ran on host 1 and rank 1 on host 2, each in its namespace."""
        for r in (0, 1):
            try:
                name, ns, _ = open(f"{out}.rank{r}").read().split()
            except (OSError, ValueError) as e:
                check(False, f"{what}: rank {r} left no record of where it ran: {e}")
                continue
            want = f"net:[{self.netns_inode(r)}]"
            check(name == self.names[r] and ns == want,
                  f"{what}: rank {r} ran on {name} in {ns}, not on {self.names[r]} in {want}")


def kill_namespace(ns):
    """Kills what still runs in namespace ns (processes this test started there) and removes it."""
    r = sh("ip", "netns", "pids", ns, ok=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    sh("ip", "netns", "delete", ns, ok=False)


def remove_stale_namespaces():
    """Namespaces of an earlier run of this test whose process is gone (killed by ctest's timeout)."""
    for line in sh("ip", "netns", "list", ok=False).stdout.splitlines():
        m = re.match(r"(mghost(\d+)-[12])\b", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            print(f"removing namespace {m.group(1)} left by an earlier run", flush=True)
            kill_namespace(m.group(1))


def threads_run(out, mesh, args):
    r = run([MG, "train", "--mesh", mesh, *args, "--metrics", out + ".jsonl"], f"threads {mesh}")
    if r.returncode != 0:
        raise RuntimeError(f"the threads run {mesh} failed (rc {r.returncode}): {r.stderr[-800:]}")
    return metrics(out + ".jsonl")


def mpi_run(hosts, out, args, what, link="veth", extra=()):
    """An mpirun across the hosts that must succeed: (metrics texts, elapsed, the CompletedProcess)."""
    r = hosts.mpirun(out, args, what, link=link, extra=extra)
    with open(out + ".log", "w") as f:   # for a look after a failure
        f.write(r.stdout + r.stderr)
    if not check(r.returncode == 0, f"{what}: mpirun rc {r.returncode}: {r.stderr[-1500:]}"):
        return {}, {}, r
    hosts.check_placement(out, what)
    return (*metrics(out + ".jsonl"), r)


def checkpoint_steps(ck):
    return sorted(d for d in os.listdir(ck) if d.startswith("step_"))


def verify(path, what):
    v = run([MG, "checkpoint", "verify", path], f"checkpoint verify {os.path.basename(path)}")
    check(v.returncode == 0, f"{what}: `meshgrad checkpoint verify {path}` failed: {v.stderr[-800:]}")


def test(hosts):
    w = hosts.work
    steps = ["--steps", str(STEPS)]
    ref_tp, t_threads = threads_run(os.path.join(w, "threads_tp2"), "tp=2", MODEL + steps)
    ref_dp, _ = threads_run(os.path.join(w, "threads_dp2"), "dp=2", MODEL + steps)
    check(len(ref_tp) == STEPS and len(ref_dp) == STEPS, "the threads runs did not write every step")

    # tp=2 across the hosts, saving into the shared folder; btl_base_verbose names the btls and
    # interfaces OpenMPI chose.
    ck = os.path.join(w, "shared", "ck")
    before = hosts.veth_tx_bytes()
    got, t_veth, r = mpi_run(hosts, os.path.join(w, "mpi_tp2"),
                             MODEL + steps + ["--mesh", "tp=2", "--checkpoint-dir", ck, "--save-every", "4"],
                             "mpi tp=2 over the veth, checkpoints", extra=["--mca", "btl_base_verbose", "30"])
    sent = hosts.veth_tx_bytes() - before
    same_steps(got, ref_tp, "mpi tp=2 across hosts", range(1, STEPS + 1))
    # The tp=2 model all-reduces activations of [4, 16, 32] floats (8 KiB) several times a layer and
    # step: over 1 MB in 8 steps. Without MPI traffic on the veth only start-up's few KB would cross.
    check(sent > 200_000, f"only {sent} bytes crossed the veth: the ranks did not talk over it")
    log = r.stdout + r.stderr
    btls = set(re.findall(r"select: init of component (\w+) returned success", log))
    check(btls == {"tcp", "self"}, f"OpenMPI's btls were {sorted(btls) or 'not reported'}, not tcp and self only")
    ifaces = set(re.findall(r"btl:tcp: examining interface (\S+)", log))
    check(ifaces == set(hosts.veth), f"OpenMPI's tcp btl used the interfaces {sorted(ifaces)}, not the veth's")
    print(f"tp=2 across hosts: {sent} bytes over the veth, btls {sorted(btls)}, interfaces {sorted(ifaces)}",
          flush=True)

    # The checkpoints both hosts wrote verify, and a resume across the hosts continues bit for bit.
    check(checkpoint_steps(ck) == ["step_00000004", "step_00000008"], f"checkpoints: {os.listdir(ck)}")
    for d in checkpoint_steps(ck):
        files = sorted(os.listdir(os.path.join(ck, d)))
        check({"rank_00000.bin", "rank_00001.bin"} <= set(files), f"checkpoint {d} lacks a host's file: {files}")
        verify(os.path.join(ck, d), "a checkpoint written from both hosts")
    got, _, _ = mpi_run(hosts, os.path.join(w, "mpi_resume"), ["--resume", os.path.join(ck, "step_00000004")],
                        "mpi resume from step 4 across hosts")
    check(sorted(got) == list(range(5, STEPS + 1)), f"the resume ran steps {sorted(got)}, not 5..{STEPS}")
    same_steps(got, ref_tp, "resume from step 4 across hosts", range(5, STEPS + 1))
    verify(os.path.join(ck, "step_00000008"), "step 8 written again by the resume")

    got, _, _ = mpi_run(hosts, os.path.join(w, "mpi_dp2"), MODEL + steps + ["--mesh", "dp=2"], "mpi dp=2 over the veth")
    same_steps(got, ref_dp, "mpi dp=2 across hosts", range(1, STEPS + 1))

    rows = [("threads, one process", "tp=2", t_threads), ("veth", "tp=2", t_veth)]
    if hosts.no_slow_link is None:
        hosts.start_slow_link(DELAY_MS, LOSS)
        got, t_slow, _ = mpi_run(hosts, os.path.join(w, "mpi_tp2_slow"), MODEL + steps + ["--mesh", "tp=2"],
                                 f"mpi tp=2 over {DELAY_MS} ms, {LOSS:.0%} loss", link="slow")
        same_steps(got, ref_tp, f"mpi tp=2 with {DELAY_MS} ms and {LOSS:.0%} loss", range(1, STEPS + 1))
        counts = hosts.stop_slow_link()
        print(f"slow link: {counts}", flush=True)
        check(counts.get("frames", 0) > 500 and counts.get("dropped", 0) > 0,
              f"the slow link carried {counts}: the run did not cross it, or it dropped nothing")
        rows.append((f"{DELAY_MS} ms each way, {LOSS:.0%} loss", "tp=2", t_slow))

    kill_test(hosts, recovery=False)
    kill_test(hosts, recovery=True)
    print_table(rows, STEPS)


def kill_test(hosts, recovery):
    """SIGKILL to host 2's rank after a few steps. Plain mpirun (what a user runs) ends the job at once
    and names the killed rank. With --enable-recovery mpirun leaves the survivor running (docs/comm.md),
    so it meets meshgrad's own failure path: host 1's rank stops at its communication deadline with
    meshgrad's error. Under load OpenMPI 4.1 sometimes tears the survivor down itself, about 2 s after
    the kill and before the deadline could pass, with no word from the rank (seen twice under ctest
    -j2, never alone): such an attempt shows nothing of meshgrad's path, so it is run again, up to 3
    attempts; an attempt that lasts to the deadline must end with meshgrad's error. Plain mpirun's
    attempt is run again in the same way when rank 0 died of SIGPIPE before mpirun named rank 1."""
    what = "kill with --enable-recovery" if recovery else "kill"
    for attempt in range(1, 4):
        result = kill_attempt(hosts, recovery, what, attempt)
        if result is None:
            return  # a check failed
        took, returncode, err = result
        if not recovery:
            check(returncode != 0, f"{what}: mpirun exited 0 after a rank was killed")
            # OpenMPI 4.1 races too: rank 0 can die of SIGPIPE on the dead peer's socket before mpirun
            # has noticed rank 1, and mpirun then names rank 0 (seen once in CI under ASan's load):
            # that attempt says nothing of the kill's report, so it is run again, up to 3 attempts.
            if (attempt < 3 and not re.search(r"rank 1 with PID \d+ on node \S+ exited on signal 9", err)
                    and re.search(r"rank 0 with PID \d+ on node \S+ exited on signal 13", err)):
                print(f"         {what}: attempt {attempt}: rank 0 ended on SIGPIPE before mpirun named rank 1; "
                      f"again", flush=True)
                continue
            check(re.search(r"rank 1 with PID \d+ on node \S+ exited on signal 9", err),
                  f"{what}: mpirun did not name rank 1 as killed: {err[-1500:]}")
            return
        # mpirun --enable-recovery exits 0 whatever its ranks did (OpenMPI 4.1): the message is the verdict.
        if re.search(r"meshgrad: error on rank 0 of 2: mpi: \w+ seq \d+ on rank 0 of 2.*deadline passed", err):
            return
        if took >= DEADLINE_MS / 1000:
            check(False, f"{what}: rank 0 ran past its deadline but did not report it: {err[-1500:]}")
            return
        print(f"         {what}: attempt {attempt}: OpenMPI ended rank 0 {took:.1f} s after the kill, before "
              f"its deadline, without a word from it; again", flush=True)
    check(False, f"{what}: in 3 attempts OpenMPI ended rank 0 before its deadline each time, so meshgrad's "
                 f"deadline error was never reached: {err[-1500:]}")


def kill_attempt(hosts, recovery, what, attempt):
    """One run, killed: (seconds from the kill to mpirun's exit, mpirun's exit code, its stderr), or
    None when a check failed."""
    out = os.path.join(hosts.work, ("mpi_kill_recovery" if recovery else "mpi_kill") + f"_{attempt}")
    env = dict(os.environ, MESHGRAD_COMM_TIMEOUT_MS=str(DEADLINE_MS))
    extra = ["-x", "MESHGRAD_COMM_TIMEOUT_MS"] + (["--enable-recovery"] if recovery else [])
    p = hosts.mpirun(out, MODEL + ["--steps", "100000", "--mesh", "tp=2"], what, env=env, popen=True, extra=extra)
    try:
        # The file is read once more after the deadline: what counts is the run's progress, not how
        # long this process slept.
        deadline = time.time() + 60
        while True:
            done = steps_so_far(out + ".jsonl")
            if done >= 3 or p.poll() is not None or time.time() > deadline:
                break
            time.sleep(0.05)
        if p.poll() is not None:
            check(False, f"{what}: the run ended before the kill (rc {p.returncode}, steps seen: {done}): "
                         f"{p.communicate()[1][-800:]}")
            return None
        if done < 3:
            check(False, f"{what}: the run did not reach step 3 within 60 s (steps seen: {done})")
            return None
        ranks = [open(f"{out}.rank{r}").read().split() for r in (0, 1)]
        check(ranks[1][0] == hosts.names[1], f"{what}: rank 1 ran on {ranks[1][0]}, not host 2")
        t0 = time.time()
        os.kill(int(ranks[1][2]), signal.SIGKILL)
        try:
            _, err = p.communicate(timeout=DEADLINE_MS / 1000 + 30)
        except subprocess.TimeoutExpired:
            check(False, f"{what}: host 1's rank did not stop within 30 s past the deadline")
            return None
        took = time.time() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    print(f"{took:6.1f} s  {what}: mpirun exited {p.returncode} after rank 1 was killed", flush=True)
    survivor = int(ranks[0][2])
    check(not os.path.exists(f"/proc/{survivor}"), f"{what}: rank 0 (pid {survivor}) on host 1 still runs")
    # The deadline plus MPI_Abort's and mpirun's teardown (a second or two here).
    check(took < DEADLINE_MS / 1000 + 10,
          f"{what}: host 1 stopped {took:.1f} s after the kill (deadline {DEADLINE_MS} ms)")
    return took, p.returncode, err


def bench(hosts):
    """Step times of BENCH_STEPS-step runs, tp=2 and dp=2: rank threads, two processes on one host
    (mpirun's defaults: shared memory), the veth, the slow link with latency only and with latency
    and loss. BENCH_REPEATS rounds, each running every configuration once (so a neighbour's load
    falls on all of them alike)."""
    w, steps = hosts.work, ["--steps", str(BENCH_STEPS)]
    configs = [("threads, one process", "threads", None), ("one host, shared memory", "shm", None),
               ("veth", "veth", None), (f"{DELAY_MS} ms each way", "slow", 0.0),
               (f"{DELAY_MS} ms each way, {LOSS:.0%} loss", "slow", LOSS)]
    if hosts.no_slow_link is not None:
        print(f"no slow link: {hosts.no_slow_link}")
        configs = [c for c in configs if c[1] != "slow"]
    runs = {}   # (label, mesh) -> [elapsed of each repeat]
    for _ in range(BENCH_REPEATS):
        for label, kind, loss in configs:
            if kind == "slow":
                hosts.start_slow_link(DELAY_MS, loss)
            for mesh in BENCH_MESHES:
                out = os.path.join(w, "bench")
                # A pipeline's micro-batches (the other meshes' step is the same computation in one).
                args = MODEL + steps + (["--micro-batches", str(BENCH_PP_MICRO)] if mesh.startswith("pp=") else [])
                if kind == "threads":
                    elapsed = threads_run(out, mesh, args)[1]
                elif kind == "shm":
                    # No binding here either: the runs' BLAS threads must be free, as on the hosts.
                    r = run([MPIRUN, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2", MG,
                             "train", "--backend", "mpi", *args, "--mesh", mesh, "--metrics", out + ".jsonl"],
                            f"mpi {mesh} {label}")
                    if not check(r.returncode == 0, f"mpi {mesh} on one host: {r.stderr[-800:]}"):
                        continue
                    elapsed = metrics(out + ".jsonl")[1]
                else:
                    elapsed = mpi_run(hosts, out, args + ["--mesh", mesh], f"mpi {mesh} over {label}",
                                      link=kind)[1]
                runs.setdefault((label, mesh), []).append(elapsed)
            hosts.stop_slow_link()
    print(f"\nstep times in ms of {BENCH_STEPS}-step runs, the first step left out, {BENCH_REPEATS} runs each; "
          f"model: {' '.join(MODEL)}")
    print("| link | mesh | median, best run | median, all runs | p90, all runs |")
    print("|---|---|---:|---:|---:|")
    for (label, mesh), elapsed in runs.items():
        per_run = [step_times_ms(e) for e in elapsed if len(e) > 1]
        every = sorted(t for times in per_run for t in times)
        if every:
            best = min(statistics.median(times) for times in per_run)
            p90 = every[min(len(every) - 1, int(0.9 * len(every)))]
            print(f"| {label} | {mesh} | {best:.1f} | {statistics.median(every):.1f} | {p90:.1f} |")
    sys.stdout.flush()


def print_table(rows, steps):
    """The test's own step times (one short run each; for a look, not a benchmark)."""
    print(f"\nstep times in ms of the test's {steps}-step runs, the first step left out")
    print("| link | mesh | median | max |")
    print("|---|---|---:|---:|")
    for link, mesh, elapsed in rows:
        t = sorted(step_times_ms(elapsed))
        if t:
            print(f"| {link} | {mesh} | {statistics.median(t):.1f} | {t[-1]:.1f} |")
    sys.stdout.flush()


def main():
    if CLEANUP:
        try:
            remove_stale_namespaces()
        except FileNotFoundError:   # no ip: this machine made none
            pass
        left = [l for l in sh("ip", "netns", "list", ok=False).stdout.splitlines() if l.startswith("mghost")] \
            if shutil.which("ip") else []
        print(f"namespaces of running tests: {left}" if left else "no multihost namespaces left")
        return 0
    # A user stops a test with SIGINT or SIGTERM: leave through the clean-up then too (ctest's timeout
    # sends SIGKILL: its fixture's clean-up, `--cleanup`, removes what is left).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("multihost: stopped by SIGTERM"))
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(os.path.join(WORK, "shared"))
    try:
        with Hosts(WORK) as hosts:
            if BENCH:
                bench(hosts)
                return 1 if failures else 0
            test(hosts)
            missing = hosts.no_slow_link
    except Skip as e:
        print(f"SKIP: {e}", flush=True)
        return SKIP
    except RuntimeError as e:
        print(f"FAIL: {e}", flush=True)
        return 1
    if failures:
        print(f"{len(failures)} failure(s)")
        return 1
    if missing is not None:
        print(f"SKIP: every check passed but latency and loss, which need a TAP device: {missing}", flush=True)
        return SKIP
    print("all multi-host checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
