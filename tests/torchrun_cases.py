#!/usr/bin/env python3
"""The observable cases of PyTorch's own launcher tests (test/distributed/launcher/test_run.py
in the pytorch repository), rewritten to run mglaunch as a subprocess: the same command lines,
the same worker behaviour (each worker touches a file named by its RANK; a failing worker
raises; a bash worker echoes "creating FILE"), and the same expectations, with torchrun's
exceptions read as exit codes (ValueError/RuntimeError from the parser: exit 2;
ChildFailedError: the worker's non-zero code). Cases that mock torch's internals (the agent,
the rendezvous handler, accelerators, events.record) or need GPUs observe nothing a
subprocess can see and are not here.

  torchrun_cases.py MGLAUNCH [PYTHON]   PYTHON: the workers' interpreter with torch
                                        (default /usr/bin/python3)
  torchrun_cases.py MGLAUNCH --torch2   the same inside ../shared/peers/torch2's root (torch 2.6;
                                        skipped when it is absent or not set up)

Prints one line per case, "ok NAME" or "FAIL NAME: why", then "passed N of M"; exits 0 when
all pass, 1 otherwise, 77 (skipped) when PYTHON has no torch. Every run is bounded."""
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from skip import require_installed  # noqa: E402
import ports  # noqa: E402  (tests/support/ports.py: ports no parallel test takes)

MGLAUNCH = os.path.abspath(sys.argv[1])
PYTHON = sys.argv[2] if len(sys.argv) > 2 else "/usr/bin/python3"
TIMEOUT = 240

TOUCH_PY = r'''
import argparse, os, pathlib
p = argparse.ArgumentParser()
p.add_argument("--fail", action="store_true")
p.add_argument("--touch_file_dir", "--touch-file-dir")
a = p.parse_args()
for v in ["LOCAL_RANK", "RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
          "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
          "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS", "TEST_SENTINEL_PARENT",
          "TORCHELASTIC_ERROR_FILE"]:
    print(v, "=", os.environ[v])
if a.fail:
    raise RuntimeError("raising exception since --fail flag was set")
pathlib.Path(os.path.join(a.touch_file_dir, os.environ["RANK"])).touch()
'''
TOUCH_SH = '#!/bin/bash\nFILE="$1/$RANK"\necho "creating $FILE"\ntouch "$FILE"\n'
LAUNCHED_PY = r'''
import argparse, torch.distributed as dist
p = argparse.ArgumentParser()
p.add_argument("--out_file", "--out-file")
a = p.parse_args()
open(a.out_file, "w").write(str(dist.is_torchelastic_launched()))
'''
INIT_PY = r'''
import argparse, os, torch, torch.distributed as dist, torch.nn.functional as F
p = argparse.ArgumentParser()
p.add_argument("--init-method", "--init_method", required=True)
a = p.parse_args()
dist.init_process_group("gloo", init_method=a.init_method, world_size=int(os.environ["WORLD_SIZE"]),
                        rank=int(os.environ["RANK"]))
t = F.one_hot(torch.tensor(dist.get_rank()), num_classes=dist.get_world_size())
dist.all_reduce(t)
assert torch.sum(t).item() == dist.get_world_size()
print("Done")
'''


class Case:
    def __init__(self, tmp):
        self.dir = tempfile.mkdtemp(dir=tmp)
        # The agents' records of their jobs (launcher/job_record.h): the case's own, never the
        # user's $XDG_RUNTIME_DIR nor another case's (the cases reuse job ids and addresses).
        self.records = tempfile.mkdtemp(dir=tmp, prefix="records_")
        self.bin = os.path.join(tmp, "bin")

    def path(self, name):
        return os.path.join(self.bin, name)

    def env(self, extra=None):
        e = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
        e["TEST_SENTINEL_PARENT"] = "FOOBAR"
        e["MGLAUNCH_PYTHON"] = PYTHON
        e["MGLAUNCH_RECORD_DIR"] = self.records
        e.update(extra or {})
        # No case may take torchrun's default master port: PyTorch runs these cases one at a
        # time, ctest runs the 1.13 and 2.6 suites side by side (and other suites beside them).
        e.setdefault("PET_MASTER_PORT", "0")
        return e

    def launch(self, args, extra_env=None):
        return subprocess.run([MGLAUNCH] + args, env=self.env(extra_env), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)

    def files(self):
        return set(os.listdir(self.dir))


def expect(cond, why):
    if not cond:
        raise AssertionError(why)


def ok_run(r):
    expect(r.returncode == 0, f"exit {r.returncode}: {r.stderr.strip().splitlines()[-3:]}")


def ranks(n):
    return {str(i) for i in range(n)}


def common(c, extra=()):
    return ["--monitor-interval=1", "--start-method=spawn", *extra]


# ---- the cases, named as in test_run.py ----

