#!/usr/bin/env python3
"""
prepare_gutenberg.py: Project Gutenberg books (books.tar.xz) -> one JSONL, one book per line.

    python dev/bench/prepare_gutenberg.py books.tar.xz gutenberg.jsonl

The tarball is extracted into a temporary directory. Every *.txt in it, in sorted order of its path
inside the archive, becomes one JSON object {"text": ...}:
  - decoded as UTF-8 (undecodable bytes become U+FFFD), the byte-order mark stripped,
  - CRLF (and lone CR) line endings turned into LF,
  - only the text between the "*** START OF ..." line and the "*** END OF ..." line (both excluded)
    is kept when such lines are present (the marker may be indented or written "***START OF");
    without a START line the text starts at the top, without an END line it runs to the end.
The output is written to a temporary name and renamed. Only the Python standard library is used.
"""
import argparse
import json
import os
import re
import sys
import tarfile
import tempfile

START = re.compile(r"^\s*\*\*\*\s*START OF", re.IGNORECASE)
END = re.compile(r"^\s*\*\*\*\s*END OF", re.IGNORECASE)


def clean(raw):
    """bytes of one book -> (text, had_start, had_end)."""
    text = raw.decode("utf-8", errors="replace")
    if text.startswith("\ufeff"):
        text = text[1:]
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    begin, end = 0, len(lines)
    for i, line in enumerate(lines):
        if START.match(line):
            begin = i + 1
            break
    for i in range(begin, len(lines)):
        if END.match(lines[i]):
            end = i
            break
    body = "\n".join(lines[begin:end]).strip("\n") + "\n"
    return body, begin > 0, end < len(lines)


def extract(tar_path, into):
    with tarfile.open(tar_path, "r:*") as tar:
        try:
            tar.extractall(into, filter="data")     # Python >= 3.11.4 / 3.12: refuses unsafe paths
        except TypeError:                            # older Python: check the paths ourselves
            for m in tar.getmembers():
                p = os.path.normpath(m.name)
                if p.startswith("..") or os.path.isabs(p) or not (m.isfile() or m.isdir()):
                    raise SystemExit(f"prepare_gutenberg: refusing archive member {m.name!r}")
            tar.extractall(into)


def main():
    ap = argparse.ArgumentParser(description="Gutenberg books.tar.xz -> JSONL {\"text\": book}")
    ap.add_argument("tarball", help="books.tar.xz")
    ap.add_argument("output", help="output .jsonl")
    args = ap.parse_args()
    if not os.path.isfile(args.tarball):
        sys.exit(f"prepare_gutenberg: no such file: {args.tarball}")

    out_dir = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(out_dir, exist_ok=True)
    tmp_out = args.output + ".tmp"
    books = chars = out_bytes = in_bytes = no_start = no_end = 0
    with tempfile.TemporaryDirectory(prefix="gutenberg_") as tmp:
        extract(args.tarball, tmp)
        paths = []
        for root, _, files in os.walk(tmp):
            for name in files:
                if name.endswith(".txt"):
                    full = os.path.join(root, name)
                    paths.append((os.path.relpath(full, tmp).replace(os.sep, "/"), full))
        paths.sort()
        if not paths:
            sys.exit(f"prepare_gutenberg: no .txt files in {args.tarball}")
        with open(tmp_out, "w", encoding="utf-8") as out:
            for rel, full in paths:
                with open(full, "rb") as fh:
                    raw = fh.read()
                text, had_start, had_end = clean(raw)
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                out.write(line)
                books += 1
                chars += len(text)
                in_bytes += len(raw)
                out_bytes += len(line.encode("utf-8"))
                no_start += not had_start
                no_end += not had_end
    os.replace(tmp_out, args.output)
    print(f"prepare_gutenberg: {books} books, {in_bytes / 1e6:.1f} MB in -> {chars / 1e6:.1f} M characters, "
          f"{out_bytes / 1e6:.1f} MB of JSONL in {args.output} ({no_start} without a START line, "
          f"{no_end} without an END line)")


if __name__ == "__main__":
    main()
