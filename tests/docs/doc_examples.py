#!/usr/bin/env python3
"""Turns every C++ block of the Markdown docs into code that ctest compiles
and runs, so that an example cannot go stale.

    tests/docs/doc_examples.py OUT_DIR DOC.md...

A block is a fence opened by ```cpp (or c++, cxx; ~~~ alike). One that
defines `int main()` is a whole program, whose main must end with
`return` unless it returns nothing at all; any other is the body of a
function. Either may be preceded
by a hidden comment that the rendered page does not show:

    <!-- doc-test [compile-only: REASON]
    code run before the block (setup it needs but the reader does not)
    -->

Setup is for function bodies; a whole program holds its own. compile-only
blocks are compiled but not run (REASON says why: they need ranks, files
or a GPU). Every block's #include lines are gathered at the top of one
program, after LibTorch's precompiled header: a block that forgets one may
still compile. Blocks that use attn::distributed go to a second
program, linked with it.

Writes OUT_DIR/attn_doc_examples.cpp, OUT_DIR/attn_doc_examples_distributed.cpp (each a
program that runs the example its argument names) and OUT_DIR/tests.cmake
(one attn_doc_example(<name> <program> <run|compile-only>) line per block),
rewriting only files whose content changed.
"""
import os
import re
import sys

FENCE = re.compile(r"^(?P<marker>```|~~~)\s*(cpp|c\+\+|cxx)\b.*$", re.IGNORECASE)
HIDDEN_START = re.compile(r"^<!-- doc-test\b(?P<directive>.*)$")
MAIN = re.compile(r"\bint\s+main\s*\(\s*\)")


class Example:
    """A block: its test name (the doc's stem and the block's number in the
    doc, which prose edits leave alone), where it is, its code and setup."""

    def __init__(self, doc, number, line, code, setup, compile_only):
        self.name = "%s.%d" % (os.path.splitext(os.path.basename(doc))[0], number)
        self.doc, self.line = doc, line
        self.code, self.setup, self.compile_only = code, setup, compile_only

    @property
    def distributed(self):
        return any("attn/distributed/" in line or "attn::distributed" in line
                   for line in self.setup + self.code)

    def includes(self):
        return [line for line in self.setup + self.code if line.lstrip().startswith("#include")]


def hidden_comment(lines, fence_index):
    """The doc-test comment right above the fence at fence_index, if any:
    (directive, setup lines)."""
    end = fence_index - 1
    if end < 0 or lines[end].strip() != "-->":
        if end >= 0:
            single = re.match(r"^<!-- doc-test\b(?P<directive>.*?)-->\s*$", lines[end])
            if single:
                return single.group("directive").strip(), []
        return None, []
    start = end - 1
    while start >= 0 and not HIDDEN_START.match(lines[start]):
        if lines[start].startswith("<!--"):
            return None, []
        start -= 1
    if start < 0:
        return None, []
    return HIDDEN_START.match(lines[start]).group("directive").strip(), lines[start + 1:end]


def examples_of(doc):
    with open(doc, encoding="utf-8") as f:
        lines = f.read().split("\n")
    found = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        directive, setup = hidden_comment(lines, i)
        end = i + 1
        while end < len(lines) and lines[end].strip() != fence.group("marker"):
            end += 1
        if end == len(lines):
            sys.exit("%s:%d: a ```cpp block that never closes" % (doc, i + 1))
        if directive and not directive.startswith("compile-only:"):
            sys.exit("%s:%d: doc-test takes 'compile-only: REASON', got '%s'" % (doc, i, directive))
        found.append(Example(doc, len(found) + 1, i + 2, lines[i + 1:end], setup, bool(directive)))
        i = end + 1
    return found


def body_of(example):
    """The example's code inside namespace doc_<n>, defining int run()."""
    code = [line for line in example.code if not line.lstrip().startswith("#include")]
    setup = [line for line in example.setup if not line.lstrip().startswith("#include")]
    out = []
    joined = "\n".join(code)
    if MAIN.search(joined):
        if any(not line.lstrip().startswith("#include") and line.strip() for line in example.setup):
            sys.exit("%s:%d: a whole program takes no setup" % (example.doc, example.line))
        # The last statement before main's closing brace says whether it
        # returns a value; -Werror=return-type catches a main that returns
        # on some paths only.
        statements = [line.strip() for line in code if line.strip()]
        returns = len(statements) >= 2 and statements[-2].startswith("return")
        renamed = MAIN.sub("int run()" if returns else "void run_body()", joined)
        out.append('#line %d "%s"' % (example.line, example.doc))
        out.append(renamed)
        if not returns:
            out.append("int run() {\n  run_body();\n  return 0;\n}")
        return out
    out.append("int run() {")
    out.extend(setup)
    out.append('#line %d "%s"' % (example.line, example.doc))
    out.extend(code)
    out.append("  return 0;\n}")
    return out


def program(examples):
    includes = ["#include <cstring>", "#include <exception>", "#include <iostream>"]
    for example in examples:
        for line in example.includes():
            if line.strip() not in includes:
                includes.append(line.strip())
    out = ["// Generated by tests/docs/doc_examples.py from the docs' C++ blocks."]
    out += includes
    out.append("")
    for n, example in enumerate(examples):
        out.append("namespace doc_%d { // %s" % (n, example.name))
        out += body_of(example)
        out.append("} // namespace doc_%d" % n)
        out.append("")
    out.append("namespace {")
    out.append("struct DocExample {\n  const char* name;\n  const char* where;\n  int (*run)();\n};")
    out.append("const DocExample kExamples[] = {")
    for n, example in enumerate(examples):
        out.append('    {"%s", "%s:%d", doc_%d::run},' % (example.name, example.doc, example.line, n))
    out.append("    {nullptr, nullptr, nullptr}};")
    out.append("} // namespace")
    out.append("""
// Runs the example named by the one argument.
int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: " << argv[0] << " EXAMPLE (a doc's name and the line of its block)\\n";
    return 2;
  }
  for (const DocExample* e = kExamples; e->name != nullptr; ++e) {
    if (std::strcmp(e->name, argv[1]) == 0) {
      try {
        return e->run();
      } catch (const std::exception& error) {
        std::cerr << e->name << " (" << e->where << ") threw: " << error.what() << "\\n";
        return 1;
      }
    }
  }
  std::cerr << "no example named " << argv[1] << "\\n";
  return 2;
}""")
    return "\n".join(out) + "\n"


def write_if_changed(path, text):
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    out_dir, docs = sys.argv[1], sys.argv[2:]
    os.makedirs(out_dir, exist_ok=True)
    examples = [e for doc in docs for e in examples_of(doc)]
    plain = [e for e in examples if not e.distributed]
    distributed = [e for e in examples if e.distributed]
    write_if_changed(os.path.join(out_dir, "attn_doc_examples.cpp"), program(plain))
    write_if_changed(os.path.join(out_dir, "attn_doc_examples_distributed.cpp"), program(distributed))
    tests = []
    for e in examples:
        target = "attn_doc_examples_distributed" if e.distributed else "attn_doc_examples"
        tests.append("attn_doc_example(%s %s %s)" % (e.name, target, "compile-only" if e.compile_only else "run"))
    write_if_changed(os.path.join(out_dir, "tests.cmake"), "\n".join(tests) + "\n")


if __name__ == "__main__":
    main()
