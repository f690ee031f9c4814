#!/usr/bin/python3
"""The rooms depend downward only, as docs/design.md's table says (issue #36). Every target
exports the project root as an include directory, so the compiler cannot see a forbidden
edge; this test can. It reads:

  * the rooms table of docs/design.md ("Rooms: what each owns and what it may use"): a row
    per room, low to high; the rooms it may use are the `room/` names in its "may use"
    cell, up to the word "never" (what follows says what it must not use); "every room
    above" means every row above it;
  * the table of files with a rule of their own (the programs' mains and one exception):
    such a file may use what its room may use and the rooms its row names;

and fails, one line per breach, when
  * a product source file (.h or .cc in a room's folder) includes `other_room/...` that
    its room (or its own row) may not use;
  * a room's CMakeLists.txt links a target (mg_*) of a room that the linking target's
    sources may not use;
  * a room's header includes another room's header while the room's library links that
    room PRIVATE (or not at all): its users would then include what they cannot link.

Usage: layering_test.py SOURCE_DIR. Exit 0 when all hold, 1 with one line per breach.
"""
import os
import re
import sys

SRC = sys.argv[1]
problems = []


def read(rel):
    with open(os.path.join(SRC, rel), encoding="utf-8") as f:
        return f.read()


def table_rows(text, header_start):
    """The rows (lists of cells) of the markdown table whose header row starts with header_start."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    sys.exit(f"docs/design.md has no table starting with {header_start!r}: the layering test cannot read the rules")


def rooms_named(cell, rooms):
    """The rooms a 'may use' cell allows: `room/` names before the word 'never'."""
    cell = re.split(r"\bnever\b", cell)[0]
    return {name for name in re.findall(r"`([a-z_]+)/`", cell) if name in rooms}


design = read("docs/design.md")
room_rows = table_rows(design, "| room | owns | may use |")
order = [re.fullmatch(r"`([a-z_]+)/`", r[0]).group(1) for r in room_rows]
rooms = set(order)
allowed = {}
for i, (first, _, may_use) in enumerate(room_rows):
    room = order[i]
    allowed[room] = rooms_named(may_use, rooms)
    if "every room above" in may_use:
        allowed[room] |= set(order[:i])
file_allowed = {}
for first, _, may_use in table_rows(design, "| file | what | may use |"):
    path = re.fullmatch(r"`([a-z_]+/[\w.]+)`", first).group(1)
    file_allowed[path] = allowed[path.split("/")[0]] | rooms_named(may_use, rooms)


def may_use(path):
    return file_allowed.get(path, allowed[path.split("/")[0]])


# 1. The #include lines of every product source file.
include_re = re.compile(r'^\s*#\s*include\s+"([a-z_]+)/[^"]+"', re.M)
for room in order:
    for dirpath, _, names in os.walk(os.path.join(SRC, room)):
        for name in sorted(names):
            if not name.endswith((".h", ".cc")):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), SRC)
            for other in sorted(set(include_re.findall(read(rel)))):
                if other in rooms and other != room and other not in may_use(rel):
                    problems.append(f"{rel} includes {other}/, which docs/design.md's rooms table does not let "
                                    f"{room}/ use: move the shared piece down, or write the edge in the table first")

# 2. The links of every room's CMakeLists.txt, and 3. its headers against PUBLIC links.
target_room = {}
for room in order:
    for m in re.finditer(r"add_(?:library|executable)\((mg_[a-z_]+)", read(f"{room}/CMakeLists.txt")):
        target_room.setdefault(m.group(1), room)


def sources_of(cmake, target):
    """The source files an add_library/add_executable of `target` names (${var} from set())."""
    sets = {m.group(1): m.group(2).split() for m in re.finditer(r"set\((\w+)\s+([^)]*)\)", cmake)}
    m = re.search(r"add_(?:library|executable)\(" + re.escape(target) + r"\b([^)]*)\)", cmake)
    out = []
    for word in (m.group(1).split() if m else []):
        v = re.fullmatch(r"\$\{(\w+)\}", word)
        out += sets.get(v.group(1), []) if v else [word]
    return [w for w in out if w.endswith((".cc", ".h"))]


links = {}  # target -> [(linked target, scope)]
for room in order:
    cmake = read(f"{room}/CMakeLists.txt")
    for m in re.finditer(r"target_link_libraries\(([\w-]+)([^)]*)\)", cmake):
        target, scope = m.group(1), "PUBLIC"
        srcs = [f"{room}/{s}" for s in sources_of(cmake, target)]
        uses = set(allowed[room]).union(*[may_use(s) for s in srcs])
        for word in m.group(2).split():
            if word in ("PUBLIC", "PRIVATE", "INTERFACE"):
                scope = word
                continue
            other = target_room.get(word)
            if other is None or other == room:
                continue
            links.setdefault(target, []).append((word, scope))
            if other not in uses:
                problems.append(f"{room}/CMakeLists.txt: {target} links {word} ({other}/), which docs/design.md's "
                                f"rooms table does not let it use")


def public_rooms(target, seen=None):
    """The rooms whose libraries `target`'s users link through it (PUBLIC/INTERFACE, transitively)."""
    seen = set() if seen is None else seen
    for other, scope in links.get(target, []):
        if scope != "PRIVATE" and other not in seen:
            seen.add(other)
            public_rooms(other, seen)
    return {target_room[t] for t in seen}


for room in order:
    target = f"mg_{room}"
    public = public_rooms(target)
    for dirpath, _, names in os.walk(os.path.join(SRC, room)):
        for name in sorted(names):
            if not name.endswith(".h"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), SRC)
            for other in sorted(set(include_re.findall(read(rel)))):
                if other in rooms and other != room and other not in public:
                    problems.append(f"{rel} (a header of {target}) includes {other}/ but {target} does not link "
                                    f"mg_{other} PUBLIC: its users would include what they do not link")

for p in problems:
    print(p)
if not problems:
    print(f"layering holds: {len(order)} rooms, {len(file_allowed)} files with their own rule")
sys.exit(1 if problems else 0)
