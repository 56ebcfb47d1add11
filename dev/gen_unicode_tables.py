#!/usr/bin/env python3
"""Writes prepro/unicode_tables.h: the Unicode character classes the pre-tokenizer regexes need, and
the data of Unicode normalization form C (NFC) as the Hugging Face tokenizers library applies it.

The split patterns of GPT-2, cl100k, o200k and Llama-3 use \\p{L} (and its parts Lu Ll Lt Lm Lo),
\\p{M}, \\p{N} and \\s. tiktoken runs them with Rust's regex crate, whose tables are Unicode 16.0
(tiktoken 0.14). To give the same splits, the C tables must come from the same Unicode version,
so this script uses the `unicodedata2` package pinned to that version (pip install
unicodedata2==16.0.0); Python's own unicodedata is usually older.

Output: a two-level table. mt_uc_stage1[cp >> 8] picks a 256-entry block of mt_uc_stage2; each
entry is a bit set of MT_UC_* flags. \\s is Unicode's White_Space property (PropList.txt), which
is what the regex crate means by \\s; it is listed here because unicodedata does not expose it.

NFC (tokenizer.json's "NFC" normalizer, Qwen2's): the tokenizers library normalizes with the
unicode-normalization-alignments crate, whose tables are older than the classes above (Unicode 9.0:
it gives combining class 0 to marks added later and has no decomposition for letters added later).
To give the library's output exactly, the NFC data is the Unicode 16.0 data restricted to what the
library knows, found by asking it (pip install tokenizers): a decomposition is kept where the
library's NFD changes the character, a combining class where the library's NFD reorders the mark
against a reference mark (classes never change once assigned), a composition where the library's
NFC composes the pair back. A Python NFC over these tables is then checked against the library on
every code point, every mark after a base in both orders with reference marks, Hangul, and random
strings; the C code (prepro/tokenizer.h) runs the same algorithm over the same tables.

  python dev/gen_unicode_tables.py            # writes prepro/unicode_tables.h
  python dev/gen_unicode_tables.py --verify   # also checks every code point against tiktoken's regex
"""
import argparse
import os
import sys

UNICODE_VERSION = "16.0.0"

# PropList.txt White_Space (unchanged since Unicode 6.3).
WHITE_SPACE = [0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680] + list(range(0x2000, 0x200B)) + \
              [0x2028, 0x2029, 0x202F, 0x205F, 0x3000]

FLAGS = [  # name, bit, meaning
    ("MT_UC_LU", 0x01, "Lu or Lt (upper/title case letter)"),
    ("MT_UC_LL", 0x02, "Ll (lower case letter)"),
    ("MT_UC_LO", 0x04, "Lm or Lo (modifier/other letter)"),
    ("MT_UC_M", 0x08, "M (mark)"),
    ("MT_UC_N", 0x10, "N (number)"),
    ("MT_UC_S", 0x20, "White_Space (\\\\s)"),
    ("MT_UC_NL", 0x40, "'\\\\r' or '\\\\n' (the patterns' [\\\\r\\\\n])"),
    ("MT_UC_SP", 0x80, "' ' (U+0020, the patterns' optional leading space)"),
]


def load_unicodedata():
    try:
        import unicodedata2 as ud
    except ImportError:
        sys.exit("needs unicodedata2==%s (pip install unicodedata2==%s)" % (UNICODE_VERSION, UNICODE_VERSION))
    if ud.unidata_version != UNICODE_VERSION:
        sys.exit("unicodedata2 has Unicode %s, need %s (pip install unicodedata2==%s)"
                 % (ud.unidata_version, UNICODE_VERSION, UNICODE_VERSION))
    return ud


def flags_of(ud, cp, ws):
    cat = ud.category(chr(cp))
    f = 0
    if cat in ("Lu", "Lt"): f |= 0x01
    if cat == "Ll": f |= 0x02
    if cat in ("Lm", "Lo"): f |= 0x04
    if cat[0] == "M": f |= 0x08
    if cat[0] == "N": f |= 0x10
    if cp in ws: f |= 0x20
    if cp in (0x0A, 0x0D): f |= 0x40
    if cp == 0x20: f |= 0x80
    return f


