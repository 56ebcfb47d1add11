#!/usr/bin/env python3
"""Writes dev/data/tokenizers/: Hugging Face tokenizer.json files, Megatron TikTokenizer vocabularies
and the ids the reference libraries give for them (test vectors for tests/test_tokenizer.h).

Nothing is downloaded. Every tokenizer is built here with the `tokenizers` library (pip install
tokenizers tiktoken unicodedata2==16.0.0) from local files, the way Hugging Face's converters
build the real ones, each in the shape its model family ships:

  gpt2/            GPT-2: dev/data/gpt2 vocab.json + merges.txt, ByteLevel pre-tokenizer (GPT-2's
                   built-in regex), merges written as "a b" strings (the older tokenizer.json form)
  llama3/          Llama-3: the first 8192 ranks of ../shared/data/llama3/tokenizer.model, merges
                   derived as transformers' TikTokenConverter does, Split(Llama-3 regex) + ByteLevel,
                   ignore_merges, 256 special tokens, BOS <|begin_of_text|> by TemplateProcessing;
                   merges written as [a, b] pairs (the current form)
  qwen2/           Qwen2: NFC normalizer, Split(Qwen2 regex) + ByteLevel, a byte-level BPE of 4096
                   trained here on Gutenberg books (trained merges, no ignore_merges), Qwen's three
                   special tokens and one normalized (non-special) added token
  mistral_nemo/    Mistral-Nemo ("tekken"): the first 4096 ranks of o200k_base shifted by 1000
                   control tokens (<unk> <s> </s> [INST] ... <SPECIAL_999>), Split(tekken regex =
                   Megatron's TikTokenizer v2 pattern) + ByteLevel, BOS <s>, no ignore_merges
  mistral/         Mistral-7B v0.1 / Llama-2 sentencepiece BPE: Prepend("▁") + Replace(" ", "▁")
                   normalizer, no pre-tokenizer (a document is one word), byte_fallback <0xNN>,
                   fuse_unk, BOS <s>, decoder Replace/ByteFallback/Fuse/Strip; trained here (2048),
                   plus added tokens with lstrip, rstrip and normalized=True
  llama2_metaspace/  the same model with Metaspace(prepend_scheme "first") instead of the normalizer
  metaspace_split/   the same model with Metaspace(prepend_scheme "always", split) and its decoder
  tiktokenizer/    Megatron's TikTokenizer vocabulary (a JSON list of {rank, token_bytes,
                   token_str}): the 256 bytes, then o200k_base's first 3840 longer tokens in order
                   (Megatron asserts ranks 0..255 are the bytes); ids from tiktoken with
                   Megatron's v1 and v2 patterns, 1000 special tokens, allowed_special="all"

Held-out text: the Gutenberg books in HELD_OUT (never used for training here) and dev/data's tiny
shakespeare, each encoded whole; plus hundreds of short cases: prose excerpts, the hand-written and
fuzzed strings of dev/gen_tokenizer_vectors.py, special tokens inside text, NFC stress text.

Files per tokenizer directory:
  tokenizer.json, tokenizer_config.json     (HF; the config names bos/eos as transformers reads them)
  cases.bin   b"MTTOKV1\\0", uint32 n, then per case: uint32 byte length, bytes, uint32 count, int32 ids
              (tokenizer.encode(text).ids: added tokens matched, the template's BOS included)
  texts.bin   b"MTTOKH1\\0", uint32 n, then per text: uint32 name length, name, uint64 byte length,
              uint64 FNV-1a of the bytes, uint64 token count, uint32 block, uint32 number of blocks,
              uint64 FNV-1a of the int32 ids of each block of `block` tokens
Names in texts.bin: "dev/data/tinyshakespeare.txt", or "gutenberg:<member>" (a member of
../shared/data/gutenberg/books.tar.xz). Invalid UTF-8 is decoded with errors='replace' first, as the
C tokenizer does.

  python dev/gen_hf_tokenizer_vectors.py [--shared ../shared/data] [--out dev/data/tokenizers]
"""
import argparse
import base64
import json
import os
import random
import struct
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gen_tokenizer_vectors as gtv  # noqa: E402  (the shared case generators and tiktoken loaders)

