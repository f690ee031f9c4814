# torch's own classic TCPStore server for bench.py's "store" case: prints "port P", serves until
# stdin ends, then prints its memory as JSON.
import sys, datetime, resource
import torch.distributed as dist
kw = dict(is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=300))
try:
    s = dist.TCPStore("127.0.0.1", 0, use_libuv=False, **kw)
except TypeError:
    s = dist.TCPStore("127.0.0.1", 0, **kw)
print("port", s.port, flush=True)
sys.stdin.read()
def kib(f):
    for l in open("/proc/self/status"):
        if l.startswith(f): return int(l.split()[1])
print('{"rss_kib": %d, "hwm_kib": %d}' % (kib("VmRSS:"), kib("VmHWM:")), flush=True)
