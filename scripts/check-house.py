#!/usr/bin/env python3
"""The rules of the house (docs/DESIGN.md, "The layers"), checked on the source tree:

  1. every #include "meshgrad/<layer>/..." in src/<layer>/, include/meshgrad/<layer>/ and
     tests/<layer>/ names the layer itself or one below it, as the CMake targets link them (the DAG
     is read from the meshgrad_layer(NAME DEPS ...) lines of CMakeLists.txt, so it is declared once);
  2. tools/, python/ and examples/ include only installed headers ("meshgrad/...") and their own folder's files,
     python/ none of tools/';
  3. no two files include each other, directly or through others (no circle between files);
  4. no source file of the library is over 1,000 lines, no function of the library, the CLI or the
     Python module over 120 lines (Universal Ctags' function extents; tests are not counted);
  5. no folder under src/ holds more than a quarter of the library's lines;
  6. each test file (tests/<layer>/*.cpp) and each command (tools/cmd_*.cpp) keeps its code in a
     namespace named after the file, with no anonymous namespace or using-directive at file scope:
     they compile in unity batches (CMakeLists.txt, MESHGRAD_UNITY), where two files' local names or
     using-directives would otherwise meet, in whatever batch a new file happens to land.

Prints every violation and exits 1 if there is one, 0 otherwise. Run from anywhere:
  python3 scripts/check-house.py [--root DIR]
"""
import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 120
MAX_FOLDER_SHARE = 0.25

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_dag(root):
    """{layer: set of layers it may use (itself and everything below)} from CMakeLists.txt."""
    text = open(os.path.join(root, "CMakeLists.txt")).read()
    # Expand the lists a DEPS may name (set(comm_deps meshgrad_tensor) ... DEPS ${comm_deps}).
    for var, value in re.findall(r"^set\((\w+)\s+([^)]*)\)", text, re.M):
        text = text.replace("${" + var + "}", value)
    direct = {}
    for m in re.finditer(r"^meshgrad_layer\((\w+)\s+DEPS\s+([^)]*)\)", text, re.M):
        deps = re.findall(r"meshgrad_(\w+)", m.group(2))
        direct[m.group(1)] = [d for d in deps if d != "openblas"]
    closure = {}

    def below(layer, seen=()):
        if layer in closure:
            return closure[layer]
        if layer in seen:
            raise SystemExit(f"check-house: the layers of CMakeLists.txt form a circle through {layer}")
        out = {layer}
        for d in direct.get(layer, []):
            out |= below(d, seen + (layer,))
        closure[layer] = out
        return out

    for layer in direct:
        below(layer)
    return closure


def files_under(root, folder, exts=(".cpp", ".hpp", ".h")):
    base = os.path.join(root, folder)
    for dirpath, _, names in os.walk(base):
        for n in sorted(names):
            if n.endswith(exts):
                yield os.path.relpath(os.path.join(dirpath, n), root)


def count_lines(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return sum(1 for _ in f)


def check_layers(root, dag, problems):
    for layer, allowed in sorted(dag.items()):
        for folder in (f"src/{layer}", f"include/meshgrad/{layer}", f"tests/{layer}"):
            for path in files_under(root, folder):
                for inc in INCLUDE.findall(open(os.path.join(root, path)).read()):
                    m = re.match(r"meshgrad/(\w+)/", inc)
                    if m and m.group(1) not in allowed:
                        problems.append(f"{path}: includes {inc}: layer '{m.group(1)}' is not below '{layer}' "
                                        f"(CMakeLists.txt links {layer} to {', '.join(sorted(allowed - {layer}))})")
    for folder in ("tools", "python", "examples"):
        for path in files_under(root, folder):
            here = os.path.dirname(path)
            for inc in INCLUDE.findall(open(os.path.join(root, path)).read()):
                if inc.startswith("meshgrad/"):
                    if not os.path.exists(os.path.join(root, "include", inc)):
                        problems.append(f"{path}: includes {inc}, which is not an installed header")
                    continue
                local = os.path.normpath(os.path.join(here, inc))
                if not (os.path.exists(os.path.join(root, local)) and local.startswith(folder + "/")):
                    problems.append(f"{path}: includes \"{inc}\": {folder}/ may include only installed headers"
                                    + " and its own files")


def resolve(root, path, inc):
    for cand in (os.path.join("include", inc), os.path.join("src", inc), os.path.join(os.path.dirname(path), inc)):
        if os.path.exists(os.path.join(root, cand)):
            return os.path.normpath(cand)
    return None


def check_circles(root, problems):
    """Two kinds of circle: files that include each other (directly or through others), and modules
    that use each other, a module being a header with a source of the same name (foo.hpp + foo.cpp):
    foo.hpp including bar.hpp while bar.cpp includes foo.hpp is the circle of nn/invariant and
    nn/layers the 2026-11-25 review named. A header without a source of its own (a private helper
    such as comm/detail.hpp, an inline header such as tensor/iter.hpp) is part of whoever includes
    it, so it passes the arrows through."""
    paths = [p for folder in ("src", "include", "tools", "python") for p in files_under(root, folder)]
    includes = {p: [t for t in (resolve(root, p, inc) for inc in INCLUDE.findall(open(os.path.join(root, p)).read()))
                    if t] for p in paths}

    def module(p):
        stem = os.path.splitext(os.path.basename(p))[0]
        if p.startswith("include/meshgrad/"):
            sub = os.path.dirname(p)[len("include/meshgrad/"):]
            header, source = p, os.path.join("src", sub, stem + ".cpp")
        else:
            header = os.path.join("include/meshgrad", os.path.dirname(p)[len("src/"):], stem + ".hpp")
            source = os.path.join(os.path.dirname(p), stem + ".cpp")
            if not os.path.exists(os.path.join(root, header)):
                header = os.path.join(os.path.dirname(p), stem + ".hpp")
        if os.path.exists(os.path.join(root, header)) and os.path.exists(os.path.join(root, source)):
            return os.path.join(os.path.dirname(source), stem)
        return None

    def strongly_connected(graph):
        index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

        def visit(v):
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w in graph.get(v, ()):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))

        sys.setrecursionlimit(10000)
        for v in list(graph):
            if v not in index:
                visit(v)
        return comps

    for comp in strongly_connected(includes):
        problems.append("files that include each other: " + " <-> ".join(comp))
    # Module graph: arrows from a module's files to the modules they reach, through headers that are
    # no module.
    graph = collections.defaultdict(set)
    for p in paths:
        m = module(p)
        if m is None:
            continue
        seen, todo = set(), list(includes[p])
        while todo:
            t = todo.pop()
            if t in seen:
                continue
            seen.add(t)
            n = module(t)
            if n is None:
                todo.extend(includes.get(t, ()))
            elif n != m:
                graph[m].add(n)
    for comp in strongly_connected(graph):
        problems.append("modules that use each other: " + " <-> ".join(comp))


