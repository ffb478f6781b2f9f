#!/usr/bin/env python3
"""Counts the `pub` surface of the numapin crate (src/): items declared plain `pub`
(fn, struct, enum, trait, type, const, static, mod, use) and `pub` fields, not
`pub(crate)`/`pub(super)`/`pub(in ...)`. A line count, not a resolver: an item of a
private module still counts (it is meant to be reachable); `#[cfg(test)]` files and
blocks are not excluded, but they hold no `pub` items here.

    python3 scripts/pub_items.py          # totals
    python3 scripts/pub_items.py --list   # every item, file:line
    python3 scripts/pub_items.py DIR      # the src/ of another tree (git archive REV src)

Which `pub` items no path from the crate root reaches: add `#![warn(unreachable_pub)]` to
src/lib.rs for one `cargo check` (each warning is a `pub(crate)` to write).
"""
import pathlib
import re
import sys

ITEM = re.compile(
    r'^\s*pub\s+(?:(?:unsafe|const|async|extern\s+"C")\s+)*'
    r"(fn|struct|enum|trait|type|const|static|mod|use)\b"
)
FIELD = re.compile(r"^\s*pub\s+(?:r#)?[a-z_][a-z0-9_]*\s*:")


def main() -> None:
    dirs = [a for a in sys.argv[1:] if not a.startswith("--")]
    base = pathlib.Path(dirs[0]) if dirs else pathlib.Path(__file__).resolve().parent.parent
    root = base / "src"
    items, fields = [], []
    for path in sorted(root.rglob("*.rs")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
            if ITEM.match(line):
                items.append(where)
            elif FIELD.match(line):
                fields.append(where)
    if "--list" in sys.argv:
        print("\n".join(items + fields))
    print(f"pub items: {len(items)}, pub fields: {len(fields)}, total: {len(items) + len(fields)}")


if __name__ == "__main__":
    main()
