"""The namespace cluster of tests/support/netns_cluster.h for Python tests (tests/chaos.py):
N hosts, each a network, UTS and mount namespace of its own (address 10.34.0.<k+1>/24,
host name node<k>, an /etc/hosts naming every host), their veths on a bridge in one more
namespace (the switch) with no other link, so traffic never leaves the cluster. Faults are
made at the switch: a host's port down (cut), IPv4 dropped one way (nft, bridge table), a
flapping link, random loss.

Each namespace is held by a process of ours (`unshare`, its parent-death signal SIGKILL,
ending also when the pipe to it closes); close() kills every process found in one of the
cluster's namespaces (/proc), then the holders, so nothing is left.

  cluster = NetCluster(4)            # skips (exit 77), or fails under CI=true, where it cannot
  argv = cluster.on(k) + ["mglaunch", ...]   # a command line that runs on host k
  cluster.cut(k); cluster.reconnect(k); cluster.drop(a, b); cluster.flap(k, 1.0, 1.0); cluster.heal()
  cluster.close()
"""
import os
import signal
import subprocess
import tempfile
import threading
import time

import skip

IP, NFT, NSENTER, SETPRIV, UNSHARE = "/usr/sbin/ip", "/usr/sbin/nft", "/usr/bin/nsenter", "/usr/bin/setpriv", \
    "/usr/bin/unshare"


def require():
    """Skips (or fails under CI=true) where the cluster cannot be made; returns when it can."""
    skip.require_program(IP, "iproute2")
    skip.require_program(NFT, "nftables")
    for p in (NSENTER, SETPRIV, UNSHARE):
        skip.require_program(p, "util-linux")
    if os.geteuid() != 0:
        reason = f"the namespace cluster needs root (network namespaces, veths, nft), not uid {os.geteuid()}"
        if skip.in_ci():
            print(f"error: {reason} (CI=true: this must work under CI, it does not skip)", flush=True)
            raise SystemExit(1)
        skip.skip_test(reason)


def _locked(method):
    def run(self, *args):
        with self.lock:
            return method(self, *args)
    run.__doc__ = method.__doc__
    return run


def _ns(pid):
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


