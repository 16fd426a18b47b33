#!/usr/bin/env python3
"""Checks that every citation in the code and docs resolves (run by .ci/run; exit 1 names each broken one).

- "DESIGN.md section N[.M]" / "sections N-M" / "DESIGN.md step(s) N": the section heading ("## N." / "### N.M") or the
  step exists in docs/DESIGN.md (steps 1-11 are defined in its sections 2-3); likewise "PERFORMANCE.md section N" and
  "SCALING.md section N".
- "docs/notes/<topic>.md" and any other repository path with a known file ending (src/..., include/..., tests/...,
  tools/..., docs/..., scripts/..., python/..., bench/..., examples/..., .ci/...): the file exists.
- In docs/*.md and README.md, a file name in backticks (`name.cuh`, `instances/varlen_k.cu`): some tracked file ends
  with that path.
Usage: scripts/check_citations.py [repository root, default: this script's parent folder]
"""
import os
import re
import subprocess
import sys

ROOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), ".."))
SCANNED = (".h", ".cuh", ".cu", ".cpp", ".py", ".md", ".txt", ".cmake", ".sh", ".json", ".toml", ".cfg")
ENDINGS = r"(?:h|cuh|cu|cpp|py|md|txt|cmake|sh|json|png|toml)"
ROOTS = r"(?:src|include|tests|tools|docs|scripts|python|bench|examples|\.ci|cmake)"

PATH_RE = re.compile(r"(?<![\w./-])(" + ROOTS + r"/[\w./+-]*?\." + ENDINGS + r")(?![\w])")
SECTION_RE = re.compile(
    r"\b(DESIGN|PERFORMANCE|SCALING)\.md,?\s+(sections?|steps?)\s+(\d+(?:\.\d+)?)(?:\s*(?:-|and|,)\s*(\d+(?:\.\d+)?))?")
BACKTICK_RE = re.compile(r"`([\w./-]+\.(?:h|cuh|cu|cpp|py|cmake|sh))`")


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        files = [f for f in out.splitlines() if f and os.path.exists(os.path.join(ROOT, f))]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, _, names in os.walk(ROOT):
            if "/build" in d or "/.git" in d or "third_party" in d:
                continue
            files += [os.path.relpath(os.path.join(d, n), ROOT) for n in names]
    return sorted(f for f in files if not f.startswith(("third_party/", "build/")))


# Paths of other packages that the build cites (not files of this repository).
EXTERNAL = {"include/nccl.h"}


def relative_to_ancestor(citing, p, file_set):
    """A path written relative to a folder above the citing file (python/tests citing tests/reference.py)."""
    d = os.path.dirname(citing)
    while d:
        if os.path.join(d, p) in file_set:
            return True
        d = os.path.dirname(d)
    return False


def headings(doc):
    path = os.path.join(ROOT, "docs", doc)
    found = set()
    if os.path.exists(path):
        for line in open(path, encoding="utf-8"):
            m = re.match(r"#+\s+(\d+(?:\.\d+)?)[.\s]", line)
            if m:
                found.add(m.group(1))
    return found


def main():
    files = tracked_files()
    file_set = set(files)
    sections = {d: headings(d + ".md") for d in ("DESIGN", "PERFORMANCE", "SCALING")}
    errors = []
    for f in files:
        if not f.endswith(SCANNED) or f.startswith("scripts/check_citations.py"):
            continue
        try:
            text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in PATH_RE.finditer(line):
                p = m.group(1).rstrip(".")
                if "*" in p or "<" in p or p in file_set or os.path.isdir(os.path.join(ROOT, p)):
                    continue
                if os.path.exists(os.path.join(ROOT, p)):  # e.g. an ignored but present file
                    continue
                if relative_to_ancestor(f, p, file_set) or p in EXTERNAL:
                    continue
                errors.append(f"{f}:{n}: no such file: {p}")
            for m in SECTION_RE.finditer(line):
                doc, kind, a, b = m.group(1), m.group(2), m.group(3), m.group(4)
                if kind.startswith("step"):
                    for s in (a, b):
                        if s is not None and not (1 <= float(s) <= 11):
                            errors.append(f"{f}:{n}: {doc}.md has no step {s} (steps 1-11)")
                    continue
                for s in (a, b):
                    if s is not None and s not in sections[doc]:
                        errors.append(f"{f}:{n}: {doc}.md has no section {s}")
            if f.endswith(".md") and (f.startswith("docs/") or f == "README.md"):
                for m in BACKTICK_RE.finditer(line):
                    name = m.group(1)
                    if not any(x == name or x.endswith("/" + name) for x in files):
                        errors.append(f"{f}:{n}: no file named {name}")
    for e in errors:
        print(e)
    print(f"check_citations: {len(errors)} broken citation(s) in {len(files)} files", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
