#!/usr/bin/env python3
"""Writes the tokenizer test vectors dev/data/tokenizer/{gpt2,cl100k_base,o200k_base,llama3}.bin.

The expected ids come from tiktoken's encode_ordinary (pip install tiktoken), with the encodings
built from local files (this machine needs no network):
  gpt2         tiktoken_ext.openai_public.r50k_base() on ../shared/data/tiktoken/r50k_base.tiktoken,
               checked against openai_public.gpt2() on dev/data/gpt2/gpt2-vocab.json + gpt2-merges.txt
               (Megatron's GPT2BPETokenizer files); every case must give the same ids with both
  cl100k_base  openai_public.cl100k_base() on ../shared/data/tiktoken/cl100k_base.tiktoken
  o200k_base   openai_public.o200k_base()  on ../shared/data/tiktoken/o200k_base.tiktoken
  llama3       tiktoken.Encoding with meta-llama's pattern and 256 special tokens
               (llama-models models/llama3/tokenizer.py) on ../shared/data/llama3/tokenizer.model

Inputs are bytes. Invalid UTF-8 is defined as Python's bytes.decode('utf-8', errors='replace')
before encoding (the C tokenizer does the same replacement).

File format (little-endian): b"MTTOKV1\\0", uint32 number of cases, then per case:
uint32 byte length, the bytes, uint32 token count, int32 ids.

  python dev/gen_tokenizer_vectors.py [--shared ../shared/data] [--out dev/data/tokenizer]
"""
import argparse
import os
import random
import struct
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# meta-llama/llama-models models/llama3/tokenizer.py
LLAMA3_PAT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_NAMED_SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>",
]


def load_encodings(shared, names=("gpt2", "cl100k_base", "o200k_base", "llama3"), with_gpt2_files=True):
    """tiktoken Encodings built from local files: {name: Encoding}. Also used by dev/bench."""
    os.environ["TIKTOKEN_CACHE_DIR"] = ""  # no cache dir writes
    import tiktoken
    from tiktoken import load as tl
    from tiktoken_ext import openai_public as op

    local = {
        "r50k_base.tiktoken": os.path.join(shared, "tiktoken", "r50k_base.tiktoken"),
        "cl100k_base.tiktoken": os.path.join(shared, "tiktoken", "cl100k_base.tiktoken"),
        "o200k_base.tiktoken": os.path.join(shared, "tiktoken", "o200k_base.tiktoken"),
        "vocab.bpe": os.path.join(REPO, "dev", "data", "gpt2", "gpt2-merges.txt"),
        "encoder.json": os.path.join(REPO, "dev", "data", "gpt2", "gpt2-vocab.json"),
    }
    op.load_tiktoken_bpe = lambda url, expected_hash=None: tl.load_tiktoken_bpe(local[url.rsplit("/", 1)[1]], expected_hash)
    orig_dg = tl.data_gym_to_mergeable_bpe_ranks
    op.data_gym_to_mergeable_bpe_ranks = lambda vocab_bpe_file, encoder_json_file, vocab_bpe_hash=None, encoder_json_hash=None: \
        orig_dg(local["vocab.bpe"], local["encoder.json"], vocab_bpe_hash, encoder_json_hash)
    encs = {}
    for name in names:
        if name == "llama3":
            ranks = tl.load_tiktoken_bpe(os.path.join(shared, "llama3", "tokenizer.model"))
            specials = LLAMA3_NAMED_SPECIALS + ["<|reserved_special_token_%d|>" % (2 + i) for i in range(256 - 12)]
            encs[name] = tiktoken.Encoding(name="llama3", pat_str=LLAMA3_PAT, mergeable_ranks=ranks,
                                           special_tokens={t: len(ranks) + i for i, t in enumerate(specials)})
        else:
            ctor = {"gpt2": op.r50k_base, "cl100k_base": op.cl100k_base, "o200k_base": op.o200k_base}[name]
            encs[name] = tiktoken.Encoding(**ctor())
    if with_gpt2_files:
        encs["gpt2_files"] = tiktoken.Encoding(**op.gpt2())
    return encs


def gutenberg_excerpts(tar_path):
    """A few KB of real prose: CRLF line ends, byte-order marks, accents, the PG header."""
    picks = [  # (member, offset, length)
        ("gutenberg/data/books/11-0.txt", 0, 2500),              # Alice: BOM, header, CRLF, curly quotes
        ("gutenberg/data/books/2701-0.txt", 400000, 3000),       # Moby Dick
        ("gutenberg/data/books/pg48731.txt", 200000, 3000),      # Les Miserables (English, accents)
        ("gutenberg/data/books/pg6130.txt", 600000, 2000),       # the Iliad
        ("gutenberg/data/books/pg4657.txt", 300000, 3000),       # Burton's pilgrimage: transliterated Arabic
        ("gutenberg/data/books/pg3207.txt", 100000, 2000),       # Leviathan: 17th-century spelling
    ]
    out = []
    with tarfile.open(tar_path, "r:xz") as tar:
        for name, off, n in picks:
            data = tar.extractfile(name).read()
            out.append(data[off:off + n])
    return out


