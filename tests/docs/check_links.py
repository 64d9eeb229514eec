#!/usr/bin/env python3
"""Every relative link of the docs leads somewhere.

    tests/docs/check_links.py DOC.md...

A link to a file must name one that exists, and a link to a heading
(`file.md#heading` or `#heading`) one that the file has, with GitHub's
anchors: lowercase, punctuation dropped, spaces as hyphens, and -1, -2 ...
after repeated headings. Links with a scheme (https:) are not followed.
Prints each broken link with its file and line; exits 1 if there are any.
"""
import functools
import os
import re
import sys

LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")


@functools.lru_cache(maxsize=None)
def anchors_of(path):
    anchors, seen, fenced = set(), {}, False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("```"):
                fenced = not fenced
            match = None if fenced else HEADING.match(line)
            if not match:
                continue
            text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", match.group(2))
            anchor = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            anchors.add(anchor if count == 0 else "%s-%d" % (anchor, count))
    return anchors


def broken_links(doc):
    broken, fenced = [], False
    with open(doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            fenced = not fenced
        if fenced:
            continue
        for target in LINK.findall(line):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
            if not os.path.exists(resolved):
                broken.append((number, target, "no such file"))
            elif anchor and resolved.endswith(".md") and anchor not in anchors_of(resolved):
                broken.append((number, target, "no such heading"))
    return broken


def main():
    failures = 0
    for doc in sys.argv[1:]:
        for number, target, why in broken_links(doc):
            print("%s:%d: %s: %s" % (doc, number, target, why))
            failures += 1
    if failures:
        sys.exit(1)
    print("every link of %d docs leads somewhere" % len(sys.argv[1:]))


if __name__ == "__main__":
    main()