def verify(table):
    """Checks each class against the regex engine tiktoken uses, by encoding every code point
    with a one-class split pattern (text the pattern does not match is dropped by tiktoken)."""
    import tiktoken
    ranks = {bytes([i]): i for i in range(256)}
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    text = "".join(map(chr, cps))
    checks = [(r"\p{L}", 0x07), (r"[\p{Lu}\p{Lt}]", 0x01), (r"\p{Ll}", 0x02), (r"[\p{Lm}\p{Lo}]", 0x04),
              (r"\p{M}", 0x08), (r"\p{N}", 0x10), (r"\s", 0x20)]
    for pat, mask in checks:
        enc = tiktoken.Encoding(name="probe", pat_str=pat, mergeable_ranks=ranks, special_tokens={})
        got = set(map(ord, bytes(enc.encode_ordinary(text)).decode("utf-8")))
        want = set(c for c in cps if table[c] & mask)
        if got != want:
            sys.exit("verify: %s differs from tiktoken's regex on %d code points, e.g. %s"
                     % (pat, len(got ^ want), [hex(c) for c in sorted(got ^ want)[:8]]))
        print("verify: %-18s %7d code points, same as tiktoken's regex" % (pat, len(got)))


# ---- writing C tables --------------------------------------------------------------------------

def two_level(block_of):
    """Two-level table of 0x1100 blocks of 256 code points: (distinct blocks, block index per block)."""
    blocks, index, stage1 = [], {}, []
    for b in range(0x110000 >> 8):
        blk = block_of(b)
        if blk not in index:
            index[blk] = len(blocks)
            blocks.append(blk)
        stage1.append(index[blk])
    assert len(blocks) < 256
    return blocks, stage1


def c_array(w, ctype, name, values, per_line, fmt="%d", size=None):
    w("static const %s %s[%s] = {" % (ctype, name, size if size is not None else len(values)))
    for i in range(0, len(values), per_line):
        w("    " + ",".join(fmt % v for v in values[i:i + per_line]) + ",")
    w("};")


# ---- NFC as the tokenizers library applies it ------------------------------------------------------

HANGUL_S, HANGUL_L, HANGUL_V, HANGUL_T = 0xAC00, 0x1100, 0x1161, 0x11A7
HANGUL_VCOUNT, HANGUL_TCOUNT, HANGUL_SCOUNT = 21, 28, 11172


def _all_code_points():
    return [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]


def _lib_map(fn, cps, sep="\u0000"):
    """fn over each code point alone, in big batches (NUL separates: no normalization touches it)."""
    out = {}
    step = 20000
    for i in range(0, len(cps), step):
        chunk = [c for c in cps[i:i + step] if c != 0]
        got = fn(sep.join(map(chr, chunk))).split(sep)
        assert len(got) == len(chunk)
        out.update(zip(chunk, got))
    out[0] = "\u0000"
    return out