def handwritten_cases():
    s = [
        "",
        "Hello world",
        "Hello, world! How are you today?",
        "café naïve résumé Ångström Dvořák Łódź straße",
        "e\u0301 a\u0300\u0323 combining marks: n\u0303o\u0308 \u0301leading",
        "日本語のテキストです。中文测试，繁體中文。한국어 텍스트입니다.",
        "مرحبا بالعالم، هذا نص عربي. नमस्ते दुनिया, यह हिंदी पाठ है। สวัสดีชาวโลก",
        "Русский текст, Ελληνικά κείμενα, עברית",
        "emoji: 👍 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇯🇵 👩🏾‍💻 😀😃😄",
        "line1\r\nline2\r\n\r\nline3\rline4\n",
        "\ttabs\tin\t\ttext\t",
        "a    b     c      d",
        "   leading spaces",
        "trailing spaces   ",
        "spaces before newline   \n  next line",
        "\n\n\n",
        " \n \n ",
        "hello\n  ",
        "hello\n\n",
        "end with space ",
        "  \t \n\t \r\n  x",
        "1234567 12 3.14159 1,000,000 007 ١٢٣٤٥٦ ⅫⅣ ²³ 一二三",
        "I'M YOU'LL he's She'S we'VE they'Re I'd it'D 'll 'S ok'ſ don't won'T",
        "'s 't 're 've 'm 'll 'd 'x ''s",
        "!!!??? ... --- *** ,,, ;;; ::: ((( ))) [[[ ]]] {{{ }}} <<< >>> /// \\\\\\",
        "<|endoftext|>",
        "text<|endoftext|>more <|endofprompt|> <|begin_of_text|><|end_of_text|>",
        "HelloWorld ThisIsCamelCase iPhone McDonald's XMLHttpRequest HTTPServer ǅemal ʰa",
        "a/b/c\n// comment\n/path/to/file.txt\n",
        "def foo(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
        "https://example.com/path?query=1&b=2#frag user@example.com",
        "\u00a0non-breaking\u00a0space\u3000ideographic\u2028line sep\u2029para\x0bvt\x0cff\x85nel",
        "ſtreet Ǆ ǅ ǆ ß ẞ ﬁ ﬀ",
        "x" * 300,
        " " * 300 + "x",
        "\n" * 200,
        "a" * 2000,
        "9" * 100,
        "ab" * 700 + "!",
        "\u0301" * 10 + "abc",
        "🙂" * 50,
    ]
    cases = [t.encode("utf-8") for t in s]
    cases += [
        b"\xff\xfe invalid \xc3\x28 \xe2\x82 \xf0\x9f\x98 end",
        b"\xed\xa0\x80 surrogate \xc0\xaf overlong \xf4\x90\x80\x80 too big \xf8\x88\x80\x80\x80",
        b"trunc at end \xe2\x82",
        b"\x80\x80\x80 lone continuation",
        b"mix \xe6\x97\xa5\xe6\x9c \xe8\xaa\x9e",
        b"\x00 nul \x00\x01\x02 control \x1b[0m",
    ]
    return cases


def fuzz_cases(n, seed=1234):
    """Short random strings over characters chosen to exercise every branch of the split patterns."""
    alphabet = [
        " ", " ", " ", "\t", "\n", "\r", "\r\n", "\x0b", "\x85", "\u00a0", "\u3000", "\u2028",
        "a", "b", "s", "t", "l", "e", "v", "r", "m", "d", "S", "T", "L", "E", "V", "R", "M", "D", "Z",
        "'", "'", "ſ", "é", "ß", "ǅ", "ʰ", "中", "字", "\u0301", "\u0903", "\u20dd", "ﬁ",
        "0", "1", "9", "٣", "Ⅻ", "²", "½",
        "!", ".", ",", "/", "/", "-", "(", "\"", "#", "€", "©", "\u200d", "\ufeff", "\x00",
        "😀", "👍", "\U0001F3FD", "𝐀", "𝐚",
    ]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 40)
        out.append("".join(rng.choice(alphabet) for _ in range(k)).encode("utf-8"))
    return out


def write_vectors(path, cases, ids):
    with open(path, "wb") as f:
        f.write(b"MTTOKV1\0")
        f.write(struct.pack("<I", len(cases)))
        for b, t in zip(cases, ids):
            f.write(struct.pack("<I", len(b)))
            f.write(b)
            f.write(struct.pack("<I", len(t)))
            f.write(struct.pack("<%di" % len(t), *t))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    ap.add_argument("--out", default=os.path.join(REPO, "dev", "data", "tokenizer"))
    args = ap.parse_args()

    shake = open(os.path.join(REPO, "dev", "data", "tinyshakespeare.txt"), "rb").read()
    cases = [shake[:3000], shake[500000:502000]]
    cases += gutenberg_excerpts(os.path.join(args.shared, "gutenberg", "books.tar.xz"))
    cases += handwritten_cases()
    cases += fuzz_cases(300)

    encs = load_encodings(args.shared)
    os.makedirs(args.out, exist_ok=True)
    total = 0
    for name in ("gpt2", "cl100k_base", "o200k_base", "llama3"):
        enc = encs[name]
        ids = [enc.encode_ordinary(b.decode("utf-8", errors="replace")) for b in cases]
        if name == "gpt2":
            for b, t in zip(cases, ids):
                assert encs["gpt2_files"].encode_ordinary(b.decode("utf-8", errors="replace")) == t, b
        path = os.path.join(args.out, name + ".bin")
        write_vectors(path, cases, ids)
        size = os.path.getsize(path)
        total += size
        print("%-40s %4d cases %7d tokens %8d bytes" % (os.path.relpath(path, REPO), len(cases), sum(map(len, ids)), size))
    print("total %d bytes" % total)


if __name__ == "__main__":
    main()
