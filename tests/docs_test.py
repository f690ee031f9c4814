#!/usr/bin/python3
"""The documentation holds (issue #24): README.md is a front door of at most 300 lines;
every relative link of README.md and docs/*.md names a file that exists, and a heading
there when it has an #anchor (GitHub's slugs); every long flag that a binary's --help
prints appears in docs/flags.md (mglaunch, its --hostfile and doctor forms, mglaunch-rdzv,
and mglaunch-sbatch and mgtrain when they are built); every environment variable named
MGLAUNCH_* in the product's sources appears there too; `make run` installs no test-only package.

Usage: docs_test.py SOURCE_DIR BIN_DIR. Exit 0 when all hold, 1 with one line per problem.
"""
import os
import re
import subprocess
import sys

SRC, BIN = sys.argv[1], sys.argv[2]
ROOMS = ["proto", "cli", "process", "store", "control", "rendezvous", "logs", "ops", "slurm", "launcher", "baremetal", "worker"]
problems = []


def read(path):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        problems.append(f"cannot read {os.path.relpath(path, SRC)}: {e.strerror}")
        return ""


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path):
    out, fenced = set(), False
    for line in read(path).splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


# 1. The front door.
readme = os.path.join(SRC, "README.md")
lines = read(readme).count("\n")
if lines > 300:
    problems.append(f"README.md has {lines} lines; at most 300 (move details into docs/)")

# 2. Links.
docs = os.path.join(SRC, "docs")
pages = [readme] + sorted(os.path.join(docs, f) for f in (os.listdir(docs) if os.path.isdir(docs) else [])
                          if f.endswith(".md"))
for page in pages:
    text = re.sub(r"```.*?```", "", read(page), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        where = os.path.relpath(page, SRC)
        if not os.path.exists(dest):
            problems.append(f"{where}: link to {target}: {os.path.relpath(dest, SRC)} does not exist")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            problems.append(f"{where}: link to {target}: no heading with that anchor in {os.path.relpath(dest, SRC)}")

# 3. Every flag of every --help in docs/flags.md.
flags_md = read(os.path.join(SRC, "docs", "flags.md"))
documented = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", flags_md))
helps = [["mglaunch", "--help"], ["mglaunch", "--hostfile", "/dev/null", "--help"], ["mglaunch", "doctor", "--help"],
         ["mglaunch-rdzv", "--help"], ["mglaunch-sbatch", "--help"], ["mgtrain", "--help"]]
for argv in helps:
    exe = os.path.join(BIN, argv[0])
    if not os.path.exists(exe):
        if argv[0] in ("mgtrain", "mglaunch-sbatch"):  # optional targets (LibTorch; the Slurm wrapper)
            print(f"note: {argv[0]} is not built: its flags are not checked", flush=True)
            continue
        problems.append(f"{exe} does not exist; build it first")
        continue
    r = subprocess.run([exe] + argv[1:], capture_output=True, text=True, timeout=60)
    shown = " ".join(argv)
    if r.returncode != 0:
        problems.append(f"`{shown}` exited {r.returncode}")
        continue
    for line in (r.stdout + r.stderr).splitlines():
        # A flag column: "  -t,--time TEXT", "  --hostfile FILE", "  --monitor [=SECONDS]".
        m = re.match(r"\s+((?:-{1,2}[\w-]+,?)+)", line)
        if not m:
            continue
        for flag in m.group(1).split(","):
            name = flag[2:]
            spellings = {flag, "--" + name.replace("_", "-"), "--" + name.replace("-", "_")}
            if flag.startswith("--") and not spellings & documented:
                problems.append(f"docs/flags.md does not name {flag} (from `{shown}`)")

# 4. Every MGLAUNCH_* variable the product reads.
names = set()
for room in ROOMS:
    for root, _, files in os.walk(os.path.join(SRC, room)):
        for f in files:
            if f.endswith((".cc", ".h")):
                names |= set(re.findall(r'"(MGLAUNCH_[A-Z0-9_]*[A-Z0-9])=?"', read(os.path.join(root, f))))
for name in sorted(names):
    if name not in flags_md and not any(n.startswith(name) and n != name for n in names):
        problems.append(f"docs/flags.md does not name the environment variable {name}")

# 5. The design note covers every room.
design = read(os.path.join(SRC, "docs", "design.md"))
for room in ROOMS:
    if f"| `{room}/` |" not in design:
        problems.append(f"docs/design.md has no row for the room {room}/")
# ... and the README's rooms section names every room, and their number.
readme_text = read(os.path.join(SRC, "README.md"))
for room in ROOMS:
    if f"**`{room}/`**" not in readme_text:
        problems.append(f"README.md's rooms section does not name {room}/")
NUMBERS = ["ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen"]
said = re.search(r"The product is (\w+) rooms", readme_text)
if not said or said.group(1) != NUMBERS[len(ROOMS) - 10]:
    problems.append(f"README.md should say 'The product is {NUMBERS[len(ROOMS) - 10]} rooms' ({len(ROOMS)} in all)")

# 6. The front door's `make run` installs only what building and running the main job needs
# (RUN_DEBS), not every test's package (#38): what `make -n run` would install.
try:
    dry = subprocess.run(["make", "-n", "-C", SRC, "run", "BUILD_DIR=/nonexistent-mglaunch-build"],
                         capture_output=True, text=True, timeout=60)
    listed = re.search(r"for p in ([^;]*);", dry.stdout)
    if not listed:
        problems.append("`make -n run` shows no package list it installs from")
    else:
        test_only = {"chromium", "chromium-driver", "python3-selenium", "slurm-wlm", "prometheus", "etcd-server",
                     "etcd-client", "libclang-rt-14-dev", "catch2", "openssh-server", "hyperfine", "gnuplot-nox"}
        extra = sorted(test_only & set(listed.group(1).split()))
        if extra:
            problems.append(f"`make run` installs test-only packages: {', '.join(extra)} (give it a list of its own)")
except (OSError, subprocess.TimeoutExpired) as e:
    problems.append(f"cannot run `make -n run`: {e}")

for p in problems:
    print(p)
print(f"docs: {len(pages)} pages, {len(problems)} problem(s)")
sys.exit(1 if problems else 0)