def nfc_data(ud):
    """(ccc, decompositions, compositions, maybe) as the tokenizers library knows them."""
    from tokenizers import normalizers
    nfd, nfc = normalizers.NFD().normalize_str, normalizers.NFC().normalize_str
    cps = _all_code_points()
    lib_nfd = _lib_map(nfd, cps)
    lib_nfc = _lib_map(nfc, cps)
    dec = {}
    for c in cps:
        if HANGUL_S <= c < HANGUL_S + HANGUL_SCOUNT:
            continue  # algorithmic
        if lib_nfd[c] != chr(c):
            dec[c] = [ord(x) for x in lib_nfd[c]]
    ccc = {}
    for c in cps:
        x = ud.combining(chr(c))
        if not x or c in dec:
            continue
        if x > 1:
            known = nfd("a" + chr(c) + "\u0334") == "a\u0334" + chr(c)   # U+0334 has class 1
        else:
            known = nfd("a\u0301" + chr(c)) == "a" + chr(c) + "\u0301"   # U+0301 has class 230
        if known:
            ccc[c] = x
    comp = {}
    for c, d in dec.items():
        raw = ud.decomposition(chr(c))
        if not raw or raw.startswith("<"):
            continue
        pair = [int(x, 16) for x in raw.split()]
        if len(pair) != 2 or lib_nfc[c] != chr(c):
            continue  # a singleton, or excluded from composition
        assert nfc(chr(pair[0]) + chr(pair[1])) == chr(c), hex(c)
        comp[(pair[0], pair[1])] = c
    seconds = set(b for (_, b) in comp)
    maybe = set(c for c in cps if c in ccc or c in seconds or lib_nfc[c] != chr(c))
    maybe |= set(range(HANGUL_V, HANGUL_V + HANGUL_VCOUNT)) | set(range(HANGUL_T + 1, HANGUL_T + HANGUL_TCOUNT))
    return ccc, dec, comp, maybe


def nfc_reference(s, ccc, dec, comp):
    """NFC over the tables: the algorithm prepro/tokenizer.h implements."""
    cps = []
    for ch in s:
        c = ord(ch)
        if HANGUL_S <= c < HANGUL_S + HANGUL_SCOUNT:
            k = c - HANGUL_S
            cps.append(HANGUL_L + k // (HANGUL_VCOUNT * HANGUL_TCOUNT))
            cps.append(HANGUL_V + (k % (HANGUL_VCOUNT * HANGUL_TCOUNT)) // HANGUL_TCOUNT)
            if k % HANGUL_TCOUNT:
                cps.append(HANGUL_T + k % HANGUL_TCOUNT)
        else:
            cps.extend(dec.get(c, [c]))
    for i in range(1, len(cps)):  # canonical order: a stable insertion sort of each run of marks
        j = i
        while j > 0 and ccc.get(cps[j], 0) and ccc.get(cps[j - 1], 0) > ccc.get(cps[j], 0):
            cps[j - 1], cps[j] = cps[j], cps[j - 1]
            j -= 1
    out, starter, last = [], -1, 0
    for c in cps:
        cc = ccc.get(c, 0)
        if starter >= 0 and (len(out) - 1 == starter or (last != 0 and last < cc)):
            a = out[starter]
            composed = None
            if HANGUL_L <= a < HANGUL_L + 19 and HANGUL_V <= c < HANGUL_V + HANGUL_VCOUNT:
                composed = HANGUL_S + ((a - HANGUL_L) * HANGUL_VCOUNT + c - HANGUL_V) * HANGUL_TCOUNT
            elif (HANGUL_S <= a < HANGUL_S + HANGUL_SCOUNT and (a - HANGUL_S) % HANGUL_TCOUNT == 0
                  and HANGUL_T < c < HANGUL_T + HANGUL_TCOUNT):
                composed = a + c - HANGUL_T
            else:
                composed = comp.get((a, c))
            if composed is not None:
                out[starter] = composed
                continue
        if cc == 0:
            starter = len(out)
        last = cc
        out.append(c)
    return "".join(map(chr, out))


def verify_nfc(ud, ccc, dec, comp, maybe):
    from tokenizers import normalizers
    import random
    nfc = normalizers.NFC().normalize_str
    cps = _all_code_points()
    lib = _lib_map(nfc, cps)
    bad = [c for c in cps if c and nfc_reference(chr(c), ccc, dec, comp) != lib[c]]
    assert not bad, "NFC differs from the library on %d code points, e.g. %s" % (len(bad), [hex(c) for c in bad[:8]])
    marks = sorted(c for c in cps if ud.combining(chr(c)))
    refs = [0x0334, 0x0316, 0x0301, 0x0345, 0x05B0, 0x0E38, 0x093C]
    rng = random.Random(5)
    tests = []
    for m in marks:
        for r in refs:
            for base in (0x61, 0x41, 0x1100, 0x3042, 0x0915, 0x05D0):
                tests.append(chr(base) + chr(m) + chr(r))
                tests.append(chr(base) + chr(r) + chr(m))
    pool = [chr(b) for (_, b) in comp] + [chr(a) for (a, _) in comp]
    pool += [chr(c) for c in list(dec)[:3000:7]] + [chr(c) for c in marks] + list("abc \n")
    pool += [chr(0x1100 + k) for k in range(19)] + [chr(0x1161 + k) for k in range(21)] + [chr(0x11A8 + k) for k in range(27)]
    for _ in range(20000):
        tests.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 12))))
    checked = 0
    for i in range(0, len(tests), 2000):
        chunk = tests[i:i + 2000]
        got = nfc("\u0000".join(chunk)).split("\u0000")
        for t, g in zip(chunk, got):
            r = nfc_reference(t, ccc, dec, comp)
            assert r == g, ("NFC differs", [hex(ord(x)) for x in t], [hex(ord(x)) for x in g], [hex(ord(x)) for x in r])
            assert r == t or any(ord(x) in maybe for x in t), ("a string NFC changes without a flagged character", t)
        checked += len(chunk)
    print("verify: NFC over the tables equals the tokenizers library on %d code points and %d strings" % (len(cps), checked))


