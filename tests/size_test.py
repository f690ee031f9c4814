#!/usr/bin/python3
"""The product's size rules (issue #36, Done when): no product source file over 1,000 lines
and no function over 200. A reviewer reads a file or a function whole; past these sizes
one no longer can. It reads every .h and .cc in the rooms (the folders docs/design.md's
rooms table names; tests/ and bench/ are not product) and fails, one line per breach, on

  * a file of more than MAX_FILE lines;
  * a function body of more than MAX_FUNCTION lines, counted from the line of its opening
    brace to the line of its closing one. A function is a brace block at namespace or
    class scope whose head (the text since the previous ';', '{' or '}') has a parameter
    list and is not a namespace, class, struct, union, enum or an initializer ('= {').
    Lambdas and blocks inside a function count as part of it.

Comments, string and character literals are blanked first, so braces in them do not count.

Usage: size_test.py SOURCE_DIR. Exit 0 when all hold, 1 with one line per breach.
"""
import os
import re
import sys

MAX_FILE = 1000
MAX_FUNCTION = 200

SRC = sys.argv[1]


def rooms():
    with open(os.path.join(SRC, "docs/design.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("| room | owns | may use |", 1)[-1].split("\n\n", 1)[0]
    found = re.findall(r"^\| `([a-z_]+)/` \|", table, flags=re.M)
    if not found:
        sys.exit("docs/design.md has no rooms table: the size test cannot tell which folders are product")
    return found


def blank(text):
    """text with comments, string and character literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            # A digit separator (1'000) is not a character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "#" and (i == 0 or text[i - 1] == "\n"):
            # A preprocessor line (with its continuations) holds no function.
            j = i
            while True:
                k = text.find("\n", j)
                if k < 0:
                    k = n
                    break
                if text[k - 1] != "\\":
                    break
                j = k + 1
            out.append(re.sub(r"[^\n]", " ", text[i:k]))
            i = k
        else:
            out.append(c)
            i += 1
    return "".join(out)


CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum)\b")


def function_name(head):
    """The name before a function head's parameter list (the first '(' outside <...>)."""
    depth = 0
    for i, ch in enumerate(head):
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif ch == "(" and depth == 0:
            m = re.search(r"([~\w:]+(?:\s*operator\s*\S+)?)\s*$", head[:i])
            return m.group(1) if m else head[:40]
    return head[:40]


def functions(text):
    """(name, first line, line count) of every function body at namespace or class scope."""
    text = blank(text)
    stack = []  # per open brace: ("container" | "function" | "other", start line, name)
    head_start = 0
    line = 1
    found = []
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            head = text[head_start:i]
            in_function = any(kind != "container" for kind, _, _ in stack)
            if in_function:
                kind, name = "other", ""
            else:
                flat = " ".join(head.split())
                depth, top = 0, []
                for ch in flat:  # the head's text outside parentheses and angle brackets
                    if ch in "(<":
                        depth += 1
                    elif ch in ")>" and depth:
                        depth -= 1
                    elif depth == 0:
                        top.append(ch)
                top = "".join(top)
                if "(" in flat and not CONTAINER.match(flat.lstrip()) and not re.search(r"=\s*$", top) \
                        and not re.match(r"(template\s*<.*>\s*)?(class|struct|union)\b", flat):
                    kind, name = "function", function_name(flat)
                elif CONTAINER.search(top) or flat.startswith("extern"):
                    kind, name = "container", ""
                else:
                    kind, name = "other", ""
            stack.append((kind, line, name))
            head_start = i + 1
        elif c == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    found.append((name, start, line - start + 1))
            head_start = i + 1
        elif c == ";":
            head_start = i + 1
    return found


def main():
    problems = []
    for room in rooms():
        top = os.path.join(SRC, room)
        for dirpath, _, files in os.walk(top):
            for f in sorted(files):
                if not f.endswith((".h", ".cc")):
                    continue
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, SRC)
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
                lines = text.count("\n")
                if lines > MAX_FILE:
                    problems.append(f"{rel}: {lines} lines, over {MAX_FILE}: move a cohesive part into a file of its own")
                for name, start, count in functions(text):
                    if count > MAX_FUNCTION:
                        problems.append(f"{rel}:{start}: {name}() is {count} lines, over {MAX_FUNCTION}: "
                                        "move cohesive steps into functions of their own")
    for p in problems:
        print(p)
    if "-v" in sys.argv:
        return 0
    if problems:
        print(f"{len(problems)} breach(es) of the size rules (issue #36)")
        return 1
    print("every product file is at most 1000 lines and every function at most 200")
    return 0


if __name__ == "__main__":
    sys.exit(main())