PAT_LLAMA3 = gtv.LLAMA3_PAT
PAT_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Megatron-LM megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py
PAT_TIKTOKEN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PAT_TIKTOKEN_V2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                   r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
                   r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MEGATRON_SPECIALS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]

GUTENBERG_MEMBER = "gutenberg/data/books/"
HELD_OUT = ["4300-0.txt", "pg48731.txt", "pg4657.txt", "11-0.txt"]          # Ulysses, Les Miserables, Burton, Alice
TRAIN = ["Pride_and_Prejudice_JaneAusten.txt", "2701-0.txt", "98-0.txt", "pg1497.txt", "1184-0.txt"]
BLOCK = 4096  # tokens per hash block in texts.bin


# ---- helpers -----------------------------------------------------------------------------------

def bytes_to_unicode():
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest for U+0100.. in order."""
    keep = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + n)
            n += 1
    return table


BYTE_CHAR = bytes_to_unicode()


def byte_str(b):
    return "".join(BYTE_CHAR[x] for x in b)


def fnv64(data):
    h = 0xCBF29CE484222325
    for x in data:
        h = ((h ^ x) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def ids_hash(ids):
    return fnv64(struct.pack("<%di" % len(ids), *ids))


def tiktoken_merges(ranks):
    """transformers' TikTokenConverter: every split of a token into two tokens is a merge; merges
    sorted by the merged token's rank, a token's splits by the ranks of their halves."""
    merges = []
    for token, rank in ranks.items():
        if len(token) == 1:
            continue
        local = []
        for k in range(1, len(token)):
            left, right = token[:k], token[k:]
            if left in ranks and right in ranks:
                local.append((left, right, rank))
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2])
    return [(byte_str(a), byte_str(b)) for a, b, _ in merges]


def first_ranks(path, n):
    from tiktoken.load import load_tiktoken_bpe
    ranks = load_tiktoken_bpe(path)
    return {t: r for t, r in ranks.items() if r < n}


def read_gutenberg(shared, members):
    out = {}
    with tarfile.open(os.path.join(shared, "gutenberg", "books.tar.xz"), "r:xz") as tar:
        for m in members:
            out[m] = tar.extractfile(GUTENBERG_MEMBER + m).read()
    return out


def start_text(raw):
    """A book's text between the Project Gutenberg START/END lines, for training."""
    t = raw.decode("utf-8", errors="replace")
    a, b = t.find("*** START OF"), t.find("*** END OF")
    if a >= 0:
        t = t[t.find("\n", a) + 1:]
    if b >= 0:
        t = t[:b]
    return t


# ---- the tokenizers ----------------------------------------------------------------------------

def build_gpt2():
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, AddedToken
    d = os.path.join(REPO, "dev", "data", "gpt2")
    tok = Tokenizer(models.BPE.from_file(os.path.join(d, "gpt2-vocab.json"), os.path.join(d, "gpt2-merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=True)])
    j = json.loads(tok.to_str())
    j["model"]["merges"] = [" ".join(m) for m in j["model"]["merges"]]  # the "a b" form of older files
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
              "model_max_length": 1024, "tokenizer_class": "GPT2Tokenizer"}
    return j, config


def build_from_tiktoken(ranks, pattern, specials, special_ids, bos, ignore_merges, id_offset):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, AddedToken, Regex
    vocab = {byte_str(t): r + id_offset for t, r in ranks.items()}
    for t, i in zip(specials, special_ids):
        if i < id_offset:
            vocab[t] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=tiktoken_merges(ranks), fuse_unk=False, byte_fallback=False,
                               ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for t, i in zip(specials, special_ids):
        assert tok.token_to_id(t) == i, (t, i, tok.token_to_id(t))
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=bos + " $A", pair=bos + " $A " + bos + " $B:1",
                                      special_tokens=[(bos, bos_id)])])
    return tok


def build_llama3(shared):
    n = 8192
    ranks = first_ranks(os.path.join(shared, "llama3", "tokenizer.model"), n)
    specials = gtv.LLAMA3_NAMED_SPECIALS + ["<|reserved_special_token_%d|>" % (2 + i) for i in range(256 - 12)]
    tok = build_from_tiktoken(ranks, PAT_LLAMA3, specials, [n + i for i in range(256)], "<|begin_of_text|>", True, 0)
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "model_max_length": 131072,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return json.loads(tok.to_str()), config, ranks


