#!/usr/bin/env python3
"""Structure checks CI runs (scripts/test.sh):

1. No import circles. In every workspace crate, each source file is a module
   (`a/b.rs` is `a::b`). A module imports another when it names it, or an item
   in it, through `crate::…`, `super::…` or `self::…` (in `use` lines, braces
   expanded, or inline). Paths resolve to the deepest module file they name. A
   module naming its own ancestor or descendant is structure (a parent re-exports
   its children, a child uses its parent's items), not a circle; any other
   strongly connected set of modules is one, and is printed with its edges.
2. No long functions. In `node/` and `bootstrap/`, a `fn` whose body is longer
   than MAX_FN_LINES lines fails, unless it is listed in TABLES (functions that
   are tables, e.g. one arm per event).
3. A front-door README. README.md has at most MAX_README_LINES lines; the rest
   of the manual is the book in docs/ (mdBook layout).
4. No dead links in the docs. Every relative markdown link in README.md and
   docs/**/*.md names a file that exists (resolved against the linking file's
   folder; http(s) and mailto links are not followed), and a link with a
   `#anchor` into a markdown file (its own included) names a heading of that
   file, by GitHub's rule (lowercase; punctuation but `-` and `_` dropped;
   spaces to `-`; a repeated heading gets `-1`, `-2`, …). Every page
   docs/SUMMARY.md lists exists, and it lists every docs/*.md page.
5. Layers. No module under `node/src/diloco/` imports one under
   `node/src/commands/`: the roles are a library the commands drive, not the
   other way round (what both need lives in `training/`, `observe/` or the
   library crates).
6. Short files. No source file of a workspace crate is longer than
   MAX_FILE_LINES lines (in-file tests included), but those in OVER, each held
   at most at its listed length (they may only shrink, and leave the list once
   under the cap).
7. Signals are codes. No code outside tests in `node/src` decides on a reason's
   text (`reason.starts_with`, `.contains`, `.split_once`, `.ends_with`,
   `reason ==`): protocol signals and events carry typed fields.
8. No history. README.md, docs/ and comments say what is true now: HISTORY's
   phrases are refused there (the git log holds history).
9. Structs stay narrow. No struct has more than MAX_FIELDS named fields, but
   those in WIDE, each held at most at its listed count (they may only shrink),
   and records that are flags or data on the wire or on disk (deriving
   `clap::Args`, `clap::Parser`, `Serialize` or `Deserialize`, or in
   `schema/src`), whose width is the format's.

Exit status 1 with one line per finding; 0 and a summary otherwise.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CRATES = ["schema", "protocol", "graph", "runtime", "bootstrap", "node", "simulations"]
LONG_CHECKED = ["node", "bootstrap"]
MAX_FN_LINES = 120
# (file, function): bodies that are tables, one arm or row per case
TABLES = {
    ("node/src/events.rs", "fields"),
}

MAX_FILE_LINES = 900
# files over the cap today, each at most at this length
OVER = {
    "protocol/src/diloco/shepherd.rs": 1313,
    "protocol/src/diloco/sparse.rs": 988,
}
MAX_FIELDS = 20
# state structs over the cap today, each at most at this many fields
WIDE = {
    ("bootstrap/src/event_loop.rs", "EventLoop"): 33,
    ("simulations/src/faults/world.rs", "World"): 31,
    ("protocol/src/diloco/shepherd.rs", "OpenRound"): 29,
    ("protocol/src/diloco/shepherd.rs", "Config"): 28,
    ("node/src/observe/tui/state.rs", "State"): 28,
    ("simulations/src/diloco.rs", "Sim"): 24,
    ("node/src/diloco/worker.rs", "Trainer"): 24,
    ("bootstrap/src/nat.rs", "Nat"): 24,
    ("simulations/src/report.rs", "RoundStats"): 22,
    ("simulations/src/report.rs", "Summary"): 21,
    ("node/src/diloco/shepherd/args.rs", "ShepherdPlan"): 27,
}
STRUCT = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))? )?struct (\w+)(?:<[^{]*>)? \{$")
RECORD = re.compile(r"clap::(?:Args|Parser)|\b(?:Serialize|Deserialize)\b")
REASON_TEXT = re.compile(r"\breason(?:\.as_str\(\))?\s*(?:\.(?:starts_with|contains|split_once|ends_with)\s*\(|==\s*\")")
HISTORY = ["this session", "last session", "previous session", "earlier session", "before this change",
           "after this change", "this stop", "last stop", "previously", "formerly", "until now", "we now",
           "was changed", "as of this commit", "before this fix", "after this fix", "until this fix",
           "before this work", "after this work"]
# comments where "this session" names a runtime session (an IREE session), not a sitting
HISTORY_NOUNS = {"runtime/src"}

MAX_README_LINES = 250
DOCS = "docs"
SUMMARY = "SUMMARY.md"

PATH = re.compile(r"\b(crate|super|self)((?:::[A-Za-z_][A-Za-z0-9_]*)+)")


def strip(text):
    """Source without comments, strings and `#[cfg(test)] mod tests { … }`."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    m = re.search(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod tests\s*\{", text)
    if m:
        text = text[: m.start()]
    return text