def emit_nfc(w, ccc, dec, comp, maybe):
    def block_bits(b):
        bits = [0] * 8
        for k in range(256):
            if (b << 8) + k in maybe:
                bits[k >> 5] |= 1 << (k & 31)
        return tuple(bits)
    blocks, stage1 = two_level(block_bits)
    w("/* ---- NFC, as the Hugging Face tokenizers library applies it ------------------------------------ */")
    w("/* Unicode 16.0 data restricted to what the library's normalizer knows (dev/gen_unicode_tables.py")
    w(" * says how this is found and checked). mt_uc_nfc_maybe(cp): the character may change under NFC")
    w(" * (it decomposes for good, has a combining class, or can compose with the character before it);")
    w(" * text without such a character is already NFC. Hangul syllables are composed and decomposed by")
    w(" * arithmetic, not listed. */")
    w("#define MT_UC_NFC_NUM_BLOCKS %d" % len(blocks))
    c_array(w, "uint8_t", "mt_uc_nfc_stage1", stage1, 24)
    c_array(w, "uint32_t", "mt_uc_nfc_stage2", [v for blk in blocks for v in blk], 8, "0x%08x", "%d * 8" % len(blocks))
    w("static inline int mt_uc_nfc_maybe(uint32_t cp) {")
    w("    if (cp >= 0x110000) return 0;")
    w("    const uint32_t* b = mt_uc_nfc_stage2 + (uint32_t)mt_uc_nfc_stage1[cp >> 8] * 8u;")
    w("    return (int)((b[(cp & 255u) >> 5] >> (cp & 31u)) & 1u);")
    w("}")
    w("")
    keys = sorted(ccc)
    w("/* Canonical combining classes other than 0, by code point. */")
    w("#define MT_UC_NUM_CCC %d" % len(keys))
    c_array(w, "uint32_t", "mt_uc_ccc_cp", keys, 12, "0x%05x")
    c_array(w, "uint8_t", "mt_uc_ccc_val", [ccc[c] for c in keys], 24)
    w("")
    keys = sorted(dec)
    seq, offs = [], []
    for c in keys:
        offs.append(len(seq))
        seq.extend(dec[c])
    offs.append(len(seq))
    w("/* Full canonical decompositions: code point mt_uc_decomp_cp[k] becomes")
    w(" * mt_uc_decomp_seq[mt_uc_decomp_off[k] .. mt_uc_decomp_off[k + 1]). */")
    w("#define MT_UC_NUM_DECOMP %d" % len(keys))
    c_array(w, "uint32_t", "mt_uc_decomp_cp", keys, 12, "0x%05x")
    c_array(w, "uint16_t", "mt_uc_decomp_off", offs, 16)
    c_array(w, "uint32_t", "mt_uc_decomp_seq", seq, 12, "0x%05x")
    w("")
    keys = sorted(comp)
    w("/* Primary composites: the pair (first << 21 | second) composes to mt_uc_comp_val[k]. */")
    w("#define MT_UC_NUM_COMP %d" % len(keys))
    c_array(w, "uint64_t", "mt_uc_comp_key", [(a << 21) | b for a, b in keys], 6, "0x%011xull")
    c_array(w, "uint32_t", "mt_uc_comp_val", [comp[k] for k in keys], 12, "0x%05x")
    w("")
    return len(stage1) + 32 * len(blocks) + 5 * len(ccc) + 4 * len(dec) + 2 * len(offs) + 4 * len(seq) + 12 * len(comp)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "prepro", "unicode_tables.h"))
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args()
    ud = load_unicodedata()
    ws = set(WHITE_SPACE)
    table = [flags_of(ud, cp, ws) for cp in range(0x110000)]
    if args.verify:
        verify(table)
    ccc, dec, comp, maybe = nfc_data(ud)
    verify_nfc(ud, ccc, dec, comp, maybe)

    blocks, stage1 = two_level(lambda b: tuple(table[b << 8:(b + 1) << 8]))

    out = []
    w = out.append
    w("/* prepro/unicode_tables.h — Unicode character classes for the pre-tokenizer split patterns, and")
    w(" * the NFC normalization data of Hugging Face's tokenizers library (at the end).")
    w(" *")
    w(" * GENERATED by dev/gen_unicode_tables.py from Unicode %s (unicodedata2 %s): do not edit." % (UNICODE_VERSION, UNICODE_VERSION))
    w(" * Unicode %s is the version of the tables in Rust's regex crate that tiktoken 0.14 uses," % UNICODE_VERSION)
    w(" * so \\p{L}, \\p{N}, ... classify every code point exactly as tiktoken does.")
    w(" *")
    w(" * mt_uc_flags(cp) = mt_uc_stage2[mt_uc_stage1[cp >> 8] * 256 + (cp & 255)], a bit set of: */")
    w("#ifndef MT_UNICODE_TABLES_H")
    w("#define MT_UNICODE_TABLES_H")
    w("")
    w("#include <stdint.h>")
    w("")
    for name, bit, meaning in FLAGS:
        w("#define %-9s 0x%02x /* %s */" % (name, bit, meaning.replace("\\\\", "\\")))
    w("#define MT_UC_L   (MT_UC_LU | MT_UC_LL | MT_UC_LO) /* \\p{L} */")
    w("")
    w("#define MT_UC_UNICODE_VERSION \"%s\"" % UNICODE_VERSION)
    w("#define MT_UC_NUM_BLOCKS %d" % len(blocks))
    w("")
    c_array(w, "uint8_t", "mt_uc_stage1", stage1, 24)
    w("")
    w("static const uint8_t mt_uc_stage2[%d * 256] = {" % len(blocks))
    for bi, blk in enumerate(blocks):
        w("    /* block %d */" % bi)
        for i in range(0, 256, 32):
            w("    " + ",".join("%d" % v for v in blk[i:i + 32]) + ",")
    w("};")
    w("")
    nfc_bytes = emit_nfc(w, ccc, dec, comp, maybe)
    w("/* Flags of a code point (0 for anything outside U+0000..U+10FFFF). */")
    w("static inline uint8_t mt_uc_flags(uint32_t cp) {")
    w("    return cp < 0x110000 ? mt_uc_stage2[(uint32_t)mt_uc_stage1[cp >> 8] * 256u + (cp & 255u)] : (uint8_t)0;")
    w("}")
    w("")
    w("#endif /* MT_UNICODE_TABLES_H */")
    with open(args.out, "w") as f:
        f.write("\n".join(out) + "\n")
    print("wrote %s: %d blocks, %d bytes of class tables, %d bytes of NFC tables" % (
        args.out, len(blocks), len(stage1) + 256 * len(blocks), nfc_bytes))


if __name__ == "__main__":
    main()
