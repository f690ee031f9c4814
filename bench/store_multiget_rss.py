#!/usr/bin/env python3
"""The store server's memory with many clients fetching large values at once (#35).

Starts our server (build/bin/store_bench serve: it prints "port P" and, at its stdin's end,
{"rss_kib":..,"hwm_kib":..}; ServerOptions' defaults: max_buffered 160 MiB over all clients,
max_bytes 1 GiB stored). One client SETs K keys of V bytes; then N clients (torch 2.x's
dialect) each ask for all K in one MULTI_GET, ROUNDS times. (No torch peer here: the
system's torch 1.13 has no MULTI_GET, and its server reset a 1.x client's 1 MiB SET in a
first try; torch 2.6's root, ../shared/peers/torch2, was not set up.)
  --mode read    every client reads its replies (a job's workers);
  --mode noread  no client reads (hostile: replies pile up in the server unless it bounds them).
Prints one JSON line per server: its resident memory idle, with the values stored, and at the
peak, and how many clients the server disconnected (noread: dropped over its budget).

Usage: store_multiget_rss.py [--bin build/bin] [--clients 300] [--keys 16] [--value-kib 1024]
                             [--rounds 3] [--mode read|noread]
Every socket is on 127.0.0.1; every wait is bounded (--timeout, 120 s).
"""
import argparse
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAGIC = 0x3C85F7CE


def u64(n):
    return struct.pack("<Q", n)


def s(b):
    return u64(len(b)) + b


def rss_kib(pid):
    with open(f"/proc/{pid}/status", "rb") as f:
        for line in f.read().decode().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def serve(argv):
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    if not line.startswith("port"):
        p.kill()
        sys.exit(f"server {argv[0]} did not start: {line!r}")
    return p, int(line.split()[-1])


def connect(port):
    c = socket.create_connection(("127.0.0.1", port), timeout=30)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return c


def recv_exact(c, n, deadline):
    out = bytearray()
    while len(out) < n:
        c.settimeout(max(0.1, deadline - time.monotonic()))
        b = c.recv(min(n - len(out), 1 << 20))
        if not b:
            raise ConnectionError("closed")
        out += b
    return bytes(out)


def run(argv, dialect2, a):
    p, port = serve(argv)
    deadline = time.monotonic() + a.timeout
    clients, dropped = [], 0
    try:
        idle = rss_kib(p.pid)
        keys = [f"k{i}".encode() for i in range(a.keys)]
        setter = connect(port)
        if dialect2:
            setter.sendall(bytes([0]) + struct.pack("<I", MAGIC))
        for k in keys:
            setter.sendall(bytes([1]) + s(k) + s(b"v" * (a.value_kib * 1024)))
        setter.sendall(bytes([7]))  # NUM_KEYS: its answer says every SET is stored
        recv_exact(setter, 8, deadline)
        stored = rss_kib(p.pid)
        if dialect2:
            query = bytes([10]) + u64(len(keys)) + b"".join(s(k) for k in keys)  # MULTI_GET
        else:
            query = b"".join(bytes([3]) + s(k) for k in keys)  # GETs, pipelined
        reply = len(keys) * (8 + a.value_kib * 1024)
        for _ in range(a.clients):
            c = connect(port)
            if dialect2:
                c.sendall(bytes([0]) + struct.pack("<I", MAGIC))
            clients.append(c)
        peak = stored
        sel = selectors.DefaultSelector()
        for rnd in range(a.rounds):
            for c in clients:
                try:
                    c.sendall(query)
                except OSError:
                    pass
            if a.mode == "noread":
                t = time.monotonic() + 5
                while time.monotonic() < t:  # the server queues what it may
                    peak = max(peak, rss_kib(p.pid))
                    time.sleep(0.2)
                break
            left = {c: reply for c in clients}
            for c in clients:
                c.setblocking(False)
                sel.register(c, selectors.EVENT_READ)
            while left and time.monotonic() < deadline:
                for key, _ in sel.select(timeout=0.2):
                    c = key.fileobj
                    try:
                        b = c.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    except OSError:
                        b = b""
                    if not b:
                        dropped += 1
                        left.pop(c, None)
                        sel.unregister(c)
                        continue
                    left[c] -= len(b)
                    if left[c] <= 0:
                        left.pop(c)
                        sel.unregister(c)
                peak = max(peak, rss_kib(p.pid))
            if left:
                sys.exit(f"round {rnd}: {len(left)} clients still waiting at the time-out")
            clients = [c for c in clients if c.fileno() >= 0]
            for c in clients:
                c.setblocking(True)
        if a.mode == "noread":  # the clients the server disconnected over its budget
            for c in clients:
                c.setblocking(False)
                try:
                    while True:
                        b = c.recv(1 << 20)
                        if not b:
                            dropped += 1
                            break
                except BlockingIOError:
                    pass
                except OSError:
                    dropped += 1
    finally:
        for c in clients:
            c.close()
        p.stdin.close()
        final = json.loads(p.stdout.readline() or "{}")
        p.wait(timeout=60)
    return {"server": "ours" if dialect2 else "torch 1.13's TCPStore", "clients": a.clients, "keys": a.keys,
            "value_kib": a.value_kib, "mode": a.mode, "rss_idle_kib": idle, "rss_stored_kib": stored,
            "rss_peak_kib": peak, "hwm_kib": final.get("hwm_kib"), "clients_dropped": dropped}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "bin"))
    ap.add_argument("--clients", type=int, default=300)
    ap.add_argument("--keys", type=int, default=16)
    ap.add_argument("--value-kib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mode", choices=["read", "noread"], default="read")
    ap.add_argument("--timeout", type=float, default=120)
    a = ap.parse_args()
    print(json.dumps(run([os.path.join(a.bin, "store_bench"), "serve"], True, a)), flush=True)


if __name__ == "__main__":
    main()