def check_sizes(root, problems):
    library = [p for folder in ("src", "include/meshgrad") for p in files_under(root, folder)]
    lines = {p: count_lines(os.path.join(root, p)) for p in library}
    total = sum(lines.values())
    per_folder = collections.Counter()
    for p, n in lines.items():
        parts = p.split("/")
        layer = parts[1] if parts[0] == "src" else parts[2]
        per_folder[layer] += n
        if p.startswith("src/") and n > MAX_FILE_LINES:
            problems.append(f"{p}: {n} lines (at most {MAX_FILE_LINES})")
    for layer, n in per_folder.most_common():
        if n > MAX_FOLDER_SHARE * total:
            problems.append(f"src/{layer} (with its headers): {n} of the library's {total} lines "
                            f"({100.0 * n / total:.0f}%, at most {100 * MAX_FOLDER_SHARE:.0f}%)")
    return total, per_folder


def check_functions(root, problems):
    ctags = shutil.which("ctags")
    if ctags is None:
        problems.append("Universal Ctags is not installed (Debian package universal-ctags): function lengths "
                        "cannot be checked")
        return
    paths = [p for folder in ("src", "include/meshgrad", "tools", "python") for p in files_under(root, folder)]
    out = subprocess.run([ctags, "--output-format=json", "--fields=+neK", "--language-force=c++", "-f", "-"] + paths,
                         cwd=root, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        t = json.loads(line)
        if t.get("kind") != "function" or "end" not in t:
            continue
        n = t["end"] - t["line"] + 1
        if n > MAX_FUNCTION_LINES:
            problems.append(f"{t['path']}:{t['line']}: function {t['name']} is {n} lines (at most "
                            f"{MAX_FUNCTION_LINES})")


NAMESPACE_OPEN = re.compile(r'^namespace ([\w:]*) ?\{')
NAMESPACE_CLOSE = re.compile(r'^\}\s*//\s*namespace')


def file_scope_leaks(text):
    """(line, what) of each anonymous namespace or using-directive at file scope: the namespace blocks
    are followed by their column-0 openings and their closing comments, as the code base writes them."""
    depth, leaks = 0, []
    for number, line in enumerate(text.splitlines(), 1):
        opened = NAMESPACE_OPEN.match(line)
        if opened:
            if depth == 0 and not opened.group(1):
                leaks.append((number, "namespace {"))
            depth += 1
        elif NAMESPACE_CLOSE.match(line):
            depth -= 1
        elif depth == 0 and line.startswith("using namespace "):
            leaks.append((number, line.strip()))
    return leaks


def check_unity_namespaces(root, problems):
    files = [p for p in files_under(root, "tests", exts=(".cpp",)) if p.count("/") == 2]
    files += [p for p in files_under(root, "tools", exts=(".cpp",)) if os.path.basename(p).startswith("cmd_")]
    for p in files:
        stem = os.path.splitext(os.path.basename(p))[0]
        with open(os.path.join(root, p), encoding="utf-8") as f:
            text = f.read()
        if not re.search(r'^namespace (?:[\w:]+::)?%s \{$' % re.escape(stem), text, re.M):
            problems.append(f"{p}: its code is not in a namespace named {stem} (a unity batch would mix its "
                            f"local names with the other files')")
        for line, what in file_scope_leaks(text):
            problems.append(f"{p}:{line}: '{what}' at file scope reaches the next file of its unity batch; put it "
                            f"inside namespace {stem}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    parser.add_argument("--summary", action="store_true", help="print the lines per folder")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    problems = []
    dag = layer_dag(root)
    check_layers(root, dag, problems)
    check_circles(root, problems)
    total, per_folder = check_sizes(root, problems)
    check_functions(root, problems)
    check_unity_namespaces(root, problems)
    if args.summary:
        for layer, n in per_folder.most_common():
            print(f"{layer:<12} {n:>6} lines {100.0 * n / total:5.1f}%")
    for p in problems:
        print("check-house:", p)
    print(f"check-house: {len(dag)} layers, {total} library lines, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