def build_mistral_nemo(shared):
    n = 4096
    ranks = first_ranks(os.path.join(shared, "tiktoken", "o200k_base.tiktoken"), n)
    named = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
             "[/TOOL_RESULTS]", "[TOOL_CALLS]", "<pad>", "[PREFIX]", "[MIDDLE]", "[SUFFIX]"]
    specials = named + ["<SPECIAL_%d>" % i for i in range(len(named), 1000)]
    tok = build_from_tiktoken(ranks, PAT_TIKTOKEN_V2, specials, list(range(1000)), "<s>", False, 1000)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    return json.loads(tok.to_str()), config


def build_qwen2(train_texts):
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, normalizers, AddedToken, Regex, trainers
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PAT_QWEN2), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(train_texts, trainer=trainer)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    # A normalized added token: matched in the NFC text, its content NFC-normalized first.
    tok.add_tokens([AddedToken("cafe\u0301 au lait", special=False, normalized=True)])
    config = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "Qwen2Tokenizer"}
    return json.loads(tok.to_str()), config


def build_sentencepiece_bpe(train_texts):
    """A Mistral-7B-v0.1 shaped tokenizer.json and two Metaspace variants of the same model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, processors, normalizers, AddedToken, trainers
    trainee = Tokenizer(models.BPE(unk_token="<unk>"))
    trainee.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainee.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never", split=True)
    counts = {}  # the 120 commonest characters, ties broken by the character: a reproducible alphabet
    for t in train_texts:
        for ch in t.replace(" ", "\u2581"):
            counts[ch] = counts.get(ch, 0) + 1
    alphabet = [ch for ch, _ in sorted(counts.items(), key=lambda x: (-x[1], x[0]))[:120]]
    trainer = trainers.BpeTrainer(vocab_size=2048 - 259, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    trainee.train_from_iterator(train_texts, trainer=trainer)
    trained = json.loads(trainee.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab["<0x%02X>" % b] = 3 + b
    for t, i in sorted(trained["vocab"].items(), key=lambda x: x[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    merges = [tuple(m) for m in trained["merges"]]

    def make(variant):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        sp_decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)])
        if variant == "prepend":
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
            tok.decoder = sp_decoder
        elif variant == "first":
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            tok.decoder = sp_decoder
        else:
            tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
            tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
        tok.add_special_tokens([AddedToken("<mask>", special=True, normalized=False, lstrip=True),
                                AddedToken("[SEP]", special=True, normalized=False, rstrip=True)])
        tok.add_tokens([AddedToken("<|user|>", special=False, normalized=True)])
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                           special_tokens=[("<s>", 1)])
        return json.loads(tok.to_str())
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "LlamaTokenizer"}
    return {"mistral": (make("prepend"), config), "llama2_metaspace": (make("first"), config),
            "metaspace_split": (make("always"), config)}


def megatron_vocab(path, n):
    """A vocabulary in the shape Megatron's loader asserts: ranks 0..255 are the bytes 0..255 in
    order, then o200k_base's longer tokens in o200k's order, n in all."""
    from tiktoken.load import load_tiktoken_bpe
    longer = [t for t, _ in sorted(load_tiktoken_bpe(path).items(), key=lambda x: x[1]) if len(t) > 1]
    tokens = [bytes([b]) for b in range(256)] + longer[:n - 256]
    return {t: r for r, t in enumerate(tokens)}


def write_tiktokenizer_vocab(path, ranks):
    vocab = []
    for t, r in sorted(ranks.items(), key=lambda x: x[1]):
        vocab.append({"rank": r, "token_bytes": base64.b64encode(t).decode("ascii"),
                      "token_str": t.decode("utf-8", errors="replace")})
    with open(path, "w") as f:
        json.dump(vocab, f)


def megatron_tiktokenizer(ranks, pattern, num_special=1000):
    """Megatron's TikTokenizer (core tokenizers, tiktoken_tokenizer.py): ranks shifted by the
    special-token count, default special tokens plus <SPECIAL_k> fillers, text_to_ids =
    encode(text, allowed_special="all")."""
    import tiktoken
    specials = MEGATRON_SPECIALS + ["<SPECIAL_%d>" % i for i in range(len(MEGATRON_SPECIALS), num_special)]
    return tiktoken.Encoding(name="megatron", pat_str=pattern, mergeable_ranks={t: r + num_special for t, r in ranks.items()},
                             special_tokens={t: i for i, t in enumerate(specials)})


# ---- cases -------------------------------------------------------------------------------------

def nfc_stress_cases(seed=7):
    """Decomposed letters, marks out of canonical order, Hangul jamo, composition exclusions and
    singletons: what NFC rewrites."""
    rng = random.Random(seed)
    pieces = ["e\u0301", "a\u0300\u0323", "a\u0323\u0300", "o\u0308\u0304", "u\u031b\u0301", "A\u030a", "\u212b",
              "\u2126", "\u1100\u1161", "\u1100\u1161\u11a8", "\uac00\u11a8", "\u0958", "\u0915\u093c", "\u1e9b\u0323",
              "\u0344", "\u0340a", "\u0f73", "\u0dd9\u0dcf", "\u0b47\u0b3e", "\u05d0\u05b8\u05bc", "\u0626\u0654",
              "ç", "Ç", "c\u0327", "\u00e9", "\u0301", "\u0327\u0301x", "x\u0301\u0327", "\u1026\u102e", "\u30d5\u309a",
              "\u3046\u3099", "\U0001D15E", "\U0001D160", "\u2000", "\u2001", "\uf900", "\ufb1d", " ", "\n", "word", "q"]
    out = ["".join(pieces).encode("utf-8")]
    for _ in range(40):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))).encode("utf-8"))
    return out


def special_cases(specials):
    s = [
        "Hello<|endoftext|>world", "<|endoftext|>", "a <|endoftext|> b", "<|endoftext|><|endoftext|>x",
        "<|begin_of_text|>Hi<|end_of_text|>", "<|eot_id|>\n\n<|start_header_id|>user<|end_header_id|>",
        "<|im_start|>system\nYou are<|im_end|>\n", "<s>[INST] hello [/INST] world</s>", "<s> </s>", "x<unk>y",
        "text <mask> more", "text     <mask>", "  <mask>", "<mask>  x", "[SEP]  after", "a [SEP]\n\tb", "[SEP]",
        "say <|user|> and x<|user|>y", " <|user|>", "<|user|>", "<SPECIAL_12> <SPECIAL_999><SPECIAL_1000>",
        "<pad><cls><sep>", "café au lait, cafe\u0301 au lait, CAFE\u0301", "<|endoftext", "<|im_start", "< s>",
        "\u2581leading meta \u2581\u2581 symbols\u2581", "  two leading spaces", "\ttab first", "",
    ]
    s += ["%s%s%s" % (a, t, b) for t in specials for a, b in (("", ""), ("x", " y"), (" ", "\n"))]
    return [t.encode("utf-8") for t in s]


def all_cases(shared):
    shake = open(os.path.join(REPO, "dev", "data", "tinyshakespeare.txt"), "rb").read()
    cases = [shake[:3000], shake[500000:502000]]
    cases += gtv.gutenberg_excerpts(os.path.join(shared, "gutenberg", "books.tar.xz"))
    cases += gtv.handwritten_cases()
    cases += gtv.fuzz_cases(300)
    cases += nfc_stress_cases()
    return cases


def write_cases(path, cases, ids):
    gtv.write_vectors(path, cases, ids)


def write_texts(path, texts):
    """texts: list of (name, bytes, ids)."""
    with open(path, "wb") as f:
        f.write(b"MTTOKH1\0")
        f.write(struct.pack("<I", len(texts)))
        for name, data, ids in texts:
            nb = name.encode("utf-8")
            blocks = [ids_hash(ids[k:k + BLOCK]) for k in range(0, len(ids), BLOCK)]
            f.write(struct.pack("<I", len(nb)) + nb)
            f.write(struct.pack("<QQQII", len(data), fnv64(data), len(ids), BLOCK, len(blocks)))
            f.write(struct.pack("<%dQ" % len(blocks), *blocks))


# ---- main --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(REPO), "shared", "data"))
    ap.add_argument("--out", default=os.path.join(REPO, "dev", "data", "tokenizers"))
    args = ap.parse_args()
    from tokenizers import Tokenizer

    books = read_gutenberg(args.shared, HELD_OUT + TRAIN)
    train_texts = []
    for m in TRAIN:
        t = start_text(books[m])
        train_texts += [t[k:k + 20000] for k in range(0, len(t), 20000)]
    shake = open(os.path.join(REPO, "dev", "data", "tinyshakespeare.txt"), "rb").read()
    big = [("dev/data/tinyshakespeare.txt", shake)] + [("gutenberg:" + GUTENBERG_MEMBER + m, books[m]) for m in HELD_OUT]
    cases = all_cases(args.shared)

    built = {}
    built["gpt2"] = build_gpt2()
    j, config, llama_ranks = build_llama3(args.shared)
    built["llama3"] = (j, config)
    built["qwen2"] = build_qwen2(train_texts)
    built["mistral_nemo"] = build_mistral_nemo(args.shared)
    built.update(build_sentencepiece_bpe(train_texts))

    total = 0
    for name, (j, config) in built.items():
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        text = json.dumps(j, ensure_ascii=False, indent=None, separators=(",", ":"))
        with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
            f.write(text)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))  # ids from the file as written
        specials = [t["content"] for t in j["added_tokens"]][:40]
        my_cases = cases + special_cases(specials)
        ids = [tok.encode(c.decode("utf-8", errors="replace")).ids for c in my_cases]
        write_cases(os.path.join(d, "cases.bin"), my_cases, ids)
        texts = [(n, b, tok.encode(b.decode("utf-8", errors="replace")).ids) for n, b in big]
        write_texts(os.path.join(d, "texts.bin"), texts)
        if name == "gpt2":  # GPT-2's files through tiktoken agree wherever special-token text is absent
            enc = gtv.load_encodings(args.shared, names=("gpt2",), with_gpt2_files=False)["gpt2"]
            for (n, b, t) in texts:
                assert enc.encode_ordinary(b.decode("utf-8", errors="replace")) == t, n
        if name == "llama3":  # the converted file gives tiktoken's ids
            import tiktoken
            enc = tiktoken.Encoding(name="l3", pat_str=PAT_LLAMA3, mergeable_ranks=llama_ranks, special_tokens={})
            for (n, b, t) in texts:
                assert t[1:] == enc.encode_ordinary(b.decode("utf-8", errors="replace")), n
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        total += size
        print("%-44s %4d cases %8d text tokens %9d bytes" % (os.path.relpath(d, REPO), len(my_cases),
                                                            sum(len(t[2]) for t in texts), size))

    # Megatron's TikTokenizer: one vocabulary, both patterns.
    d = os.path.join(args.out, "tiktokenizer")
    os.makedirs(d, exist_ok=True)
    ranks = megatron_vocab(os.path.join(args.shared, "tiktoken", "o200k_base.tiktoken"), 4096)
    write_tiktokenizer_vocab(os.path.join(d, "vocab.json"), ranks)
    my_cases = cases + special_cases(MEGATRON_SPECIALS + ["<SPECIAL_7>", "<SPECIAL_999>"])
    for pat_name, pat in (("v1", PAT_TIKTOKEN_V1), ("v2", PAT_TIKTOKEN_V2)):
        enc = megatron_tiktokenizer(ranks, pat)
        ids = [enc.encode(c.decode("utf-8", errors="replace"), allowed_special="all") for c in my_cases]
        write_cases(os.path.join(d, "cases_%s.bin" % pat_name), my_cases, ids)
        texts = [(n, b, enc.encode(b.decode("utf-8", errors="replace"), allowed_special="all")) for n, b in big]
        write_texts(os.path.join(d, "texts_%s.bin" % pat_name), texts)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    total += size
    print("%-44s %4d cases %9d bytes" % (os.path.relpath(d, REPO), len(my_cases), size))
    print("total %d bytes" % total)


if __name__ == "__main__":
    main()