class NetCluster:
    def __init__(self, hosts):
        require()
        self.dir = tempfile.mkdtemp(prefix="mgnetns_")
        self.names = [f"node{k}" for k in range(hosts)]
        self.addrs = [f"10.34.0.{k + 1}" for k in range(hosts)]
        with open(os.path.join(self.dir, "hosts"), "w") as f:
            f.write("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
            f.writelines(f"{a}\t{n}\n" for a, n in zip(self.addrs, self.names))
        self.holders = []
        self.lock = threading.RLock()  # faults may be made and healed from timer threads
        self.flappers = {}
        self.rules = {}
        self.switch = self._holder(None)
        self.hosts = [self._holder(n) for n in self.names]
        self.namespaces = {_ns(h.pid) for h in [self.switch, *self.hosts]}
        batch = "link set lo up\nlink add br0 type bridge\nlink set br0 up\n"
        for k, h in enumerate(self.hosts):
            batch += f"link add h{k} type veth peer name eth0 netns {h.pid}\nlink set h{k} master br0\nlink set h{k} up\n"
        self._ip_batch(self.switch, batch)
        for a, h in zip(self.addrs, self.hosts):
            self._ip_batch(h, f"link set lo up\naddr add {a}/24 dev eth0\nlink set eth0 up\n")
        self._switch([NFT, "add table bridge mgnet"])
        self._switch([NFT, "add chain bridge mgnet faults { type filter hook forward priority 0; policy accept; }"])

    def _holder(self, hostname):
        """A process holding new namespaces until it is killed or its stdin closes."""
        if hostname is None:
            argv = [SETPRIV, "--pdeathsig", "KILL", "--", UNSHARE, "--net", "--", "/bin/sh", "-c",
                    "echo ready && exec cat >/dev/null"]
        else:
            argv = [SETPRIV, "--pdeathsig", "KILL", "--", UNSHARE, "--net", "--uts", "--mount",
                    "--propagation", "private", "--", "/bin/sh", "-c",
                    'hostname "$1" && mount --bind "$2" /etc/hosts && echo ready && exec cat >/dev/null',
                    "sh", hostname, os.path.join(self.dir, "hosts")]
        p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.holders.append(p)
        if p.stdout.readline().strip() != "ready":
            why = p.stderr.read().strip().splitlines()
            self.close()
            reason = f"cannot make the namespace cluster's network namespaces here ({why[-1] if why else 'no answer'})"
            if skip.in_ci():
                print(f"error: {reason} (CI=true: this must work under CI, it does not skip)", flush=True)
                raise SystemExit(1)
            skip.skip_test(reason)
        return p

    def _enter(self, holder, net_only):
        ns = f"/proc/{holder.pid}/ns/"
        argv = [NSENTER, f"--net={ns}net"]
        if not net_only:
            argv += [f"--uts={ns}uts", f"--mount={ns}mnt", f"--wd={os.getcwd()}"]
        return argv + ["--", SETPRIV, "--pdeathsig", "KILL", "--"]

    def on(self, k):
        """The prefix of a command line that runs on host k (parent death: SIGKILL)."""
        return self._enter(self.hosts[k], False)

    def _switch(self, argv):
        r = subprocess.run(self._enter(self.switch, True) + argv, capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"namespace cluster: {' '.join(argv)} failed: {r.stderr.strip()}")

    def _ip_batch(self, holder, commands):
        r = subprocess.run(self._enter(holder, True) + [IP, "-batch", "-"], input=commands, capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"namespace cluster: ip -batch failed: {r.stderr.strip()}\n{commands}")

    def _apply_rules(self):
        script = "flush chain bridge mgnet faults\n" + "".join(
            f'add rule bridge mgnet faults {rule} comment "{fid}"\n'
            for fid, rules in sorted(self.rules.items()) for rule in rules)
        r = subprocess.run(self._enter(self.switch, True) + [NFT, "-f", "-"], input=script, capture_output=True,
                           text=True, timeout=30)
        if r.returncode != 0:
            raise RuntimeError(f"namespace cluster: nft failed: {r.stderr.strip()}\n{script}")

    # ---- faults: each in force when it returns ----------------------------------------------
    @_locked
    def cut(self, k):
        """Host k's switch port down: nothing in or out."""
        self._switch([IP, "link", "set", f"h{k}", "down"])

    @_locked
    def reconnect(self, k):
        self._switch([IP, "link", "set", f"h{k}", "up"])

    @_locked
    def drop(self, a, b=None):
        """IPv4 from host a to host b dropped (one way); b None: to every host."""
        self.rules[f"drop {a} {b}"] = [f'iifname "h{a}" ' + (f'oifname "h{b}" ' if b is not None else "")
                                       + "ether type ip drop"]
        self._apply_rules()

    @_locked
    def undrop(self, a, b=None):
        self.rules.pop(f"drop {a} {b}", None)
        self._apply_rules()

    @_locked
    def loss(self, k, percent):
        """That share of IPv4 into and out of host k dropped at random; 0 ends it."""
        if percent:
            p = f" ether type ip numgen random mod 100 < {int(percent)} drop"
            self.rules[f"loss {k}"] = [f'iifname "h{k}"' + p, f'oifname "h{k}"' + p]
        else:
            self.rules.pop(f"loss {k}", None)
        self._apply_rules()

    @_locked
    def flap(self, k, down_s, up_s):
        """Host k's port down for down_s, up for up_s, again and again (at most 1,000 times)."""
        self.stop_flap(k)
        loop = (f"i=0; while [ $i -lt 1000 ]; do i=$((i+1)); {IP} link set h{k} down; sleep {down_s}; "
                f"{IP} link set h{k} up; sleep {up_s}; done")
        self.flappers[k] = subprocess.Popen(self._enter(self.switch, True) + ["/bin/sh", "-c", loop],
                                            start_new_session=True)

    @_locked
    def stop_flap(self, k):
        p = self.flappers.pop(k, None)
        if p:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            self.reconnect(k)

    @_locked
    def heal(self):
        """Every fault ended: ports up, no rule, no flapping."""
        for k in list(self.flappers):
            self.stop_flap(k)
        self.rules.clear()
        self._apply_rules()
        self._ip_batch(self.switch, "".join(f"link set h{k} up\n" for k in range(len(self.hosts))))

    @_locked
    def close(self):
        """Kills every process in the cluster's namespaces, then the holders; idempotent."""
        for p in self.flappers.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.flappers.clear()
        holders = {h.pid for h in self.holders}
        namespaces = getattr(self, "namespaces", set()) - {""}
        deadline = time.monotonic() + 20
        while namespaces and time.monotonic() < deadline:
            inside = [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) not in holders
                      and _ns(d) in namespaces]
            if not inside:
                break
            for pid in inside:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        for h in self.holders:
            h.kill()
            h.wait()
        self.holders = []
        subprocess.run(["rm", "-rf", self.dir], check=False)