def test_launch_user_script_python(c):
    ok_run(c.launch(["--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={uuid.uuid4().int}", *common(c),
                     c.path("test_script.py"), f"--touch-file-dir={c.dir}"]))
    expect(c.files() == ranks(4), f"files {sorted(c.files())}")


def test_launch_user_script_python_caffe2_bc(c):
    ok_run(c.launch(["--nnodes=1", "--nproc-per-node=4", *common(c), "--master-addr=localhost",
                     f"--master-port={ports.free_port()}", "--node-rank=0", c.path("test_script.py"),
                     f"--touch-file-dir={c.dir}"]))
    expect(c.files() == ranks(4), f"files {sorted(c.files())}")


def _bash(c, nproc_args, n):
    args = ["--nnodes=1", *nproc_args, f"--rdzv-id={uuid.uuid4().int}", *common(c), "--no-python"]
    script = [c.path("test_script.sh"), c.dir]
    bad = c.launch(args + ["--module"] + script)  # ValueError: --no-python with --module
    expect(bad.returncode == 2, f"--no-python --module: exit {bad.returncode}")
    ok_run(c.launch(args + script))
    expect(c.files() == ranks(n), f"files {sorted(c.files())}")


def test_launch_user_script_bash(c):
    _bash(c, ["--nproc-per-node=4"], 4)


def test_launch_user_script_default_nproc(c):
    _bash(c, [], 1)


def test_launch_with_env_vars(c):
    env = {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": str(uuid.uuid4().int),
           "PET_MONITOR_INTERVAL": "1", "PET_START_METHOD": "spawn", "PET_NO_PYTHON": "1"}
    script = [c.path("test_script.sh"), c.dir]
    bad = c.launch(script, dict(env, PET_MODULE="1"))
    expect(bad.returncode == 2, f"PET_MODULE=1 with PET_NO_PYTHON=1: exit {bad.returncode}")
    ok_run(c.launch(script, dict(env, PET_MODULE="0")))
    expect(c.files() == ranks(4), f"files {sorted(c.files())}")


def _nproc(c, value, n):
    ok_run(c.launch(["--nnodes=1", f"--nproc-per-node={value}", f"--rdzv-id={uuid.uuid4().int}", *common(c),
                     "--no-python", c.path("test_script.sh"), c.dir], {"CUDA_VISIBLE_DEVICES": ""}))
    expect(c.files() == ranks(n), f"files {sorted(c.files())}")


def test_nproc_launch_auto_configurations(c):
    _nproc(c, "auto", len(os.sched_getaffinity(0)))  # torch._utils.cpu_count() without an accelerator


def test_nproc_launch_number_configurations(c):
    _nproc(c, "4", 4)


def test_nproc_launch_unknown_configurations(c):
    r = c.launch(["--nnodes=1", "--nproc-per-node=unknown", *common(c), "--no-python", c.path("test_script.sh"),
                  c.dir])
    expect(r.returncode == 2, f"exit {r.returncode}")


def _elastic(c, extra, script_args, conf="--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'"):
    return ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{ports.free_port()}",
            conf, f"--rdzv-id={uuid.uuid4().int}", *common(c), *extra, c.path("test_script.py"), *script_args]


def test_launch_elastic(c):
    ok_run(c.launch(_elastic(c, [], [f"--touch-file-dir={c.dir}"])))
    expect(c.files() == ranks(4), f"files {sorted(c.files())}")


def test_launch_elastic_worker_raise_exception(c):
    r = c.launch(_elastic(c, ["--max-restarts=0"], ["--fail"]))
    expect(r.returncode != 0, "exit 0")  # ChildFailedError
    expect("raising exception since --fail flag was set" in r.stderr, "no root cause with the worker's error")


def test_launch_standalone(c):
    ok_run(c.launch(["--nnodes=1", "--nproc-per-node=4", "--standalone", *common(c), c.path("test_script.py"),
                     f"--touch-file-dir={c.dir}"]))
    expect(c.files() == ranks(4), f"files {sorted(c.files())}")


def test_launch_run_path(c):
    ok_run(c.launch(["--run-path", "--nnodes=1", "--nproc-per-node=4", *common(c), c.path("test_script.py"),
                     f"--touch-file-dir={c.dir}"]))
    expect(c.files() == ranks(4), f"files {sorted(c.files())}")


