#!/usr/bin/env python3
"""A network link with latency and loss between two network namespaces, in user space.

What `tc qdisc add dev IF root netem delay D loss L` does on a veth pair, for kernels without
sch_netem (the CI machine's kernel has no netem, tbf, fq or ingress qdisc and cannot load modules;
it has /dev/net/tun). Two TAP devices, one moved into each namespace, carry Ethernet frames to this
process, which passes each frame to the other side DELAY ms after it arrived, or drops it with
probability LOSS (a seeded generator, every kind of frame as netem does, ARP included). The delay is
constant, so frames keep their order (as netem without jitter).

  multihost_link.py NS1 ADDR1/PREFIX NS2 ADDR2/PREFIX --delay-ms 5 --loss 0.01 --seed 1 --ready FILE

Prints nothing until SIGTERM or SIGINT; then writes one JSON line of counts to stdout
({"frames": ..., "bytes": ..., "dropped": ...}) and exits 0, its TAP devices vanishing with its file
descriptors. FILE is created once both devices are up in their namespaces (the caller waits for it).
"""
import argparse
import collections
import fcntl
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000


def open_tap(name):
    """A TAP device NAME in this process's (the root) namespace, removed when the fd closes."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def ip(*args):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"multihost_link: ip {' '.join(args)} failed: {r.stderr.strip()}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ns1")
    p.add_argument("addr1")
    p.add_argument("ns2")
    p.add_argument("addr2")
    p.add_argument("--delay-ms", type=float, default=5.0)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ready", required=True)
    a = p.parse_args()

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    # Interface names are at most 15 bytes; the pid keeps two concurrent runs apart.
    names = [f"mgl{os.getpid()}a", f"mgl{os.getpid()}b"]
    fds = [open_tap(n) for n in names]
    for name, ns, addr in zip(names, (a.ns1, a.ns2), (a.addr1, a.addr2)):
        ip("link", "set", name, "netns", ns)   # the fd stays attached to the device
        ip("-n", ns, "addr", "add", addr, "dev", name)
        ip("-n", ns, "link", "set", name, "up")
    with open(a.ready, "w") as f:
        f.write(" ".join(names) + "\n")

    rng = random.Random(a.seed)
    delay = a.delay_ms / 1000.0
    # queue[i]: (due time, frame) read from side i, to be written to side 1 - i.
    queue = [collections.deque(), collections.deque()]
    counts = {"frames": 0, "bytes": 0, "dropped": 0}
    while not stop:
        now = time.monotonic()
        for i in (0, 1):
            q = queue[i]
            while q and q[0][0] <= now:
                try:
                    os.write(fds[1 - i], q.popleft()[1])
                except (BlockingIOError, OSError):
                    counts["dropped"] += 1   # the device's queue is full or it is down: lost, as on a wire
        due = [q[0][0] for q in queue if q]
        timeout = max(0.0, min(due) - time.monotonic()) if due else 0.2
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            continue
        for fd in readable:
            i = fds.index(fd)
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if rng.random() < a.loss:
                    counts["dropped"] += 1
                    continue
                counts["frames"] += 1
                counts["bytes"] += len(frame)
                queue[i].append((time.monotonic() + delay, frame))
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
