#!/usr/bin/env python3
"""The sample outputs shown in the docs, written from real runs.

    scripts/samples.py update BUILD_DIR DOC.md...   rerun each sample's command, rewrite its block
    scripts/samples.py check BUILD_DIR DOC.md...    fail where a sample no longer has the format
                                                    of its program's output

A sample is a fenced block right after a comment naming the command that
wrote it, a program of BUILD_DIR and its arguments:

    <!-- sample: apps/attn_demo --seq 8 -->
    ```text
    ...
    ```

`check` compares line by line with every number replaced by '#' and runs of
spaces by one, so timings may differ but a changed, added or missing line
fails, naming the doc and the command. The commands run with CUDA hidden,
so a sample reads the same on any machine, from a fresh temporary folder.
"""
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile

MARKER = re.compile(r"^<!-- sample: (?P<command>.+?) -->\s*$")
NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|\b(nan|inf)\b")


def samples_of(lines):
    """(marker index, fence start, fence end, command) for each sample."""
    found = []
    for i, line in enumerate(lines):
        match = MARKER.match(line)
        if not match:
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise SystemExit("line %d: a sample marker must be followed by a fenced block" % (i + 1))
        end = i + 2
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if end == len(lines):
            raise SystemExit("line %d: the sample's block never closes" % (i + 2))
        found.append((i, i + 1, end, match.group("command")))
    return found


def run(build_dir, command):
    args = shlex.split(command)
    program = os.path.abspath(os.path.join(build_dir, args[0]))
    if not os.access(program, os.X_OK):
        raise SystemExit("%s is not built (build %s first)" % (program, args[0]))
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory() as folder:
        done = subprocess.run([program] + args[1:], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=240)
    if done.returncode != 0:
        raise SystemExit("'%s' exited with %d:\n%s" % (command, done.returncode, done.stderr))
    return done.stdout.rstrip("\n").split("\n")


def shape(lines):
    return [re.sub(r"\s+", " ", NUMBER.sub("#", line)).strip() for line in lines]


def main():
    if len(sys.argv) < 4 or sys.argv[1] not in ("update", "check"):
        raise SystemExit(__doc__)
    mode, build_dir, docs = sys.argv[1], sys.argv[2], sys.argv[3:]
    failures = 0
    for doc in docs:
        with open(doc, encoding="utf-8") as f:
            lines = f.read().split("\n")
        # From the last sample up, so that rewriting one keeps the others' indices.
        for _, start, end, command in reversed(samples_of(lines)):
            output = run(build_dir, command)
            if mode == "update":
                lines[start + 1:end] = output
                continue
            shown = lines[start + 1:end]
            if shape(shown) != shape(output):
                failures += 1
                diff = difflib.unified_diff(shown, output, "%s (shown)" % doc, command, lineterm="")
                print("\n".join(diff))
        if mode == "update":
            with open(doc, "w", encoding="utf-8") as f:
                f.write("\n".join(lines))
    if failures:
        print("%d sample(s) no longer match their program's output: "
              "run scripts/samples.py update BUILD_DIR DOC.md..." % failures)
        sys.exit(1)
    print("every sample has its program's current format")


if __name__ == "__main__":
    main()