def test_launch_elastic_multiple_agents(c):
    args = _elastic(c, [], [f"--touch-file-dir={c.dir}"], conf="--rdzv_conf=timeout=5")
    other = subprocess.Popen([MGLAUNCH] + args, env=c.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        ok_run(c.launch(args))
        _, err = other.communicate(timeout=TIMEOUT)
        expect(other.returncode == 0, f"second agent: exit {other.returncode}: {err.strip().splitlines()[-3:]}")
    finally:
        if other.poll() is None:
            os.killpg(other.pid, 9)
            other.wait()
    expect(c.files() == ranks(8), f"files {sorted(c.files())}")


def test_min_max_nodes_parse(c):
    # parse_min_max_nnodes: "1" and "2:20" parse, "2:20:30" is a RuntimeError (a range needs an
    # elastic backend to run, so the parse is checked with c10d and --dry-run).
    for value, code in (("1", 0), ("2:20", 0), ("2:20:30", 2)):
        r = c.launch([f"--nnodes={value}", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:1", "--dry-run",
                      "--no-python", "/bin/true"])
        expect(r.returncode == code, f"--nnodes={value}: exit {r.returncode}: {r.stderr.strip()}")
    expect("'2:20:30'" in r.stderr, f"the message does not name the value: {r.stderr.strip()}")


def _launched(c, extra):
    out = os.path.join(c.dir, "out")
    ok_run(c.launch(["--run-path", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1", *extra,
                     c.path("test_script_is_torchelastic_launched.py"), f"--out-file={out}"]))
    with open(out) as f:
        expect(f.readline() == "True", "is_torchelastic_launched() is not True")


def test_is_torchelastic_launched(c):
    _launched(c, [])


def test_is_torchelastic_launched_with_logs_spec_defined(c):
    _launched(c, ["--logs_specs=default"])


def test_logs_logs_spec_entrypoint_must_be_defined(c):
    r = c.launch(["--run-path", "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=1",
                  "--logs_specs=DOESNOT_EXIST", c.path("test_script_is_torchelastic_launched.py")])
    expect(r.returncode == 2, f"exit {r.returncode}")


def _init(c, method):
    port = ports.free_port()
    ok_run(c.launch(["--run-path", "--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost",
                     f"--master-port={port}", "--monitor-interval=1", c.path("test_script_init_method.py"),
                     f"--init-method={method.format(port=port)}"]))


def test_init_method_tcp_with_torchelastic(c):
    _init(c, "tcp://localhost:{port}")


def test_init_method_env_with_torchelastic(c):
    _init(c, "env://")


def test_capture_logs_using_default_logs_specs(c):
    r = c.launch(["--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={uuid.uuid4().int}", "--redirect=3", "--tee=3",
                  *common(c), "--no-python", c.path("test_script.sh"), c.dir],
                 {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[rank${rank}]: "})
    ok_run(r)
    for i in range(4):
        expect(f"[rank{i}]: creating " in r.stdout, f"no '[rank{i}]: creating' on stdout")


def in_torch2_root():
    """Runs this script inside the torch 2.6 root, on copies under /tmp (which the root shares)."""
    from skip import skip_test
    t2 = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "peers",
                                       "torch2"))
    if not os.path.exists(t2):
        skip_test("torch 2.6 is not at ../shared/peers/torch2 (../shared is absent beside this checkout)")
    root = os.environ.get("TORCH2_ROOT", "/var/cache/mglaunch-peers/torch2-root")
    if not os.path.exists(os.path.join(root, ".ready")):
        skip_test("the torch 2.6 root is not set up: run ../shared/peers/torch2 setup once (~2 min)")
    tmp = tempfile.mkdtemp(prefix="mgtest_torchrun2_")
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        os.makedirs(os.path.join(tmp, "support"))
        shutil.copy(os.path.abspath(__file__), tmp)
        shutil.copy(os.path.join(here, "support", "skip.py"), os.path.join(tmp, "support"))
        shutil.copy(MGLAUNCH, tmp)
        r = subprocess.run([t2, "run", "/usr/bin/python3", os.path.join(tmp, os.path.basename(__file__)),
                            os.path.join(tmp, os.path.basename(MGLAUNCH)), "/usr/bin/python3"], cwd=tmp)
        return r.returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    if PYTHON == "--torch2":
        return in_torch2_root()
    has_torch = subprocess.run([PYTHON, "-c", "import torch.distributed"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL).returncode == 0 if os.path.exists(PYTHON) else False
    require_installed(has_torch, f"torch for {PYTHON}", "python3-torch")
    tmp = tempfile.mkdtemp(prefix="mgtest_torchrun_")
    try:
        os.makedirs(os.path.join(tmp, "bin"))
        for name, text in (("test_script.py", TOUCH_PY), ("test_script.sh", TOUCH_SH),
                           ("test_script_is_torchelastic_launched.py", LAUNCHED_PY),
                           ("test_script_init_method.py", INIT_PY)):
            with open(os.path.join(tmp, "bin", name), "w") as f:
                f.write(text)
        os.chmod(os.path.join(tmp, "bin", "test_script.sh"), 0o755)
        cases = [(n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)]
        only = os.environ.get("CASES")
        if only:
            cases = [(n, f) for n, f in cases if n in only.split(",")]
        passed = 0
        for name, fn in cases:
            try:
                fn(Case(tmp))
                print(f"ok {name}", flush=True)
                passed += 1
            except (AssertionError, subprocess.TimeoutExpired) as e:
                print(f"FAIL {name}: {e}", flush=True)
        print(f"passed {passed} of {len(cases)}", flush=True)
        return 0 if passed == len(cases) else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