def expand(tree):
    """`a::{b, c::{d, e}}` → ["a::b", "a::c::d", "a::c::e"]."""
    tree = tree.strip()
    i = tree.find("{")
    if i < 0:
        return [tree]
    head, body = tree[:i], tree[i + 1 : tree.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    parts.append(cur)
    out = []
    for p in parts:
        p = p.strip()
        if p:
            out += [head + x for x in expand(p)]
    return out


def modules(crate):
    src = os.path.join(ROOT, crate, "src")
    mods = {}
    for root, _, files in os.walk(src):
        for f in files:
            if f.endswith(".rs"):
                rel = os.path.relpath(os.path.join(root, f), src)[:-3]
                parts = tuple(p for p in rel.split(os.sep) if p != "mod")
                if parts in (("lib",), ("main",)):
                    parts = ()
                mods[parts] = os.path.join(root, f)
    return mods


def refs(text, here, mods):
    """Modules `here` names."""
    names = []
    for stmt in re.findall(r"\buse\s+([^;]+);", text):
        names += expand(re.sub(r"\s+", "", stmt))
    names += [m.group(1) + m.group(2) for m in PATH.finditer(re.sub(r"\buse\s+[^;]+;", "", text))]
    out = set()
    for name in names:
        segs = [s for s in name.split("::") if s and s != "*"]
        segs = [s.split(" as ")[0] for s in segs]
        if not segs or segs[0] not in ("crate", "super", "self"):
            continue
        base = list(here)
        i = 0
        if segs[0] == "crate":
            base, i = [], 1
        else:
            while i < len(segs) and segs[i] in ("super", "self"):
                if segs[i] == "super":
                    base = base[:-1]
                i += 1
        path = base + segs[i:]
        for n in range(len(path), -1, -1):
            if tuple(path[:n]) in mods:
                out.add(tuple(path[:n]))
                break
    return out


def related(a, b):
    return a[: len(b)] == b or b[: len(a)] == a


def sccs(graph):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
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
            out.append(comp)

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def circles():
    findings, edges_total = [], 0
    for crate in CRATES:
        mods = modules(crate)
        graph = {}
        for here, path in mods.items():
            text = strip(open(path, encoding="utf-8").read())
            graph[here] = {m for m in refs(text, here, mods) if m != here and not related(m, here)}
            edges_total += len(graph[here])
        for comp in sccs(graph):
            if len(comp) > 1:
                names = sorted("::".join(c) or "(root)" for c in comp)
                inner = sorted(
                    f"{'::'.join(a)} -> {'::'.join(b)}" for a in comp for b in graph[a] if b in comp
                )
                findings.append(f"{crate}: import circle among {', '.join(names)} ({'; '.join(inner)})")
    return findings, edges_total


FN = re.compile(r"^\s*(?:pub(?:\([^)]*\))?\s+)?(?:async\s+)?(?:const\s+)?(?:unsafe\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)")


def long_functions():
    findings, count = [], 0
    for crate in LONG_CHECKED:
        for root, _, files in os.walk(os.path.join(ROOT, crate)):
            if "target" in root.split(os.sep):
                continue
            for f in files:
                if not f.endswith(".rs"):
                    continue
                path = os.path.join(root, f)
                rel = os.path.relpath(path, ROOT)
                lines = open(path, encoding="utf-8").read().split("\n")
                i = 0
                while i < len(lines):
                    m = FN.match(lines[i])
                    if not m:
                        i += 1
                        continue
                    # the body: from the first `{` after the signature to its match
                    depth, start, j = 0, None, i
                    while j < len(lines):
                        code = re.sub(r'"(?:\\.|[^"\\])*"|//.*', "", lines[j])
                        if start is None and ";" in code and "{" not in code:
                            break  # a declaration without a body
                        for ch in code:
                            if ch == "{":
                                if start is None:
                                    start = j
                                depth += 1
                            elif ch == "}":
                                depth -= 1
                        if start is not None and depth == 0:
                            break
                        j += 1
                    count += 1
                    if start is not None:
                        body = j - start - 1
                        if body > MAX_FN_LINES and (rel, m.group(1)) not in TABLES:
                            findings.append(f"{rel}:{i + 1}: fn {m.group(1)} is {body} lines (at most {MAX_FN_LINES})")
                    i += 1
    return findings, count


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def prose(text):
    """A markdown file's lines outside fenced code blocks, as (number, line)."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if m:
            if fence is None:
                fence = m.group(1)[0] * 3
            elif m.group(1).startswith(fence):
                fence = None
            continue
        if fence is None:
            yield n, line


def anchor(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen, out = {}, set()
        for _, line in prose(open(path, encoding="utf-8").read()):
            m = HEADING.match(line)
            if m:
                a = anchor(m.group(2))
                out.add(a if a not in seen else f"{a}-{seen[a]}")
                seen[a] = seen.get(a, 0) + 1
        cache[path] = out
    return cache[path]


def markdown_files():
    files = [os.path.join(ROOT, "README.md")]
    for root, _, names in os.walk(os.path.join(ROOT, DOCS)):
        files += [os.path.join(root, f) for f in sorted(names) if f.endswith(".md")]
    return files


def dead_links(files):
    """One line per relative link whose file or heading is missing."""
    findings, count = [], 0
    for path in files:
        rel = os.path.relpath(path, ROOT)
        for n, line in prose(open(path, encoding="utf-8").read()):
            line = re.sub(r"(`+).*?\1", "", line)  # code spans hold no links
            for m in LINK.finditer(line):
                link = m.group(1)
                if not link or re.match(r"^(https?:|mailto:)", link, re.I):
                    continue
                count += 1
                target, _, frag = link.partition("#")
                dest = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
                if not os.path.exists(dest):
                    findings.append(f"{rel}:{n}: link {link}: {os.path.relpath(dest, ROOT)} does not exist")
                elif frag and dest.endswith(".md") and frag not in anchors(dest):
                    findings.append(f"{rel}:{n}: link {link}: {os.path.relpath(dest, ROOT)} has no heading #{frag}")
    return findings, count


def front_door():
    """README.md's length and the book's table of contents."""
    findings = []
    readme = os.path.join(ROOT, "README.md")
    lines = len(open(readme, encoding="utf-8").read().rstrip("\n").split("\n"))
    if lines > MAX_README_LINES:
        findings.append(f"README.md: {lines} lines (at most {MAX_README_LINES}; move the rest into {DOCS}/)")
    docs = os.path.join(ROOT, DOCS)
    summary = os.path.join(docs, SUMMARY)
    if not os.path.exists(summary):
        return findings + [f"{DOCS}/{SUMMARY}: missing"], lines, 0
    listed = set()
    for n, line in prose(open(summary, encoding="utf-8").read()):
        m = re.match(r"^\s*[-*]\s+\[[^\]]*\]\(([^)#\s]*)[^)]*\)", line)
        if m and m.group(1):
            page = os.path.normpath(os.path.join(docs, m.group(1)))
            listed.add(page)
            if not os.path.exists(page):
                findings.append(f"{DOCS}/{SUMMARY}:{n}: page {m.group(1)} does not exist")
    for f in sorted(os.listdir(docs)):
        page = os.path.join(docs, f)
        if f.endswith(".md") and f != SUMMARY and page not in listed:
            findings.append(f"{DOCS}/{SUMMARY}: page {f} is not listed")
    return findings, lines, len(listed)


# (importer's module prefix, imported module prefix) that must not meet, in the node
LAYERS = [(("diloco",), ("commands",))]


def layers():
    """Imports across LAYERS, one line each."""
    mods = modules("node")
    out = []
    for here, path in sorted(mods.items()):
        with open(path, encoding="utf-8") as f:
            text = strip(f.read())
        for low, high in LAYERS:
            if here[: len(low)] != low:
                continue
            for target in sorted(refs(text, here, mods)):
                if target[: len(high)] == high:
                    out.append(f"{os.path.relpath(path, ROOT)}: imports {'::'.join(('crate',) + target)} "
                               f"(no module under node/src/{'/'.join(low)}/ imports node/src/{'/'.join(high)}/)")
    return out


def sources():
    """Every .rs file of the workspace crates, relative to the root."""
    for crate in CRATES:
        for base, dirs, names in os.walk(os.path.join(ROOT, crate)):
            dirs[:] = [d for d in dirs if d not in ("target", ".data")]
            for name in names:
                if name.endswith(".rs"):
                    yield os.path.relpath(os.path.join(base, name), ROOT)


def long_files():
    """Files over MAX_FILE_LINES (or over their OVER length), one line each."""
    out = []
    for rel in sorted(sources()):
        lines = len(open(os.path.join(ROOT, rel), encoding="utf-8").read().rstrip("\n").split("\n"))
        cap = OVER.get(rel, MAX_FILE_LINES)
        if lines > cap:
            out.append(f"{rel}: {lines} lines (at most {cap}; split it by concern)")
        elif rel in OVER and lines <= MAX_FILE_LINES:
            out.append(f"{rel}: {lines} lines, under {MAX_FILE_LINES}: drop it from OVER")
    return out


def wide_structs():
    """State structs over MAX_FIELDS named fields (or over their WIDE count)."""
    out, count = [], 0
    for rel in sorted(sources()):
        if rel.startswith("schema/src/"):
            continue
        lines = open(os.path.join(ROOT, rel), encoding="utf-8").read().split("\n")
        i = 0
        while i < len(lines):
            m = STRUCT.match(lines[i])
            if not m:
                i += 1
                continue
            indent, name = m.group(1), m.group(2)
            # the attributes above it: a record of flags or a format is as wide as that
            j = i - 1
            attrs = []
            while j >= 0 and (lines[j].strip().startswith("#[") or lines[j].strip().startswith("///")):
                attrs.append(lines[j])
                j -= 1
            field = re.compile(r"^" + indent + r"    (?:pub(?:\([^)]*\))? )?[a-z_][a-z0-9_]*\s*:")
            k, n = i + 1, 0
            while k < len(lines) and lines[k] != indent + "}":
                n += bool(field.match(lines[k]))
                k += 1
            count += 1
            if not any(RECORD.search(a) for a in attrs):
                cap = WIDE.get((rel, name), MAX_FIELDS)
                if n > cap:
                    out.append(f"{rel}:{i + 1}: struct {name} has {n} fields (at most {cap}; group them into parts)")
                elif (rel, name) in WIDE and n <= MAX_FIELDS:
                    out.append(f"{rel}:{i + 1}: struct {name} has {n} fields, at most {MAX_FIELDS}: drop it from WIDE")
            i = k + 1
    return out, count


def reason_text():
    """Code in node/src that matches on a reason's text."""
    out = []
    for rel in sorted(sources()):
        if not rel.startswith("node/src/") or os.path.basename(rel) == "tests.rs":
            continue
        for n, line in enumerate(strip_keeping_lines(open(os.path.join(ROOT, rel), encoding="utf-8").read()), 1):
            if REASON_TEXT.search(line):
                out.append(f"{rel}:{n}: decides on a reason's text (use a typed code): {line.strip()}")
    return out


def strip_keeping_lines(text):
    """`strip`'s comments and tests removed, line numbers kept (strings are kept)."""
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    m = re.search(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod tests\s*\{", text)
    if m:
        text = text[: m.start()]
    return [re.sub(r"//[^\n]*", "", line) for line in text.split("\n")]


def history(files):
    """HISTORY's phrases in README.md, docs/ and the sources' comments."""
    out = []
    phrases = re.compile("|".join(re.escape(p) for p in HISTORY), re.I)
    for path in files:
        rel = os.path.relpath(path, ROOT)
        for n, line in enumerate(open(path, encoding="utf-8"), 1):
            m = phrases.search(line)
            if m:
                out.append(f"{rel}:{n}: history ({m.group(0)!r}): say what is true now")
    for rel in sorted(sources()):
        nouns = any(rel.startswith(d) for d in HISTORY_NOUNS)
        for n, line in enumerate(open(os.path.join(ROOT, rel), encoding="utf-8"), 1):
            comment = line.partition("//")[2]
            m = phrases.search(comment)
            if m and not (nouns and m.group(0).lower() == "this session"):
                out.append(f"{rel}:{n}: history ({m.group(0)!r}) in a comment: say what is true now")
    return out


def main():
    circle, edges = circles()
    layered = layers()
    long, fns = long_functions()
    files = markdown_files()
    dead, links = dead_links(files)
    door, readme_lines, pages = front_door()
    big = long_files()
    texts = reason_text()
    past = history(files)
    wide, structs = wide_structs()
    found = circle + long + dead + door + layered + big + texts + past + wide
    for line in found:
        print(line)
    if found:
        return 1
    print(f"structure: no import circles ({edges} module imports in {len(CRATES)} crates), "
          f"no function over {MAX_FN_LINES} lines ({fns} in {', '.join(LONG_CHECKED)}), "
          f"README.md {readme_lines} lines (at most {MAX_README_LINES}), "
          f"{links} relative links in {len(files)} markdown files all resolve, "
          f"{pages} pages in {DOCS}/{SUMMARY}, "
          f"no import across layers ({', '.join(f'{a[0]}/ -> {b[0]}/' for a, b in LAYERS)}), "
          f"no file over {MAX_FILE_LINES} lines but {len(OVER)} held at their length, "
          f"no decision on a reason's text in node/src, no history in docs or comments, "
          f"no state struct over {MAX_FIELDS} fields ({structs} structs) but {len(WIDE)} held at their width")
    return 0


if __name__ == "__main__":
    sys.exit(main())
