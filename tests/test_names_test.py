#!/usr/bin/python3
"""Every Catch2 test name can be a ctest name: catch_discover_tests splits a name at ';'
(the halves then fail as tests that do not exist), a name that starts with '--' reads
as a flag, and a backslash is an escape in Catch's filter (the name then matches no test). Usage: test_names_test.py TESTS_DIR. Exit 0 when all hold, 1 with one line per
bad name."""
import glob
import os
import re
import sys

bad = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.cc"))):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for m in re.finditer(r'TEST_CASE\(((?:\s*"(?:[^"\\]|\\.)*")+)', text):
        name = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(1)))
        if ";" in name or "\\" in name or name.startswith("--"):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{os.path.basename(path)}:{line}: test name with ';', a backslash or a leading '--': {name[:80]}")
for b in bad:
    print(b)
sys.exit(1 if bad else 0)
