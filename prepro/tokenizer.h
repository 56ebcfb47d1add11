/*
 * prepro/tokenizer.h — byte-pair-encoding tokenizers and the preprocess_data pipeline (stb style).
 *
 * The tokenizers, under Megatron-LM's --tokenizer-type names and meanings (A.10):
 *   GPT2BPETokenizer      --vocab-file encoder.json --merge-file vocab.bpe: GPT-2 as Hugging Face's
 *                         GPT-2 tokenizer encodes (Megatron builds it through transformers), so
 *                         "<|endoftext|>" inside a text is the special token 50256.
 *   HuggingFaceTokenizer  --tokenizer-model DIR|tokenizer.json: a Hugging Face tokenizer.json with a
 *                         BPE model (GPT-2, Llama-3, Qwen2, Mistral-Nemo byte-level BPE; Mistral-7B /
 *                         Llama-2 sentencepiece BPE with byte fallback): its normalizer, pre-tokenizer,
 *                         added and special tokens, and the BOS its post-processor adds, as
 *                         tokenizer(text).input_ids gives them. EOD is the eos_token of the
 *                         tokenizer_config.json (or special_tokens_map.json) beside it.
 *   TikTokenizer          --tokenizer-model vocab.json: Megatron's own tiktoken tokenizer (a JSON list
 *                         of {rank, token_bytes, token_str}; ids shifted by --tiktoken-num-special-tokens,
 *                         special tokens matched in text, --tiktoken-pattern v1|v2).
 *   NullTokenizer         no tokenizer (--vocab-size only).
 * and this project's own, under names Megatron does not use:
 *   TiktokenFileTokenizer a tiktoken rank file (r50k_base, cl100k_base, o200k_base): ids exactly
 *                         tiktoken's encode_ordinary (special-token text is plain text).
 *   Llama3Tokenizer       Meta's Llama-3 tokenizer.model (a tiktoken rank file + 256 special tokens),
 *                         as tiktoken's encode_ordinary with Meta's pattern.
 *
 * Encoding a text, in the order Hugging Face's tokenizers library runs it (A.5):
 *   1. Invalid UTF-8 is replaced as Python's bytes.decode('utf-8', errors='replace') does it: each
 *      maximal invalid subpart becomes U+FFFD.
 *   2. Added tokens that are not normalized (special tokens) are cut out of the raw text, leftmost
 *      and longest first, honouring lstrip/rstrip.
 *   3. Each remaining segment is normalized (NFC, Prepend, Replace), and the normalized added tokens
 *      are cut out of it.
 *   4. Pre-tokenization cuts each segment into pieces with the tokenizer's split pattern. A tokenizer
 *      file carries the pattern as a regex; this file does not interpret regexes: each known pattern
 *      (GPT-2, cl100k, o200k, Llama-3, Qwen2, Megatron's v1 and v2 = Mistral's tekken) is a
 *      hand-written matcher (A.2) giving the regex's matches, backtracking included, with character
 *      classes from prepro/unicode_tables.h; an unknown pattern is refused when loading. ByteLevel
 *      (an optional leading space) and Metaspace (spaces become U+2581) rewrite the segment first.
 *   5. Byte-pair encoding of each piece (A.4): a piece that is a token may be that token at once
 *      (tiktoken, and Hugging Face's ignore_merges); otherwise start from its bytes (byte-level
 *      tokenizers) or characters (sentencepiece ones: a missing character becomes its <0xNN> byte
 *      tokens, or the unknown token) and repeatedly merge the adjacent pair of lowest merge rank,
 *      leftmost on ties, until no pair merges. Ranks belong to pairs of tokens, as in Hugging Face's
 *      BPE and GPT-2's encoder; for a tiktoken rank file a pair's rank is the rank of the token it
 *      makes, which gives tiktoken's merges exactly.
 *   6. The post-processor's template adds BOS (and EOS) around the ids.
 *
 * The second half of this file is the preprocess_data pipeline (Megatron's
 * tools/preprocess_data.py): JSONL or plain-text documents in (.gz/.zst decompressed when the build
 * found zlib/zstd), one .bin/.idx dataset per JSON key out, encoded by a pool of threads and written
 * in input order, so the output bytes do not depend on the number of workers.
 * prepro/preprocess_data.c is its command line.
 *
 * Use: #define MT_TOKENIZER_IMPLEMENTATION in exactly one C or C++ file before including this
 * header, or before including it again after a declarations-only include (as megatron.h's banner
 * shows). It includes "megatron.h" (mt_status, mt_error, the indexed-dataset writer) and
 * "safetensors.h" (the JSON reader, for tokenizer.json): keep them side by side, or put their
 * directories on the include path (-I). The implementation compiles safetensors.h's implementation
 * too unless that translation unit already has it, so a program must not compile safetensors.h's
 * implementation in another file as well. It needs C11 or C++ (timespec_get), POSIX threads
 * (-lpthread) and POSIX file calls (-D_POSIX_C_SOURCE=200809L in a strict ISO mode); compressed
 * input needs -DMT_HAVE_ZLIB (-lz) and/or -DMT_HAVE_ZSTD (-lzstd). Library code never prints and
 * never exits: failures come back as an mt_status with a one-line message in the mt_error. A loaded
 * tokenizer is immutable and can be shared by threads.
 */
#ifndef MT_TOKENIZER_H
#define MT_TOKENIZER_H

#include <signal.h>
#include <stddef.h>
#include <stdint.h>

#include "megatron.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* A. Tokenizers                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

typedef struct mt_tokenizer mt_tokenizer; /* opaque, immutable after load: safe to share across threads */

/* What a tokenizer was loaded from. The first four are tiktoken encodings (their split pattern and
 * special tokens); GPT2 is also GPT2BPETokenizer's encoder.json + vocab.bpe. */
typedef enum {
    MT_TOKENIZER_GPT2 = 0,
    MT_TOKENIZER_CL100K,
    MT_TOKENIZER_O200K,
    MT_TOKENIZER_LLAMA3,
    MT_TOKENIZER_HUGGINGFACE, /* a tokenizer.json */
    MT_TOKENIZER_TIKTOKENIZER /* Megatron's TikTokenizer JSON vocabulary */
} mt_tokenizer_kind;

/* GPT2BPETokenizer: Megatron's --vocab-file (encoder.json) + --merge-file (vocab.bpe), encoded as
 * Hugging Face's GPT-2 tokenizer does: merge priority is the merge's line in vocab.bpe, ids come
 * from encoder.json, and "<|endoftext|>" in a text is that special token. */
mt_status mt_tokenizer_load_gpt2(mt_tokenizer** out, const char* vocab_json_path, const char* merges_path, mt_error* err);
/* tiktoken rank file (base64 token, space, rank per line): r50k_base (kind GPT2), cl100k_base,
 * o200k_base, or Llama-3's tokenizer.model (kind LLAMA3: 256 special tokens after the ranks).
 * Encodes as tiktoken's encode_ordinary: special-token text is plain text. */
mt_status mt_tokenizer_load_tiktoken(mt_tokenizer** out, const char* rank_file_path, mt_tokenizer_kind kind, mt_error* err);

/* HuggingFaceTokenizer: path is a tokenizer.json or a directory holding one; eos/bos come from the
 * tokenizer_config.json and special_tokens_map.json beside it, as transformers reads them, and an
 * add_bos_token / add_eos_token there replaces the post-processor's template with [bos] text [eos]
 * (as transformers' TokenizersBackend does; an absent key counts as false).
 * include_special_tokens: 1 (Megatron's default) adds what the post-processor adds (BOS ...), as
 * tokenizer(text).input_ids does; 0 is --tokenizer-hf-no-include-special-tokens. Supported: model
 * BPE (vocab, merges as "a b" strings or [a, b] pairs, unk_token, fuse_unk, byte_fallback,
 * ignore_merges); normalizers NFC, Prepend, Replace (a string pattern) and Sequences of them;
 * pre-tokenizers ByteLevel, Split (a known pattern, Isolated), Metaspace and Sequences of them;
 * post-processors TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence;
 * decoders ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip. Anything else is refused with
 * one line naming it. */
mt_status mt_tokenizer_load_hf(mt_tokenizer** out, const char* path, int include_special_tokens, mt_error* err);

/* TikTokenizer, as Megatron-LM defines it (megatron/core/tokenizers, tiktoken_tokenizer.py). */
typedef struct {
    const char* pattern;                 /* --tiktoken-pattern: "v1" or "v2" (NULL: v2) */
    int64_t vocab_size;                  /* --vocab-size (0: 131072); the JSON list is cut to
                                          * vocab_size - num_special_tokens ranks */
    int64_t num_special_tokens;          /* --tiktoken-num-special-tokens (Megatron's default 1000) */
    const char* const* special_tokens;   /* --tokenizer-special-tokens (NULL: <unk> <s> </s> <mask>
                                          * <pad> <cls> <sep>); the rest up to num_special_tokens are
                                          * <SPECIAL_k> */
    int num_given_special_tokens;
} mt_tiktokenizer_options;
void mt_tiktokenizer_options_init(mt_tiktokenizer_options* opt); /* Megatron's defaults */
/* Token ids: specials 0..num_special_tokens-1, rank r is id r + num_special_tokens. Encodes as
 * tiktoken's encode(text, allowed_special="all"); EOD is </s>. */
mt_status mt_tokenizer_load_tiktokenizer(mt_tokenizer** out, const char* json_path, const mt_tiktokenizer_options* opt,
                                        mt_error* err);

/* Megatron's tokenizer flags, for mt_tokenizer_load_by_type. */
typedef struct {
    const char* type;                    /* --tokenizer-type */
    const char* model;                   /* --tokenizer-model */
    const char* vocab_file;              /* --vocab-file */
    const char* merge_file;              /* --merge-file */
    int64_t vocab_size;                  /* --vocab-size (0: not given) */
    const char* tiktoken_pattern;        /* --tiktoken-pattern */
    int64_t tiktoken_num_special_tokens; /* --tiktoken-num-special-tokens (default 1000) */
    const char* const* special_tokens;   /* --tokenizer-special-tokens */
    int num_special_tokens;
    int hf_no_include_special_tokens;    /* --tokenizer-hf-no-include-special-tokens */
    const char* tiktoken_encoding;       /* TiktokenFileTokenizer: r50k_base, cl100k_base or o200k_base
                                          * (NULL: from the file name) */
} mt_tokenizer_args;
void mt_tokenizer_args_init(mt_tokenizer_args* args); /* Megatron's defaults, every path unset */
/* Loads the tokenizer --tokenizer-type names (see the top of this file). NullTokenizer gives
 * *out = NULL and MT_OK when --vocab-size is set. Megatron's types this build does not implement
 * (SentencePiece .model files, BERT WordPiece, multimodal, SFT) are refused with one line saying
 * what to use instead. */
mt_status mt_tokenizer_load_by_type(mt_tokenizer** out, const mt_tokenizer_args* args, mt_error* err);

void mt_tokenizer_free(mt_tokenizer* tok);

mt_tokenizer_kind mt_tokenizer_get_kind(const mt_tokenizer* tok);
/* "gpt2", "cl100k_base", "o200k_base", "llama3", "huggingface", "tiktokenizer". */
const char* mt_tokenizer_kind_name(mt_tokenizer_kind kind);
/* Parses a tiktoken encoding name: r50k_base|gpt2, cl100k_base, o200k_base, llama3. */
mt_status mt_tokenizer_kind_from_name(const char* name, mt_tokenizer_kind* out, mt_error* err);
/* Guesses the encoding from a rank file's name (r50k/gpt2, cl100k, o200k, llama/tokenizer.model):
 * 1 and *out set when it can, else 0. */
int mt_tokenizer_kind_from_path(const char* path, mt_tokenizer_kind* out);

/* Number of token ids, specials included (the largest id + 1): 50257 GPT-2, 100277 cl100k,
 * 200019 o200k, 128256 Llama-3; for TikTokenizer its vocab_size. */
int64_t mt_tokenizer_vocab_size(const mt_tokenizer* tok);
/* The end-of-document id Megatron appends: <|endoftext|> (GPT-2, cl100k, o200k), <|end_of_text|>
 * (Llama-3), </s> (TikTokenizer), the eos_token of a Hugging Face tokenizer (its sep_token when it
 * has no eos, as Megatron does); -1 when the tokenizer names none. */
int32_t mt_tokenizer_eod(const mt_tokenizer* tok);
/* The beginning-of-sequence id (Hugging Face bos_token, TikTokenizer <s>, Llama-3
 * <|begin_of_text|>), or -1. */
int32_t mt_tokenizer_bos(const mt_tokenizer* tok);

/* Encodes one document as the tokenizer's Megatron type does (the top of this file): appends to
 * *tokens (realloc'd as needed, capacity in *cap, used length in *count) and returns the count
 * appended, or -1 when memory runs out. *tokens may start NULL with *count = *cap = 0. A tokenizer
 * whose template adds BOS gives [BOS] for an empty text. Thread-safe: any number of threads may
 * encode with one tokenizer at once. */
int64_t mt_tokenizer_encode(const mt_tokenizer* tok, const char* text, size_t len, int32_t** tokens, size_t* count, size_t* cap);
/* What one token decodes to (byte-level tokens: their bytes; sentencepiece tokens: U+2581 as a
 * space, <0xNN> as the byte; special and added tokens: their text); returns the length and sets
 * *bytes, or 0 for an unknown id. */
size_t mt_tokenizer_token_bytes(const mt_tokenizer* tok, int32_t id, const char** bytes);
/* The id of a token given its text as the vocabulary writes it (the bytes for byte-level
 * vocabularies; sentencepiece tokens with their U+2581), special and added tokens included, or -1. */
int32_t mt_tokenizer_token_id(const mt_tokenizer* tok, const char* bytes, size_t len);
/* The text of ids (malloc'd, NUL-terminated, caller frees): each token's bytes in order, then the
 * decoder's sequence rules (a sentencepiece decoder's Strip drops the leading space). The bytes
 * are not checked for UTF-8. MT_ERR_RANGE for an unknown id. */
mt_status mt_tokenizer_decode(const mt_tokenizer* tok, const int32_t* ids, size_t n, char** out, size_t* out_len, mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* B. JSON lines                                                                                   */
/* ---------------------------------------------------------------------------------------------- */

/* Parses one JSON object (one JSONL line, trailing whitespace allowed) and returns the string value
 * of each of keys[0..num_keys): values[k] / lengths[k], UTF-8, not NUL-terminated. Values point
 * into `line` when the string has no escapes, else into *scratch (realloc'd; the caller frees it
 * once done with the values). Strict JSON as Python's json.loads reads it (NaN/Infinity allowed,
 * raw control characters in strings rejected, the last of duplicate keys wins); \uXXXX escapes
 * become UTF-8, surrogate pairs are joined and a lone surrogate becomes U+FFFD (what tiktoken does
 * with one). MT_ERR_FORMAT with a message (malformed JSON, missing key, value not a string). */
mt_status mt_json_object_strings(const char* line, size_t len, const char* const* keys, int num_keys, const char** values,
                                 size_t* lengths, char** scratch, size_t* scratch_cap, mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* C. The preprocess_data pipeline                                                                 */
/* ---------------------------------------------------------------------------------------------- */

typedef enum {
    MT_INPUT_JSONL = 0, /* one JSON object per line; blank lines are skipped */
    MT_INPUT_TEXT = 1   /* each file is one document (raw bytes) */
} mt_input_format;

typedef struct {
    int64_t documents;     /* documents written (each key's dataset has this many) */
    int64_t tokens;        /* tokens written, all keys, EOD included */
    int64_t bytes_read;    /* input bytes behind the documents written (decompressed) */
    int64_t bytes_total;   /* total input bytes (sum of the input file sizes, compressed as stored) */
    int64_t bad_lines;     /* malformed lines skipped (skip_bad_lines) */
    int64_t blank_lines;   /* whitespace-only JSONL lines skipped */
    int64_t empty_docs;    /* documents that encoded to no tokens (zero-sequence documents) */
    double seconds;        /* since mt_preprocess started */
} mt_preprocess_stats;

typedef struct {
    const char* const* inputs;      /* files; a directory stands for every file under it (depth first,
                                     * each directory's entries sorted by name, hidden names skipped).
                                     * Names ending in .gz / .zst are decompressed (when built with
                                     * zlib / zstd; otherwise refused) */
    int num_inputs;
    mt_input_format format;
    const char* output_prefix;      /* writes {prefix}_{key}_document.bin/.idx per key */
    const char* const* json_keys;   /* NULL/0: {"text"}; in text mode the one key only names the output */
    int num_json_keys;
    const mt_tokenizer* tokenizer;
    int append_eod;                 /* append the tokenizer's EOD to each non-empty document */
    int workers;                    /* encoding threads (>= 1) */
    int skip_bad_lines;             /* skip (and count) malformed JSONL lines instead of failing */
    size_t batch_bytes;             /* input bytes per unit of work; 0: 1 MiB */
    size_t max_line_bytes;          /* the longest JSONL line (its newline not counted), or with text
                                     * input the largest file, taken; 0: 1 GiB (MT_PREPROCESS_MAX_LINE).
                                     * A longer one stops the run (--skip-bad-lines does not skip it)
                                     * before more than about this much of it is held in memory:
                                     * "<file>: line <n> is longer than --max-line-bytes (<limit>)" */
    /* Optional, called from the calling thread: after each batch written, and for each skipped bad
     * line ("file:line: problem"), in input order. */
    void (*progress)(void* user, const mt_preprocess_stats* stats);
    void (*bad_line)(void* user, const char* message);
    void* user;
    /* Optional: when *cancel becomes non-zero (e.g. from a SIGINT handler), stop within about 0.1 s
     * wherever the run is (waiting for input from a FIFO or pipe, reading, encoding even one long
     * document: checked every 4096 pieces and 2^16 merge steps, writing), remove the temporary files
     * and return MT_ERR_IO "interrupted". Not checked inside the final fsyncs, nor inside the linear
     * passes over one document's bytes (JSON, UTF-8, NFC: about a second for a 1 GiB line). The
     * worker threads block every signal, so a process-directed signal reaches a thread of the caller. */
    const volatile sig_atomic_t* cancel;
} mt_preprocess_config;

#define MT_PREPROCESS_MAX_LINE ((size_t)1 << 30) /* max_line_bytes' default: 1 GiB */

/* Runs the whole job. Output files are written under temporary names and renamed into place only
 * when everything succeeded, so a failed or interrupted run leaves no dataset behind. The bytes
 * written do not depend on cfg->workers. stats may be NULL. */
mt_status mt_preprocess(const mt_preprocess_config* cfg, mt_preprocess_stats* stats, mt_error* err);

/* Which compressed inputs this build reads: ".gz .zst", ".gz", ".zst" or "" (for messages). */
const char* mt_preprocess_compressions(void);

#ifdef __cplusplus
}
#endif

#endif /* MT_TOKENIZER_H */

/* ============================================================================================== */
/*                                       IMPLEMENTATION                                           */
/* ============================================================================================== */
#ifdef MT_TOKENIZER_IMPLEMENTATION
#ifndef MT_TOKENIZER_IMPLEMENTATION_ONCE
#define MT_TOKENIZER_IMPLEMENTATION_ONCE

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#if defined(MT_HAVE_ZLIB)
#include <zlib.h>
#endif
#if defined(MT_HAVE_ZSTD)
#include <zstd.h>
#endif

#include "unicode_tables.h"
/* The JSON reader (tokenizer.json, encoder.json, tokenizer_config.json): safetensors.h's, compiled
 * here unless this translation unit already has it. */
#if !defined(MT_SAFETENSORS_IMPLEMENTATION_DONE) && !defined(MT_SAFETENSORS_IMPLEMENTATION)
#define MT_SAFETENSORS_IMPLEMENTATION
#endif
#include "safetensors.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* A.1 Small helpers                                                                              */
/* ---------------------------------------------------------------------------------------------- */

#define MTK__NO_RANK 0xFFFFFFFFu

/* Whether a cancellation flag (may be NULL) was set, e.g. by a SIGINT handler. */
static inline int mtk__cancelled(const volatile sig_atomic_t* cancel) { return cancel && *cancel; }

/* A whole tokenizer file (a regular file of at most 1 GiB, NUL-terminated): megatron.h's mt_read_file. */
static mt_status mtk__read_file(const char* path, uint8_t** out, size_t* len, mt_error* err) {
    char* data = NULL;
    mt_status st = mt_read_file(path, (size_t)1 << 30, &data, len, err);
    *out = (uint8_t*)data;
    return st;
}

/* Appends a code point as UTF-8; returns the byte count (1-4). */
static inline size_t mtk__utf8_put(uint8_t* p, uint32_t c) {
    if (c < 0x80) { p[0] = (uint8_t)c; return 1; }
    if (c < 0x800) { p[0] = (uint8_t)(0xC0 | (c >> 6)); p[1] = (uint8_t)(0x80 | (c & 63)); return 2; }
    if (c < 0x10000) {
        p[0] = (uint8_t)(0xE0 | (c >> 12)); p[1] = (uint8_t)(0x80 | ((c >> 6) & 63)); p[2] = (uint8_t)(0x80 | (c & 63));
        return 3;
    }
    p[0] = (uint8_t)(0xF0 | (c >> 18)); p[1] = (uint8_t)(0x80 | ((c >> 12) & 63));
    p[2] = (uint8_t)(0x80 | ((c >> 6) & 63)); p[3] = (uint8_t)(0x80 | (c & 63));
    return 4;
}

/* Length of the valid UTF-8 sequence at s[0..n), or 0 if the bytes there are not one. The valid
 * second-byte ranges follow Unicode Table 3-7 (no overlongs, no surrogates, nothing above U+10FFFF). */
static inline size_t mtk__utf8_valid_seq(const uint8_t* s, size_t n, size_t* maximal_invalid) {
    uint8_t b = s[0];
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b >= 0xE0 && b <= 0xEF) { need = 2; if (b == 0xE0) lo = 0xA0; if (b == 0xED) hi = 0x9F; }
    else if (b >= 0xF0 && b <= 0xF4) { need = 3; if (b == 0xF0) lo = 0x90; if (b == 0xF4) hi = 0x8F; }
    else { *maximal_invalid = 1; return 0; }
    size_t k = 1;
    for (; k <= need; k++) {
        if (k >= n) break;
        uint8_t c = s[k];
        if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
    }
    if (k == need + 1) return need + 1;
    *maximal_invalid = k; /* the lead byte and the continuation bytes that were still valid */
    return 0;
}

/* Offset of the first invalid UTF-8 byte, or n. */
static size_t mtk__utf8_first_invalid(const uint8_t* s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (!(w & 0x8080808080808080ull)) { i += 8; continue; }
        }
        if (s[i] < 0x80) { i++; continue; }
        size_t bad = 0, k = mtk__utf8_valid_seq(s + i, n - i, &bad);
        if (!k) return i;
        i += k;
    }
    return n;
}

/* Python's bytes.decode('utf-8', errors='replace').encode('utf-8'): every maximal invalid
 * subpart becomes U+FFFD (EF BF BD). Returns a malloc'd copy, or NULL when out of memory. */
static uint8_t* mtk__utf8_replace(const uint8_t* s, size_t n, size_t first_bad, size_t* out_len) {
    uint8_t* out = (uint8_t*)malloc(n * 3 + 1);
    if (!out) return NULL;
    memcpy(out, s, first_bad);
    size_t i = first_bad, o = first_bad;
    while (i < n) {
        if (s[i] < 0x80) { out[o++] = s[i++]; continue; }
        size_t bad = 0, k = mtk__utf8_valid_seq(s + i, n - i, &bad);
        if (k) { memcpy(out + o, s + i, k); o += k; i += k; continue; }
        out[o++] = 0xEF; out[o++] = 0xBF; out[o++] = 0xBD;
        i += bad;
    }
    *out_len = o;
    return out;
}

/* ---------------------------------------------------------------------------------------------- */
/* Byte length of the UTF-8 character whose lead byte is b (the text is valid UTF-8). */
static inline size_t mtk__utf8_len(uint8_t b) { return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4; }

/* The code point at s[i] (valid UTF-8); *len gets its byte length. */
static inline uint32_t mtk__utf8_get(const uint8_t* s, size_t i, size_t* len) {
    uint32_t b = s[i];
    if (b < 0x80) { *len = 1; return b; }
    if (b < 0xE0) { *len = 2; return ((b & 0x1F) << 6) | (s[i + 1] & 0x3Fu); }
    if (b < 0xF0) { *len = 3; return ((b & 0x0F) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu); }
    *len = 4;
    return ((b & 0x07) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu);
}

/* Start of the UTF-8 character that ends at s[i - 1] (i > 0, valid UTF-8). */
static inline size_t mtk__utf8_prev(const uint8_t* s, size_t i) {
    do i--; while (i > 0 && (s[i] & 0xC0) == 0x80);
    return i;
}

/* A growable byte buffer. */
typedef struct {
    uint8_t* p;
    size_t len, cap;
} mtk__buf;

static int mtk__buf_reserve(mtk__buf* b, size_t need) {
    if (need <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < need) cap *= 2;
    uint8_t* np = (uint8_t*)realloc(b->p, cap);
    if (!np) return -1;
    b->p = np;
    b->cap = cap;
    return 0;
}

static inline int mtk__buf_put(mtk__buf* b, const void* p, size_t n) {
    if (mtk__buf_reserve(b, b->len + n + 1)) return -1;
    memcpy(b->p + b->len, p, n);
    b->len += n;
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.2 Pre-tokenization: the split patterns, one matcher each                                      */
/* ---------------------------------------------------------------------------------------------- */
/* Every matcher gets valid UTF-8 text s[0..n) and a position i < n, and returns the end of the
 * regex match that starts at i (tiktoken iterates matches left to right; each of these patterns
 * matches at every position, so no text is skipped). Alternatives are tried in the pattern's
 * order, as a backtracking regex engine does. Flags: MT_UC_* from unicode_tables.h. */

/* Decodes the character at s[i] (valid UTF-8): returns its byte length, sets *f to its flags. */
static inline size_t mtk__ch(const uint8_t* s, size_t i, unsigned* f) {
    uint32_t b = s[i], c;
    size_t l;
    if (b < 0x80) { *f = mt_uc_stage2[b]; return 1; }
    if (b < 0xE0) { c = ((b & 0x1F) << 6) | (s[i + 1] & 0x3Fu); l = 2; }
    else if (b < 0xF0) { c = ((b & 0x0F) << 12) | ((s[i + 1] & 0x3Fu) << 6) | (s[i + 2] & 0x3Fu); l = 3; }
    else { c = ((b & 0x07) << 18) | ((s[i + 1] & 0x3Fu) << 12) | ((s[i + 2] & 0x3Fu) << 6) | (s[i + 3] & 0x3Fu); l = 4; }
    *f = mt_uc_flags(c);
    return l;
}

/* End of the run of characters starting at i whose flags intersect `mask`. */
static inline size_t mtk__run_any(const uint8_t* s, size_t n, size_t i, unsigned mask) {
    while (i < n) {
        if (s[i] < 0x80) {
            if (!(mt_uc_stage2[s[i]] & mask)) break;
            i++;
            continue;
        }
        unsigned f;
        size_t l = mtk__ch(s, i, &f);
        if (!(f & mask)) break;
        i += l;
    }
    return i;
}

/* End of the run of characters starting at i whose flags avoid `mask` ([^...] classes). */
static inline size_t mtk__run_none(const uint8_t* s, size_t n, size_t i, unsigned mask) {
    while (i < n) {
        unsigned f;
        size_t l = mtk__ch(s, i, &f);
        if (f & mask) break;
        i += l;
    }
    return i;
}

/* GPT-2's contractions, case-sensitive: '(?:[sdmt]|ll|ve|re) with s[i] == '\''. Returns the match
 * length or 0. */
static inline size_t mtk__contraction_cs(const uint8_t* s, size_t n, size_t i) {
    if (i + 1 >= n) return 0;
    uint8_t a = s[i + 1];
    if (a == 's' || a == 'd' || a == 'm' || a == 't') return 2;
    if (i + 2 >= n) return 0;
    uint8_t b = s[i + 2];
    if ((a == 'l' && b == 'l') || (a == 'v' && b == 'e') || (a == 'r' && b == 'e')) return 3;
    return 0;
}

/* The case-insensitive contractions of cl100k/o200k/Llama-3, (?i:'s|'t|'re|'ve|'m|'ll|'d), at i
 * (s[i] must be '\''). Unicode simple case folding adds one character: U+017F LATIN SMALL LETTER
 * LONG S matches 's'. Returns the match length or 0. */
static inline size_t mtk__contraction_ci(const uint8_t* s, size_t n, size_t i) {
    if (i >= n || s[i] != '\'' || i + 1 >= n) return 0;
    uint8_t a = (uint8_t)(s[i + 1] | 0x20); /* ASCII lower case (only compared against letters) */
    if (a == 's' || a == 'd' || a == 'm' || a == 't') return 2;
    if (s[i + 1] == 0xC5 && i + 2 < n && s[i + 2] == 0xBF) return 3; /* 'ſ */
    if (i + 2 >= n) return 0;
    uint8_t b = (uint8_t)(s[i + 2] | 0x20);
    if ((a == 'l' && b == 'l') || (a == 'v' && b == 'e') || (a == 'r' && b == 'e')) return 3;
    return 0;
}

/* The whitespace alternatives that end every pattern, for a whitespace character at i:
 *   trailing_rule  `\s++$`       (cl100k): whitespace reaching the end of the text is one piece;
 *   newline_rule   `\s*[\r\n]`   (cl100k/o200k/Llama-3): up to the last \r or \n of the run;
 *                  `\s+(?!\S)`   the run, less its last character when a non-space follows;
 *                  `\s`          else one character. */
static inline size_t mtk__split_space(const uint8_t* s, size_t n, size_t i, int trailing_rule, int newline_rule) {
    size_t r = i, last = i, nl_end = 0;
    while (r < n) {
        unsigned f;
        size_t l = mtk__ch(s, r, &f);
        if (!(f & MT_UC_S)) break;
        if (f & MT_UC_NL) nl_end = r + 1;
        last = r;
        r += l;
    }
    if (trailing_rule && r == n) return n;
    if (newline_rule && nl_end) return nl_end;
    if (r == n) return n;        /* (?!\S) holds at the end of the text */
    if (last > i) return last;   /* backtrack one character so that (?!\S) holds */
    return r;                    /* a single whitespace character */
}
/* The patterns this file implements. Each tokenizer.json Split regex (and tiktoken pat_str) is
 * matched against mtk__patterns[] by its exact text; two texts can name one matcher. */
typedef enum {
    MTK__SPLIT_NONE = 0,    /* no split: the segment is one piece (sentencepiece tokenizers) */
    MTK__SPLIT_GPT2,        /* GPT-2 / r50k_base (ByteLevel's built-in regex) */
    MTK__SPLIT_CL100K,      /* cl100k_base as tiktoken writes it today (with \s++$) */
    MTK__SPLIT_LLAMA3,      /* Llama-3 = cl100k's first form */
    MTK__SPLIT_QWEN2,       /* Qwen2: Llama-3's with single digits */
    MTK__SPLIT_TIKTOKEN_V1, /* Megatron's TikTokenizer v1: cl100k's without contractions, single digits */
    MTK__SPLIT_O200K,       /* o200k_base */
    MTK__SPLIT_TIKTOKEN_V2  /* Megatron's TikTokenizer v2 = Mistral's tekken: o200k's without
                             * contractions, single digits */
} mtk__split_kind;

static const struct {
    const char* pattern;
    mtk__split_kind kind;
} mtk__patterns[] = {
    {"'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+", MTK__SPLIT_GPT2},
    {"'(?:[sdmt]|ll|ve|re)| ?\\p{L}++| ?\\p{N}++| ?[^\\s\\p{L}\\p{N}]++|\\s++$|\\s+(?!\\S)|\\s", MTK__SPLIT_GPT2},
    {"'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|"
     "\\s*[\\r\\n]|\\s+(?!\\S)|\\s",
     MTK__SPLIT_CL100K},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     MTK__SPLIT_LLAMA3},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|"
     "\\s+(?!\\S)|\\s+",
     MTK__SPLIT_QWEN2},
    {"[^\\r\\n\\p{L}\\p{N}]?+\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
     MTK__SPLIT_TIKTOKEN_V1},
    {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
     "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
     "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     MTK__SPLIT_O200K},
    {"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|"
     "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|"
     "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
     MTK__SPLIT_TIKTOKEN_V2},
};

/* GPT-2 / r50k_base:
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * (tiktoken's equivalent form: '(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s) */
static size_t mtk__split_gpt2(const uint8_t* s, size_t n, size_t i) {
    if (s[i] == '\'') {
        size_t k = mtk__contraction_cs(s, n, i);
        if (k) return i + k;
    }
    unsigned f;
    size_t h = i;
    mtk__ch(s, i, &f);
    if ((f & MT_UC_SP) && i + 1 < n) { /* ` ?` then a letter, number or other character */
        unsigned g;
        mtk__ch(s, i + 1, &g);
        if (!(g & MT_UC_S)) { h = i + 1; f = g; }
    }
    if (f & MT_UC_L) return mtk__run_any(s, n, h, MT_UC_L);
    if (f & MT_UC_N) return mtk__run_any(s, n, h, MT_UC_N);
    if (!(f & MT_UC_S)) return mtk__run_none(s, n, h, MT_UC_L | MT_UC_N | MT_UC_S);
    return mtk__split_space(s, n, i, 1, 0);
}

/* \p{N}{1,max_digits} at i (s[i] is a number): its end. */
static inline size_t mtk__digits(const uint8_t* s, size_t n, size_t i, size_t l, int max_digits) {
    size_t e = i + l;
    unsigned g;
    for (int k = 1; k < max_digits && e < n; k++) {
        size_t m = mtk__ch(s, e, &g);
        if (!(g & MT_UC_N)) break;
        e += m;
    }
    return e;
}

/* The cl100k family. cl100k_base (contractions, 3 digits, trailing_rule):
 *   '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s
 * Llama-3 (no trailing_rule; the same matches otherwise):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Qwen2: Llama-3's with \p{N} (max_digits 1). Megatron's TikTokenizer v1: no contractions, \p{N}:
 *   [^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+
 * The calls pass constants, so each becomes its own specialised matcher. */
static inline size_t mtk__split_cl100k(const uint8_t* s, size_t n, size_t i, int trailing_rule, int contractions, int max_digits) {
    if (contractions && s[i] == '\'') {
        size_t k = mtk__contraction_ci(s, n, i);
        if (k) return i + k;
    }
    unsigned f, g;
    size_t l = mtk__ch(s, i, &f);
    if (f & MT_UC_L) return mtk__run_any(s, n, i, MT_UC_L);
    if (!(f & (MT_UC_N | MT_UC_NL)) && i + l < n) { /* one non-letter, non-number, non-newline prefix */
        mtk__ch(s, i + l, &g);
        if (g & MT_UC_L) return mtk__run_any(s, n, i + l, MT_UC_L);
    }
    if (f & MT_UC_N) return mtk__digits(s, n, i, l, max_digits);
    size_t h = i;
    if ((f & MT_UC_SP) && i + 1 < n) {
        mtk__ch(s, i + 1, &g);
        if (!(g & (MT_UC_L | MT_UC_N | MT_UC_S))) { h = i + 1; f = g; }
    }
    if (!(f & (MT_UC_L | MT_UC_N | MT_UC_S))) { /* ` ?[^\s\p{L}\p{N}]+[\r\n]*` */
        size_t e = mtk__run_none(s, n, h, MT_UC_L | MT_UC_N | MT_UC_S);
        while (e < n && (s[e] == '\r' || s[e] == '\n')) e++;
        return e;
    }
    return mtk__split_space(s, n, i, trailing_rule, 1);
}

/* o200k_base's letter alternatives. With A = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] (upper-ish) and
 * B = [\p{Ll}\p{Lm}\p{Lo}\p{M}] (lower-ish), starting at p (after the optional prefix):
 *   first:  A*B+ then an optional contraction; A* is greedy and gives back characters until B+
 *           can match, so B+ starts at the last position of the A-run where a B character stands.
 *   second: A+B* then an optional contraction.
 * Return the end, or 0 when the alternative does not match at p. */
#define MTK__O200K_A (MT_UC_LU | MT_UC_LO | MT_UC_M)
#define MTK__O200K_B (MT_UC_LL | MT_UC_LO | MT_UC_M)
static inline size_t mtk__o200k_upper_lower(const uint8_t* s, size_t n, size_t p, int contractions) {
    size_t q = p, last_ab = (size_t)-1, e;
    unsigned f = 0;
    while (q < n) {
        size_t l = mtk__ch(s, q, &f);
        if (!(f & MTK__O200K_A)) break;
        if (f & MTK__O200K_B) last_ab = q;
        q += l;
    }
    if (q < n && (f & MTK__O200K_B)) e = mtk__run_any(s, n, q, MTK__O200K_B); /* B+ right after A* */
    else if (last_ab != (size_t)-1) e = last_ab + mtk__ch(s, last_ab, &f);  /* B+ is that one character */
    else return 0;
    return contractions ? e + mtk__contraction_ci(s, n, e) : e;
}
static inline size_t mtk__o200k_upper_then_lower(const uint8_t* s, size_t n, size_t p, int contractions) {
    size_t q = mtk__run_any(s, n, p, MTK__O200K_A);
    if (q == p) return 0;
    size_t e = mtk__run_any(s, n, q, MTK__O200K_B);
    return contractions ? e + mtk__contraction_ci(s, n, e) : e;
}

/* The o200k family. o200k_base (contractions, 3 digits):
 *   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *  |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *  |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * Megatron's TikTokenizer v2 (= Mistral's tekken): the same without the contractions and with \p{N}.
 * The optional prefix is not possessive: each letter alternative is tried with it, then without. */
static inline size_t mtk__split_o200k(const uint8_t* s, size_t n, size_t i, int contractions, int max_digits) {
    unsigned f, g;
    size_t l = mtk__ch(s, i, &f), e;
    int prefix = !(f & (MT_UC_L | MT_UC_N | MT_UC_NL)) && i + l < n;
    if (prefix && (e = mtk__o200k_upper_lower(s, n, i + l, contractions))) return e;
    if ((e = mtk__o200k_upper_lower(s, n, i, contractions))) return e;
    if (prefix && (e = mtk__o200k_upper_then_lower(s, n, i + l, contractions))) return e;
    if ((e = mtk__o200k_upper_then_lower(s, n, i, contractions))) return e;
    if (f & MT_UC_N) return mtk__digits(s, n, i, l, max_digits);
    size_t h = i;
    if ((f & MT_UC_SP) && i + 1 < n) {
        mtk__ch(s, i + 1, &g);
        if (!(g & (MT_UC_L | MT_UC_N | MT_UC_S))) { h = i + 1; f = g; }
    }
    if (!(f & (MT_UC_L | MT_UC_N | MT_UC_S))) { /* ` ?[^\s\p{L}\p{N}]+[\r\n/]*` */
        e = mtk__run_none(s, n, h, MT_UC_L | MT_UC_N | MT_UC_S);
        while (e < n && (s[e] == '\r' || s[e] == '\n' || s[e] == '/')) e++;
        return e;
    }
    if (f & MT_UC_S) return mtk__split_space(s, n, i, 0, 1);
    return i; /* unreachable: every character is a letter, number, space or other */
}

/* End of the piece that starts at i (i < n). */
static inline size_t mtk__split(mtk__split_kind kind, const uint8_t* s, size_t n, size_t i) {
    switch (kind) {
        case MTK__SPLIT_NONE: return n;
        case MTK__SPLIT_GPT2: return mtk__split_gpt2(s, n, i);
        case MTK__SPLIT_CL100K: return mtk__split_cl100k(s, n, i, 1, 1, 3);
        case MTK__SPLIT_LLAMA3: return mtk__split_cl100k(s, n, i, 0, 1, 3);
        case MTK__SPLIT_QWEN2: return mtk__split_cl100k(s, n, i, 0, 1, 1);
        case MTK__SPLIT_TIKTOKEN_V1: return mtk__split_cl100k(s, n, i, 0, 0, 1);
        case MTK__SPLIT_O200K: return mtk__split_o200k(s, n, i, 1, 3);
        case MTK__SPLIT_TIKTOKEN_V2: return mtk__split_o200k(s, n, i, 0, 1);
    }
    return n;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.3 The tokenizer: vocabulary, merges, added tokens, and what runs around them                 */
/* ---------------------------------------------------------------------------------------------- */
/* Every token's bytes live in one blob. The vocabulary is a hash table from a token's bytes to its
 * entry (the bytes BPE works on: raw bytes for byte-level vocabularies, whose strings are written
 * in GPT-2's byte alphabet; the token's UTF-8 text, U+2581 included, for sentencepiece ones). The
 * merges are a hash table from a pair of token ids to (rank, the token the pair makes). Added
 * tokens (special tokens and the like) are kept apart: they are cut out of the text before
 * pre-tokenization and never take part in BPE. */

typedef struct {
    uint32_t off, len; /* the token's bytes in tok->blob */
    int32_t id;
    uint32_t rank;     /* tiktoken rank files: the token's rank (its merges are built from it) */
    uint8_t hashed;    /* reachable through the bytes table (0: a string a byte-level model cannot see) */
    uint8_t shortcut;  /* a piece with exactly these bytes encodes to this token alone */
} mtk__tok_entry;

/* A merge while loading; the table mtk__merge reads packs each into 8 bytes (left id, right id:
 * 21 bits each; rank: 22 bits), which keeps the hot table small. */
typedef struct {
    int32_t left, right, made;
    uint32_t rank;
} mtk__pair;
#define MTK__ID_BITS 21
#define MTK__MAX_ID ((1 << MTK__ID_BITS) - 1)     /* ids must be below this */
#define MTK__MAX_RANK ((1u << 22) - 2u)           /* ranks at most this */
#define MTK__PAIR_EMPTY 0xFFFFFFFFFFFFFFFFull
#define MTK__PAIR_KEY_MASK ((1ull << (2 * MTK__ID_BITS)) - 1)

typedef struct {
    uint32_t off, len;   /* the content, in tok->blob */
    uint32_t moff, mlen; /* what is matched in the text: the content, or (normalized) its normalized form */
    int32_t id;
    uint8_t normalized, lstrip, rstrip, special;
} mtk__added;

/* The added tokens matched at one stage (raw text or normalized text): leftmost, longest first. */
typedef struct {
    uint32_t* slots;     /* hash of the matched bytes -> index + 1 into tok->added */
    uint32_t bits;
    uint32_t* lens;      /* the distinct match lengths, longest first */
    int num_lens, count;
    uint8_t first[32];   /* bit set of the first bytes */
    int one_first;       /* the first byte when all tokens share it, else -1 */
} mtk__added_set;

enum { MTK__NORM_NFC = 1, MTK__NORM_PREPEND, MTK__NORM_REPLACE };
typedef struct {
    int kind;
    uint32_t a_off, a_len; /* PREPEND: the prefix; REPLACE: the string replaced */
    uint32_t b_off, b_len; /* REPLACE: its replacement */
} mtk__norm;

typedef struct {
    uint32_t off, len;
} mtk__span;

struct mt_tokenizer {
    mt_tokenizer_kind kind;
    uint8_t* blob;
    size_t blob_len, blob_cap;
    mtk__tok_entry* entries;
    uint32_t num_entries, entries_cap;
    uint64_t* slots;             /* open addressing over the entries: (hash >> 32) << 32 | (entry + 1) */
    uint32_t slot_bits;
    uint32_t max_token_len;
    mtk__pair* pair_list;        /* the merges while loading */
    uint32_t num_pairs, pairs_cap;
    uint64_t* pairs;             /* the merges: open addressing over rank << 42 | right << 21 | left */
    uint32_t pair_bits;
    int32_t* rank_made;          /* rank -> the token the merge makes; NULL: the rank is that token's id */
    /* The model. */
    int char_level;              /* 0: a piece starts as its bytes; 1: as its UTF-8 characters */
    int shortcut_all;            /* tiktoken, ignore_merges: any piece that is a token is that token */
    int32_t sym_id[256];         /* the token of each byte (char_level 0) or ASCII character (1), or -1 */
    int byte_fallback, fuse_unk;
    int32_t fallback_id[256];    /* byte_fallback: the <0xNN> tokens, or -1 */
    int32_t unk_id;              /* -1: none */
    /* Around the model: normalizer, pre-tokenizer, added tokens, template. */
    mtk__norm* norm;
    int num_norm;
    mtk__split_kind split;
    int prefix_space;            /* ByteLevel add_prefix_space: a segment not starting with ' ' gets one */
    int metaspace;               /* Metaspace: ' ' becomes meta_rep; a prefix per meta_scheme; split */
    int meta_scheme;             /* 0 never, 1 first (the text's first segment only), 2 always */
    int meta_split;              /* split before each meta_rep */
    uint8_t meta_rep[4];
    int meta_rep_len;
    mtk__added* added;
    int num_added, added_cap;
    mtk__added_set raw_set, norm_set;
    int32_t* templ;              /* the post-processor's ids: num_prefix before the text, num_suffix after */
    int num_prefix, num_suffix;
    /* Decoding. */
    int32_t* id_entry;           /* id -> entry, -1 where no vocabulary token has that id */
    mtk__span* id_span;          /* id -> the bytes it decodes to (possibly none: a decoder may remove them all) */
    uint8_t* id_present;         /* id -> 1 where a vocabulary or added token has that id */
    uint8_t dec_rep[4];          /* a Replace decoder's pattern (U+2581), or none */
    int dec_rep_len;
    uint8_t dec_rep_to[4];
    int dec_rep_to_len;
    int dec_byte_fallback;       /* <0xNN> decodes to the byte */
    int dec_strip;               /* spaces a Strip decoder removes from the start of the text */
    int dec_first_drop_rep;      /* Metaspace decoder: the first token loses its U+2581s */
    int64_t n_vocab;
    int32_t eod, bos;
};

static inline uint64_t mtk__hash(const uint8_t* p, size_t n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ ((uint64_t)n * 0xD6E8FEB86659FD93ull);
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
        h ^= h >> 32;
        p += 8;
        n -= 8;
    }
    if (n) {
        uint64_t w = 0;
        for (size_t k = 0; k < n; k++) w |= (uint64_t)p[k] << (8 * k); /* the last 1..7 bytes */
        h = (h ^ w) * 0xFF51AFD7ED558CCDull;
    }
    h ^= h >> 29;
    h *= 0xC4CEB9FE1A85EC53ull;
    h ^= h >> 32;
    return h;
}

/* Byte equality, inline: the keys are short and a libc memcmp call costs more than the compare. */
static inline int mtk__equal(const uint8_t* a, const uint8_t* b, size_t n) {
    while (n >= 8) {
        uint64_t x, y;
        memcpy(&x, a, 8);
        memcpy(&y, b, 8);
        if (x != y) return 0;
        a += 8;
        b += 8;
        n -= 8;
    }
    while (n--)
        if (*a++ != *b++) return 0;
    return 1;
}

/* The vocabulary token with these bytes (whose mtk__hash is h), or NULL. */
static inline const mtk__tok_entry* mtk__find_hashed(const mt_tokenizer* tok, const uint8_t* p, size_t n, uint64_t h) {
    uint64_t mask = ((uint64_t)1 << tok->slot_bits) - 1;
    uint64_t tag = h & 0xFFFFFFFF00000000ull;
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
        uint64_t slot = tok->slots[i];
        if (!slot) return NULL;
        if ((slot & 0xFFFFFFFF00000000ull) == tag) {
            const mtk__tok_entry* e = &tok->entries[(uint32_t)slot - 1];
            if (e->len == n && mtk__equal(tok->blob + e->off, p, n)) return e;
        }
    }
}

static inline const mtk__tok_entry* mtk__find(const mt_tokenizer* tok, const uint8_t* p, size_t n) {
    return mtk__find_hashed(tok, p, n, mtk__hash(p, n));
}

static inline uint64_t mtk__pair_slot(uint64_t key, uint32_t bits) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    return (h * 0xBF58476D1CE4E5B9ull) >> (64 - bits);
}

/* The merge of two adjacent tokens: its rank, MTK__NO_RANK when they do not merge; *made gets the
 * token they make. */
static inline uint32_t mtk__merge(const mt_tokenizer* tok, int32_t a, int32_t b, int32_t* made) {
    uint64_t key = ((uint64_t)(uint32_t)b << MTK__ID_BITS) | (uint32_t)a;
    uint64_t mask = ((uint64_t)1 << tok->pair_bits) - 1;
    for (uint64_t i = mtk__pair_slot(key, tok->pair_bits);; i = (i + 1) & mask) {
        uint64_t slot = tok->pairs[i];
        if ((slot & MTK__PAIR_KEY_MASK) == key) {
            uint32_t rank = (uint32_t)(slot >> (2 * MTK__ID_BITS));
            *made = tok->rank_made ? tok->rank_made[rank] : (int32_t)rank;
            return rank;
        }
        if (slot == MTK__PAIR_EMPTY) return MTK__NO_RANK;
    }
}

static void mtk__tok_reset(mt_tokenizer* tok) {
    free(tok->blob);
    free(tok->entries);
    free(tok->slots);
    free(tok->pairs);
    free(tok->pair_list);
    free(tok->rank_made);
    free(tok->norm);
    free(tok->added);
    free(tok->raw_set.slots);
    free(tok->raw_set.lens);
    free(tok->norm_set.slots);
    free(tok->norm_set.lens);
    free(tok->templ);
    free(tok->id_entry);
    free(tok->id_span);
    free(tok->id_present);
    memset(tok, 0, sizeof(*tok));
}

void mt_tokenizer_free(mt_tokenizer* tok) {
    if (!tok) return;
    mtk__tok_reset(tok);
    free(tok);
}

/* A new, empty tokenizer: byte-level, no merges, no normalizer, nothing around the model. */
static mt_tokenizer* mtk__tok_new(mt_tokenizer_kind kind) {
    mt_tokenizer* tok = (mt_tokenizer*)calloc(1, sizeof(mt_tokenizer));
    if (!tok) return NULL;
    tok->kind = kind;
    tok->unk_id = tok->eod = tok->bos = -1;
    for (int b = 0; b < 256; b++) tok->sym_id[b] = tok->fallback_id[b] = -1;
    return tok;
}

/* Appends bytes to the blob; *off gets where they start. */
static mt_status mtk__blob_put(mt_tokenizer* tok, const uint8_t* bytes, size_t len, uint32_t* off, mt_error* err) {
    if (tok->blob_len + len > tok->blob_cap) {
        size_t cap = tok->blob_cap ? tok->blob_cap * 2 : (1 << 20);
        while (cap < tok->blob_len + len) cap *= 2;
        if (cap > 0xFFFFFFFFu) return mt_fail(err, MT_ERR_FORMAT, "vocabulary too large");
        uint8_t* nb = (uint8_t*)realloc(tok->blob, cap);
        if (!nb) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
        tok->blob = nb;
        tok->blob_cap = cap;
    }
    if (len) memcpy(tok->blob + tok->blob_len, bytes, len);
    *off = (uint32_t)tok->blob_len;
    tok->blob_len += len;
    return MT_OK;
}

/* Adds a vocabulary token (hashed: the model can produce it from these bytes). */
static mt_status mtk__tok_add(mt_tokenizer* tok, const uint8_t* bytes, size_t len, uint32_t rank, int64_t id, int hashed,
                              mt_error* err) {
    if (id < 0 || id > 0x7FFFFFFE) return mt_fail(err, MT_ERR_FORMAT, "token id %lld out of range", (long long)id);
    if (len == 0 || len > 0xFFFF) return mt_fail(err, MT_ERR_FORMAT, "token %lld has %zu bytes", (long long)id, len);
    if (tok->num_entries == tok->entries_cap) {
        uint32_t cap = tok->entries_cap ? tok->entries_cap * 2 : 65536;
        mtk__tok_entry* ne = (mtk__tok_entry*)realloc(tok->entries, cap * sizeof(mtk__tok_entry));
        if (!ne) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
        tok->entries = ne;
        tok->entries_cap = cap;
    }
    mtk__tok_entry* e = &tok->entries[tok->num_entries];
    mt_status st = mtk__blob_put(tok, bytes, len, &e->off, err);
    if (st) return st;
    e->len = (uint32_t)len;
    e->rank = rank;
    e->id = (int32_t)id;
    e->hashed = (uint8_t)(hashed != 0);
    e->shortcut = 0;
    tok->num_entries++;
    return MT_OK;
}

/* After the vocabulary was added: the bytes table. Two tokens with the same bytes are an error. */
static mt_status mtk__tok_index(mt_tokenizer* tok, const char* path, mt_error* err) {
    uint32_t bits = 10;
    while (((uint64_t)1 << bits) < (uint64_t)tok->num_entries * 2) bits++;
    tok->slot_bits = bits;
    free(tok->slots);
    tok->slots = (uint64_t*)calloc((size_t)1 << bits, sizeof(uint64_t));
    if (!tok->slots) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    for (uint32_t k = 0; k < tok->num_entries; k++) {
        const mtk__tok_entry* e = &tok->entries[k];
        if (!e->hashed) continue;
        const uint8_t* p = tok->blob + e->off;
        const mtk__tok_entry* dup = mtk__find(tok, p, e->len);
        if (dup)
            return mt_fail(err, MT_ERR_FORMAT, "%s: tokens %d and %d have the same bytes '%.*s'", path, dup->id, e->id,
                           (int)(e->len > 40 ? 40 : e->len), (const char*)p);
        uint64_t h = mtk__hash(p, e->len), i = h & mask;
        while (tok->slots[i]) i = (i + 1) & mask;
        tok->slots[i] = (h & 0xFFFFFFFF00000000ull) | (uint64_t)(k + 1);
        if (e->len > tok->max_token_len) tok->max_token_len = e->len;
    }
    return MT_OK;
}

/* tiktoken and GPT-2 vocabularies must hold every single byte. */
static mt_status mtk__tok_require_bytes(const mt_tokenizer* tok, const char* path, mt_error* err) {
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        if (!mtk__find(tok, &byte, 1))
            return mt_fail(err, MT_ERR_FORMAT, "%s: no token for the single byte 0x%02x: not a byte-level BPE vocabulary", path, b);
    }
    return MT_OK;
}

/* Adds the merge (a, b) -> made. A pair given twice keeps its last rank (as Hugging Face's map
 * built from the merges list does). The table is built by mtk__pairs_index. */
static mt_status mtk__pair_add(mt_tokenizer* tok, int32_t a, int32_t b, uint32_t rank, int32_t made, mt_error* err) {
    if (a > MTK__MAX_ID || b > MTK__MAX_ID || made > MTK__MAX_ID || rank > MTK__MAX_RANK)
        return mt_fail(err, MT_ERR_FORMAT, "merges of token ids above %d or more than %u merges are not supported", MTK__MAX_ID,
                       MTK__MAX_RANK + 1);
    if (tok->num_pairs == tok->pairs_cap) {
        uint32_t cap = tok->pairs_cap ? tok->pairs_cap * 2 : 65536;
        mtk__pair* np = (mtk__pair*)realloc(tok->pair_list, (size_t)cap * sizeof(mtk__pair));
        if (!np) return mt_fail(err, MT_ERR_OOM, "out of memory loading the merges");
        tok->pair_list = np;
        tok->pairs_cap = cap;
    }
    mtk__pair* p = &tok->pair_list[tok->num_pairs++];
    p->left = a;
    p->right = b;
    p->rank = rank;
    p->made = made;
    return MT_OK;
}

/* Turns the list of merges into the open-addressing table mtk__merge reads (load factor <= 1/2),
 * and rank -> made when a rank is not the id of the token it makes (Hugging Face merges). */
static mt_status mtk__pairs_index(mt_tokenizer* tok, mt_error* err) {
    uint32_t bits = 4, max_rank = 0;
    int by_id = 1;
    while (((uint64_t)1 << bits) < (uint64_t)tok->num_pairs * 2) bits++;
    size_t slots = (size_t)1 << bits;
    uint64_t* table = (uint64_t*)malloc(slots * sizeof(uint64_t));
    if (!table) return mt_fail(err, MT_ERR_OOM, "out of memory loading the merges");
    memset(table, 0xFF, slots * sizeof(uint64_t));
    uint64_t mask = slots - 1;
    for (uint32_t k = 0; k < tok->num_pairs; k++) {
        const mtk__pair* p = &tok->pair_list[k];
        uint64_t key = ((uint64_t)(uint32_t)p->right << MTK__ID_BITS) | (uint32_t)p->left;
        uint64_t i = mtk__pair_slot(key, bits);
        while (table[i] != MTK__PAIR_EMPTY && (table[i] & MTK__PAIR_KEY_MASK) != key) i = (i + 1) & mask;
        table[i] = ((uint64_t)p->rank << (2 * MTK__ID_BITS)) | key;
        if (p->rank > max_rank) max_rank = p->rank;
        by_id &= p->made == (int32_t)p->rank;
    }
    free(tok->pairs);
    tok->pairs = table;
    tok->pair_bits = bits;
    if (!by_id) {
        tok->rank_made = (int32_t*)malloc(((size_t)max_rank + 1) * sizeof(int32_t));
        if (!tok->rank_made) return mt_fail(err, MT_ERR_OOM, "out of memory loading the merges");
        for (uint32_t k = 0; k < tok->num_pairs; k++) tok->rank_made[tok->pair_list[k].rank] = tok->pair_list[k].made;
    }
    free(tok->pair_list);
    tok->pair_list = NULL;
    tok->pairs_cap = 0;
    return MT_OK;
}

/* tiktoken's merges from its ranks: every split of a token into two tokens merges to it, with the
 * token's rank, so the lowest-rank pair is the lowest-rank concatenation, as tiktoken merges. */
static mt_status mtk__pairs_from_ranks(mt_tokenizer* tok, mt_error* err) {
    mt_status st;
    uint64_t mask = ((uint64_t)1 << tok->slot_bits) - 1, h[64];
    for (uint32_t k = 0; k < tok->num_entries; k++) {
        const mtk__tok_entry* e = &tok->entries[k];
        if (!e->hashed || e->len < 2 || e->rank == MTK__NO_RANK) continue;
        const uint8_t* p = tok->blob + e->off;
        uint32_t cuts = e->len < 64 ? e->len : 64;
        for (uint32_t cut = 1; cut < cuts; cut++) { /* the prefixes' slots, fetched together (load time) */
            h[cut] = mtk__hash(p, cut);
#if defined(__GNUC__)
            __builtin_prefetch(&tok->slots[h[cut] & mask]);
#endif
        }
        for (uint32_t cut = 1; cut < e->len; cut++) {
            const mtk__tok_entry* a = cut < cuts ? mtk__find_hashed(tok, p, cut, h[cut]) : mtk__find(tok, p, cut);
            const mtk__tok_entry* b = a ? mtk__find(tok, p + cut, e->len - cut) : NULL;
            if (b && (st = mtk__pair_add(tok, a->id, b->id, e->rank, e->id, err))) return st;
        }
    }
    return mtk__pairs_index(tok, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* A.4 Byte-pair encoding of one piece                                                             */
/* ---------------------------------------------------------------------------------------------- */

#define MTK__BPE_SMALL 128 /* pieces up to this many bytes: the quadratic scan on the stack */

/* The piece's first symbols, as Hugging Face's BPE makes them (merge_word): each byte (byte-level)
 * or character that is a token; else, with byte_fallback, the <0xNN> tokens of its bytes; else the
 * unknown token (fuse_unk: one for a run of unknown characters); else nothing. Writes at most n
 * ids to sym; returns their count. */
static size_t mtk__symbols(const mt_tokenizer* tok, const uint8_t* p, size_t n, int32_t* sym) {
    size_t k = 0, i = 0;
    if (!tok->char_level) { /* the common case: every byte is a token */
        for (; i < n; i++) {
            int32_t id = tok->sym_id[p[i]];
            if (id < 0) break;
            sym[k++] = id;
        }
        if (i == n) return k;
    }
    int unk_pending = 0;
    while (i < n) {
        size_t l = tok->char_level ? mtk__utf8_len(p[i]) : 1;
        int32_t id = -1;
        if (l == 1) id = tok->sym_id[p[i]];
        else {
            const mtk__tok_entry* e = mtk__find(tok, p + i, l);
            if (e) id = e->id;
        }
        if (id >= 0) {
            if (unk_pending) { sym[k++] = tok->unk_id; unk_pending = 0; }
            sym[k++] = id;
        } else {
            size_t b = 0;
            if (tok->byte_fallback)
                while (b < l && tok->fallback_id[p[i + b]] >= 0) b++;
            if (tok->byte_fallback && b == l) {
                /* (a pending unknown token stays pending here, as in Hugging Face's merge_word) */
                for (b = 0; b < l; b++) sym[k++] = tok->fallback_id[p[i + b]];
            } else if (tok->unk_id >= 0) {
                if (unk_pending && !tok->fuse_unk) sym[k++] = tok->unk_id;
                unk_pending = 1;
            }
        }
        i += l;
    }
    if (unk_pending) sym[k++] = tok->unk_id;
    return k;
}

/* Merges sym[0..ns) (ns <= MTK__BPE_SMALL) in place: the lowest-rank adjacent pair first, the
 * leftmost of equal ranks; returns the number of symbols left. */
typedef struct {
    uint32_t rank;
    int32_t made;
} mtk__cand;
static size_t mtk__merge_small(const mt_tokenizer* tok, int32_t* sym, size_t ns) {
    mtk__cand cand[MTK__BPE_SMALL]; /* cand[k]: the pair (sym[k], sym[k + 1]) */
    if (ns < 2) return ns;
    for (size_t k = 0; k + 1 < ns; k++) cand[k].rank = mtk__merge(tok, sym[k], sym[k + 1], &cand[k].made);
    for (;;) {
        uint32_t best = MTK__NO_RANK;
        size_t b = 0;
        for (size_t k = 0; k + 1 < ns; k++)
            if (cand[k].rank < best) { best = cand[k].rank; b = k; }
        if (best == MTK__NO_RANK) break;
        sym[b] = cand[b].made;
        memmove(sym + b + 1, sym + b + 2, (ns - b - 2) * sizeof(int32_t));
        memmove(cand + b + 1, cand + b + 2, (ns - b - 2) * sizeof(mtk__cand));
        ns--;
        if (b > 0) cand[b - 1].rank = mtk__merge(tok, sym[b - 1], sym[b], &cand[b - 1].made);
        if (b + 1 < ns) cand[b].rank = mtk__merge(tok, sym[b], sym[b + 1], &cand[b].made);
    }
    return ns;
}

/* The same merges for long pieces (a run of spaces, a whole sentencepiece document) in
 * O(n log n), as Hugging Face's Word::merge_all does: symbols form a linked list, candidate pairs
 * sit in a min-heap ordered by (rank, position of the left symbol); an entry is stale when its
 * left symbol is gone or no longer makes that token with its right neighbour. */
typedef struct {
    uint32_t rank, pos;
    int32_t made;
} mtk__heap_item;

static inline int mtk__heap_less(const mtk__heap_item* a, const mtk__heap_item* b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}
static void mtk__heap_push(mtk__heap_item* h, size_t* n, mtk__heap_item it) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!mtk__heap_less(&it, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = it;
}
static mtk__heap_item mtk__heap_pop(mtk__heap_item* h, size_t* n) {
    mtk__heap_item top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && mtk__heap_less(&h[c + 1], &h[c])) c++;
        if (!mtk__heap_less(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) h[i] = last;
    return top;
}

/* Returns the number of symbols left in sym, (size_t)-1 when memory runs out, or (size_t)-2 when
 * *cancel was set (checked every 2^16 steps: a piece can be a whole long document). */
static size_t mtk__merge_large(const mt_tokenizer* tok, int32_t* sym, size_t ns, const volatile sig_atomic_t* cancel) {
    if (ns < 2) return ns;
    /* next[k] / prev[k]: the neighbours of symbol k (ns / (uint32_t)-1 at the ends). Every merge
     * leaves at most two new pairs, so the heap never holds more than 3 * ns entries. */
    uint32_t* next = (uint32_t*)malloc(ns * 2 * sizeof(uint32_t));
    mtk__heap_item* heap = (mtk__heap_item*)malloc(3 * ns * sizeof(mtk__heap_item));
    uint8_t* alive = (uint8_t*)malloc(ns);
    if (!next || !heap || !alive) { free(next); free(heap); free(alive); return (size_t)-1; }
    uint32_t* prev = next + ns;
    size_t hn = 0;
    for (size_t k = 0; k < ns; k++) { next[k] = (uint32_t)(k + 1); prev[k] = (uint32_t)(k - 1); alive[k] = 1; }
    size_t steps = 0;
    for (size_t k = 0; k + 1 < ns; k++) {
        if ((++steps & 0xFFFF) == 0 && mtk__cancelled(cancel)) {
            free(next);
            free(heap);
            free(alive);
            return (size_t)-2;
        }
        mtk__heap_item it = {0, (uint32_t)k, 0};
        it.rank = mtk__merge(tok, sym[k], sym[k + 1], &it.made);
        if (it.rank != MTK__NO_RANK) mtk__heap_push(heap, &hn, it);
    }
    while (hn > 0) {
        if ((++steps & 0xFFFF) == 0 && mtk__cancelled(cancel)) {
            free(next);
            free(heap);
            free(alive);
            return (size_t)-2;
        }
        mtk__heap_item it = mtk__heap_pop(heap, &hn);
        uint32_t a = it.pos, b;
        int32_t made;
        if (!alive[a] || (b = next[a]) >= ns) continue;
        if (mtk__merge(tok, sym[a], sym[b], &made) == MTK__NO_RANK || made != it.made) continue; /* stale */
        sym[a] = made;
        alive[b] = 0;
        next[a] = next[b];
        if (next[b] < ns) prev[next[b]] = a;
        if (a > 0 && prev[a] != (uint32_t)-1) { /* the new pair with the left neighbour */
            mtk__heap_item ni = {0, prev[a], 0};
            ni.rank = mtk__merge(tok, sym[prev[a]], sym[a], &ni.made);
            if (ni.rank != MTK__NO_RANK) mtk__heap_push(heap, &hn, ni);
        }
        if (next[a] < ns) { /* the new pair with the right neighbour */
            mtk__heap_item ni = {0, a, 0};
            ni.rank = mtk__merge(tok, sym[a], sym[next[a]], &ni.made);
            if (ni.rank != MTK__NO_RANK) mtk__heap_push(heap, &hn, ni);
        }
    }
    size_t k = 0;
    for (uint32_t s = 0; s < ns; s = next[s]) sym[k++] = sym[s];
    free(next);
    free(heap);
    free(alive);
    return k;
}

/* Appends the tokens of one piece p[0..n) to out (room for n more): the piece itself when it is a
 * token that may stand for itself, else its symbols merged. Returns 0, -1 when out of memory, or -2
 * when *cancel (may be NULL) was set. */
static int mtk__bpe(const mt_tokenizer* tok, const uint8_t* p, size_t n, int32_t* out, size_t* count,
                    const volatile sig_atomic_t* cancel) {
    if (n == 1 && tok->sym_id[p[0]] >= 0) { /* a single byte (or ASCII character) that is a token */
        out[(*count)++] = tok->sym_id[p[0]];
        return 0;
    }
    if (n <= tok->max_token_len) {
        const mtk__tok_entry* e = mtk__find(tok, p, n);
        if (e && (tok->shortcut_all || e->shortcut)) { out[(*count)++] = e->id; return 0; }
    }
    int32_t* sym = out + *count; /* out has room for n, and a piece has at most n symbols */
    size_t ns = mtk__symbols(tok, p, n, sym);
    ns = ns <= MTK__BPE_SMALL ? mtk__merge_small(tok, sym, ns) : mtk__merge_large(tok, sym, ns, cancel);
    if (ns == (size_t)-1) return -1;
    if (ns == (size_t)-2) return -2;
    *count += ns;
    return 0;
}

/* Without ignore_merges (Hugging Face) a piece that is a token still goes through the merges, which
 * may end elsewhere; the shortcut is taken only for tokens whose own bytes merge back to them. */
static mt_status mtk__mark_shortcuts(mt_tokenizer* tok, mt_error* err) {
    int32_t* out = (int32_t*)malloc((tok->max_token_len + 1) * sizeof(int32_t));
    if (!out) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
    int saved = tok->shortcut_all;
    tok->shortcut_all = 0;
    for (uint32_t k = 0; k < tok->num_entries; k++) tok->entries[k].shortcut = 0;
    for (uint32_t k = 0; k < tok->num_entries; k++) {
        mtk__tok_entry* e = &tok->entries[k];
        if (!e->hashed) continue;
        size_t c = 0;
        if (mtk__bpe(tok, tok->blob + e->off, e->len, out, &c, NULL) != 0) { free(out); return mt_fail(err, MT_ERR_OOM, "out of memory"); }
        e->shortcut = (uint8_t)(c == 1 && out[0] == e->id);
    }
    tok->shortcut_all = saved;
    free(out);
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.5 Encoding: normalizers, added tokens, pre-tokenizers, template; the public calls             */
/* ---------------------------------------------------------------------------------------------- */

/* ---- NFC (tokenizer.json's "NFC" normalizer): decompose, order the marks, compose ---- */

/* The position of cp in the sorted table a[0..n), or n. */
static size_t mtk__table_find(const uint32_t* a, size_t n, uint32_t cp) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a[mid] < cp) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && a[lo] == cp ? lo : n;
}

static int mtk__ccc(uint32_t cp) {
    size_t k = cp < 0x300 ? MT_UC_NUM_CCC : mtk__table_find(mt_uc_ccc_cp, MT_UC_NUM_CCC, cp);
    return k < MT_UC_NUM_CCC ? mt_uc_ccc_val[k] : 0;
}

#define MTK__HANGUL_S 0xAC00u
#define MTK__HANGUL_L 0x1100u
#define MTK__HANGUL_V 0x1161u
#define MTK__HANGUL_T 0x11A7u
#define MTK__HANGUL_N 588u   /* V count * T count */
#define MTK__HANGUL_TC 28u
#define MTK__HANGUL_SC 11172u

/* Writes the full canonical decomposition of cp to out (room for 4); returns its length. */
static size_t mtk__decompose(uint32_t cp, uint32_t* out) {
    if (cp - MTK__HANGUL_S < MTK__HANGUL_SC) {
        uint32_t k = cp - MTK__HANGUL_S;
        out[0] = MTK__HANGUL_L + k / MTK__HANGUL_N;
        out[1] = MTK__HANGUL_V + (k % MTK__HANGUL_N) / MTK__HANGUL_TC;
        if (k % MTK__HANGUL_TC) { out[2] = MTK__HANGUL_T + k % MTK__HANGUL_TC; return 3; }
        return 2;
    }
    size_t k = cp < 0xC0 ? MT_UC_NUM_DECOMP : mtk__table_find(mt_uc_decomp_cp, MT_UC_NUM_DECOMP, cp);
    if (k < MT_UC_NUM_DECOMP) {
        size_t n = (size_t)(mt_uc_decomp_off[k + 1] - mt_uc_decomp_off[k]);
        memcpy(out, mt_uc_decomp_seq + mt_uc_decomp_off[k], n * sizeof(uint32_t));
        return n;
    }
    out[0] = cp;
    return 1;
}

/* The primary composite of (a, b), or 0. */
static uint32_t mtk__compose(uint32_t a, uint32_t b) {
    if (a - MTK__HANGUL_L < 19u && b - MTK__HANGUL_V < 21u)
        return MTK__HANGUL_S + ((a - MTK__HANGUL_L) * 21u + (b - MTK__HANGUL_V)) * MTK__HANGUL_TC;
    if (a - MTK__HANGUL_S < MTK__HANGUL_SC && (a - MTK__HANGUL_S) % MTK__HANGUL_TC == 0 && b - MTK__HANGUL_T - 1 < 27u)
        return a + (b - MTK__HANGUL_T);
    uint64_t key = ((uint64_t)a << 21) | b;
    size_t lo = 0, hi = MT_UC_NUM_COMP;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (mt_uc_comp_key[mid] < key) lo = mid + 1;
        else hi = mid;
    }
    return lo < MT_UC_NUM_COMP && mt_uc_comp_key[lo] == key ? mt_uc_comp_val[lo] : 0;
}

/* NFC of s[0..n) into out. Returns 0 when the text is already NFC (out untouched: no character in
 * it may change), 1 when out holds the result, -1 when out of memory. */
static int mtk__nfc(const uint8_t* s, size_t n, mtk__buf* out) {
    size_t i = 0, l;
    while (i < n) {
        if (s[i] < 0xCC) { i += mtk__utf8_len(s[i]); continue; } /* below U+0300: never changes */
        if (mt_uc_nfc_maybe(mtk__utf8_get(s, i, &l))) break;
        i += l;
    }
    if (i >= n) return 0;
    /* Decompose every character, then put each run of marks in canonical order (a stable insertion
     * sort by combining class), then compose: a character joins the last starter unless a
     * character between them has class 0 or a class not below its own. */
    uint32_t* cp = (uint32_t*)malloc((4 * n + 4) * sizeof(uint32_t));
    uint8_t* cc = (uint8_t*)malloc(4 * n + 4);
    if (!cp || !cc) { free(cp); free(cc); return -1; }
    size_t m = 0;
    for (i = 0; i < n; i += l) m += mtk__decompose(mtk__utf8_get(s, i, &l), cp + m);
    for (size_t k = 0; k < m; k++) {
        cc[k] = (uint8_t)mtk__ccc(cp[k]);
        for (size_t j = k; j > 0 && cc[j] && cc[j - 1] > cc[j]; j--) {
            uint32_t t = cp[j]; cp[j] = cp[j - 1]; cp[j - 1] = t;
            uint8_t u = cc[j]; cc[j] = cc[j - 1]; cc[j - 1] = u;
        }
    }
    size_t o = 0;
    long starter = -1;
    int last = 0;
    for (size_t k = 0; k < m; k++) {
        int c = cc[k];
        if (starter >= 0 && ((long)o - 1 == starter || (last != 0 && last < c))) {
            uint32_t comp = mtk__compose(cp[starter], cp[k]);
            if (comp) { cp[starter] = comp; continue; }
        }
        if (c == 0) starter = (long)o;
        last = c;
        cp[o++] = cp[k];
    }
    out->len = 0;
    if (mtk__buf_reserve(out, 4 * o + 1)) { free(cp); free(cc); return -1; }
    for (size_t k = 0; k < o; k++) out->len += mtk__utf8_put(out->p + out->len, cp[k]);
    free(cp);
    free(cc);
    return 1;
}

/* ---- added tokens: leftmost-longest matching ---- */

/* The next match at or after `from`: the leftmost position where an added token of the set
 * starts, the longest one there. Returns its index into tok->added, or -1. */
static int mtk__added_find(const mt_tokenizer* tok, const mtk__added_set* set, const uint8_t* s, size_t n, size_t from,
                           size_t* start, size_t* end) {
    uint64_t mask = ((uint64_t)1 << set->bits) - 1;
    for (size_t i = from; i < n; i++) {
        if (set->one_first >= 0) { /* every token starts with the same byte (usually '<') */
            const uint8_t* q = (const uint8_t*)memchr(s + i, set->one_first, n - i);
            if (!q) return -1;
            i = (size_t)(q - s);
        } else if (!(set->first[s[i] >> 3] & (1u << (s[i] & 7)))) {
            continue;
        }
        for (int k = 0; k < set->num_lens; k++) {
            size_t len = set->lens[k];
            if (len > n - i) continue;
            uint64_t h = mtk__hash(s + i, len);
            for (uint64_t j = h & mask; set->slots[j]; j = (j + 1) & mask) {
                const mtk__added* a = &tok->added[set->slots[j] - 1];
                if (a->mlen == len && mtk__equal(tok->blob + a->moff, s + i, len)) {
                    *start = i;
                    *end = i + len;
                    return (int)(set->slots[j] - 1);
                }
            }
        }
    }
    return -1;
}

/* Builds a set over the added tokens with normalized == want_normalized. */
static mt_status mtk__added_set_build(mt_tokenizer* tok, mtk__added_set* set, int want_normalized, mt_error* err) {
    int count = 0;
    for (int k = 0; k < tok->num_added; k++)
        if (tok->added[k].normalized == want_normalized && tok->added[k].mlen > 0) count++;
    set->count = count;
    set->one_first = -2; /* none seen yet */
    if (!count) return MT_OK;
    uint32_t bits = 4;
    while (((uint64_t)1 << bits) < (uint64_t)count * 2) bits++;
    set->bits = bits;
    set->slots = (uint32_t*)calloc((size_t)1 << bits, sizeof(uint32_t));
    set->lens = (uint32_t*)malloc((size_t)count * sizeof(uint32_t));
    if (!set->slots || !set->lens) return mt_fail(err, MT_ERR_OOM, "out of memory loading the added tokens");
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    for (int k = 0; k < tok->num_added; k++) {
        const mtk__added* a = &tok->added[k];
        if (a->normalized != want_normalized || a->mlen == 0) continue;
        const uint8_t* p = tok->blob + a->moff;
        uint64_t j = mtk__hash(p, a->mlen) & mask;
        int dup = 0;
        for (; set->slots[j]; j = (j + 1) & mask) {
            const mtk__added* b = &tok->added[set->slots[j] - 1];
            if (b->mlen == a->mlen && mtk__equal(tok->blob + b->moff, p, a->mlen)) dup = 1;
        }
        if (dup) continue; /* the same text twice: the first one matches */
        set->slots[j] = (uint32_t)k + 1;
        set->first[p[0] >> 3] |= (uint8_t)(1u << (p[0] & 7));
        set->one_first = set->one_first == -2 || set->one_first == p[0] ? p[0] : -1;
        int have = 0;
        for (int m = 0; m < set->num_lens; m++) have |= set->lens[m] == a->mlen;
        if (!have) {
            int m = set->num_lens++;
            while (m > 0 && set->lens[m - 1] < a->mlen) { set->lens[m] = set->lens[m - 1]; m--; }
            set->lens[m] = a->mlen;
        }
    }
    return MT_OK;
}

/* ---- the pipeline ---- */

typedef struct {
    const mt_tokenizer* tok;
    int32_t** tokens;
    size_t* cap;
    size_t c;          /* tokens used */
    mtk__buf norm[2];  /* normalizer steps write here, alternately */
    mtk__buf pre;      /* the pre-tokenizer's rewrite (prefix space, Metaspace) */
    const volatile sig_atomic_t* cancel; /* checked every 4096 pieces (and in long merges); may be NULL */
    size_t pieces;
} mtk__enc;

static int mtk__enc_grow(mtk__enc* e, size_t more) {
    size_t ncap = *e->cap ? *e->cap : 1024;
    while (ncap < e->c + more) ncap *= 2;
    int32_t* nt = (int32_t*)realloc(*e->tokens, ncap * sizeof(int32_t));
    if (!nt) return -1;
    *e->tokens = nt;
    *e->cap = ncap;
    return 0;
}

static inline int mtk__enc_reserve(mtk__enc* e, size_t more) { return e->c + more <= *e->cap ? 0 : mtk__enc_grow(e, more); }

static int mtk__enc_emit(mtk__enc* e, int32_t id) {
    if (mtk__enc_reserve(e, 1)) return -1;
    (*e->tokens)[e->c++] = id;
    return 0;
}

/* One piece's tokens appended: 0, -1 out of memory, -2 cancelled. */
static inline int mtk__enc_piece(mtk__enc* e, const uint8_t* p, size_t n) {
    if ((++e->pieces & 4095) == 0 && mtk__cancelled(e->cancel)) return -2;
    if (mtk__enc_reserve(e, n)) return -1;
    return mtk__bpe(e->tok, p, n, *e->tokens, &e->c, e->cancel);
}

/* Encodes each piece of s[0..n) as the pattern `kind` cuts it. Inlined into mtk__enc_pieces once
 * per pattern, so that each loop runs its own matcher. */
static inline int mtk__enc_split(mtk__enc* e, const uint8_t* s, size_t n, mtk__split_kind kind) {
    size_t i = 0;
    while (i < n) {
        size_t end = mtk__split(kind, s, n, i);
        if (end <= i) { /* no match (cannot happen with these patterns): the regex skips the text */
            i += mtk__utf8_len(s[i]);
            continue;
        }
        int r = mtk__enc_piece(e, s + i, end - i);
        if (r) return r;
        i = end;
    }
    return 0;
}

/* Splits s[0..n) with the pattern (or before each U+2581 for Metaspace split) and encodes each piece. */
static int mtk__enc_pieces(mtk__enc* e, const uint8_t* s, size_t n) {
    const mt_tokenizer* tok = e->tok;
    if (tok->meta_split) { /* Metaspace split: each U+2581 starts a piece (MergedWithNext) */
        const uint8_t* rep = tok->meta_rep;
        size_t rl = (size_t)tok->meta_rep_len;
        for (size_t i = 0, end; i < n; i = end) {
            end = i + 1;
            while (end < n && !(end + rl <= n && mtk__equal(s + end, rep, rl))) end++;
            int r = mtk__enc_piece(e, s + i, end - i);
            if (r) return r;
        }
        return 0;
    }
    switch (tok->split) {
        case MTK__SPLIT_NONE: return mtk__enc_split(e, s, n, MTK__SPLIT_NONE);
        case MTK__SPLIT_GPT2: return mtk__enc_split(e, s, n, MTK__SPLIT_GPT2);
        case MTK__SPLIT_CL100K: return mtk__enc_split(e, s, n, MTK__SPLIT_CL100K);
        case MTK__SPLIT_LLAMA3: return mtk__enc_split(e, s, n, MTK__SPLIT_LLAMA3);
        case MTK__SPLIT_QWEN2: return mtk__enc_split(e, s, n, MTK__SPLIT_QWEN2);
        case MTK__SPLIT_TIKTOKEN_V1: return mtk__enc_split(e, s, n, MTK__SPLIT_TIKTOKEN_V1);
        case MTK__SPLIT_O200K: return mtk__enc_split(e, s, n, MTK__SPLIT_O200K);
        case MTK__SPLIT_TIKTOKEN_V2: return mtk__enc_split(e, s, n, MTK__SPLIT_TIKTOKEN_V2);
    }
    return 0;
}

/* The pre-tokenizer's rewrite of one segment, then its pieces. first: the segment starts the text
 * (Metaspace's prepend_scheme "first"). */
static int mtk__enc_pretokenize(mtk__enc* e, const uint8_t* s, size_t n, int first) {
    const mt_tokenizer* tok = e->tok;
    if (tok->prefix_space && s[0] != ' ') { /* ByteLevel add_prefix_space */
        e->pre.len = 0;
        if (mtk__buf_put(&e->pre, " ", 1) || mtk__buf_put(&e->pre, s, n)) return -1;
        return mtk__enc_pieces(e, e->pre.p, e->pre.len);
    }
    if (tok->metaspace) { /* ' ' -> U+2581, then the prefix unless the text starts with one */
        const uint8_t* rep = tok->meta_rep;
        size_t rl = (size_t)tok->meta_rep_len;
        e->pre.len = 0;
        int starts = s[0] == ' ' || (n >= rl && mtk__equal(s, rep, rl)); /* after the replacement */
        if (!starts && (tok->meta_scheme == 2 || (tok->meta_scheme == 1 && first)) && mtk__buf_put(&e->pre, rep, rl)) return -1;
        for (size_t i = 0; i < n; i++) {
            if (s[i] == ' ') { if (mtk__buf_put(&e->pre, rep, rl)) return -1; }
            else if (mtk__buf_put(&e->pre, s + i, 1)) return -1;
        }
        return mtk__enc_pieces(e, e->pre.p, e->pre.len);
    }
    return mtk__enc_pieces(e, s, n);
}

/* Cuts the set's added tokens out of s[0..n) as Hugging Face's AddedVocabulary does, encoding the
 * gaps with `gap` (level 0: normalize them; level 1: pre-tokenize them). */
static int mtk__enc_segment(mtk__enc* e, const uint8_t* s, size_t n, int first);
static int mtk__enc_added(mtk__enc* e, const mtk__added_set* set, const uint8_t* s, size_t n, int first, int level) {
    const mt_tokenizer* tok = e->tok;
    size_t from = 0, done = 0, start, end;
    int k;
    while ((k = mtk__added_find(tok, set, s, n, from, &start, &end)) >= 0) {
        const mtk__added* a = &tok->added[k];
        from = end;
        if (start < done) start = done; /* (only an added token starting with a space after an rstrip one) */
        if (a->lstrip) { /* the whitespace before it is the token's */
            while (start > done) {
                size_t p = mtk__utf8_prev(s, start), l;
                if (!(mt_uc_flags(mtk__utf8_get(s, p, &l)) & MT_UC_S)) break;
                start = p;
            }
        }
        if (a->rstrip) { /* and the whitespace after it */
            size_t l;
            while (end < n && (mt_uc_flags(mtk__utf8_get(s, end, &l)) & MT_UC_S)) end += l;
        }
        if (start > done) {
            int r = level == 0 ? mtk__enc_segment(e, s + done, start - done, first && done == 0)
                               : mtk__enc_pretokenize(e, s + done, start - done, first && done == 0);
            if (r) return r;
        }
        if (mtk__enc_emit(e, a->id)) return -1;
        done = end;
    }
    if (done < n)
        return level == 0 ? mtk__enc_segment(e, s + done, n - done, first && done == 0)
                          : mtk__enc_pretokenize(e, s + done, n - done, first && done == 0);
    return 0;
}

/* Runs the normalizer's steps over s[0..n): *out / *out_len get the result (s itself when no step
 * changed it, else one of the two buffers). Returns 0, or -1 when out of memory. */
static int mtk__normalize(const mt_tokenizer* tok, const uint8_t* s, size_t n, mtk__buf bufs[2], const uint8_t** out_p,
                          size_t* out_len) {
    const uint8_t* t = s;
    size_t tn = n;
    for (int k = 0; k < tok->num_norm; k++) {
        const mtk__norm* st = &tok->norm[k];
        mtk__buf* out = t == bufs[0].p ? &bufs[1] : &bufs[0]; /* never write over the input */
        if (st->kind == MTK__NORM_NFC) {
            int r = mtk__nfc(t, tn, out);
            if (r < 0) return -1;
            if (r == 0) continue;
        } else if (st->kind == MTK__NORM_PREPEND) {
            if (tn == 0) continue;
            out->len = 0;
            if (mtk__buf_put(out, tok->blob + st->a_off, st->a_len) || mtk__buf_put(out, t, tn)) return -1;
        } else { /* REPLACE: every occurrence, left to right, not overlapping */
            const uint8_t* a = tok->blob + st->a_off;
            size_t al = st->a_len, i = 0, last = 0;
            int replaced = 0;
            out->len = 0;
            while (i + al <= tn) {
                if (t[i] == a[0] && mtk__equal(t + i, a, al)) {
                    if (mtk__buf_put(out, t + last, i - last) || mtk__buf_put(out, tok->blob + st->b_off, st->b_len)) return -1;
                    i += al;
                    last = i;
                    replaced = 1;
                } else {
                    i++;
                }
            }
            if (!replaced) continue;
            if (mtk__buf_put(out, t + last, tn - last)) return -1;
        }
        t = out->p;
        tn = out->len;
    }
    *out_p = t;
    *out_len = tn;
    return 0;
}

/* One segment between raw added tokens: normalized, its normalized added tokens cut out, pre-tokenized. */
static int mtk__enc_segment(mtk__enc* e, const uint8_t* s, size_t n, int first) {
    const mt_tokenizer* tok = e->tok;
    const uint8_t* t = s;
    size_t tn = n;
    if (tok->num_norm && mtk__normalize(tok, s, n, e->norm, &t, &tn)) return -1;
    if (tn == 0) return 0;
    if (tok->norm_set.count) return mtk__enc_added(e, &tok->norm_set, t, tn, first, 1);
    return mtk__enc_pretokenize(e, t, tn, first);
}

/* mt_tokenizer_encode, which returns -2 once *cancel (may be NULL) is set. */
static int64_t mtk__encode(const mt_tokenizer* tok, const char* text, size_t len, int32_t** tokens, size_t* count, size_t* cap,
                           const volatile sig_atomic_t* cancel) {
    const uint8_t* s = (const uint8_t*)text;
    uint8_t* clean = NULL;
    size_t first = *count;
    if (len > 0) {
        size_t bad = mtk__utf8_first_invalid(s, len);
        if (bad < len) {
            clean = mtk__utf8_replace(s, len, bad, &len);
            if (!clean) return -1;
            s = clean;
        }
    }
    mtk__enc e;
    memset(&e, 0, sizeof(e));
    e.tok = tok;
    e.tokens = tokens;
    e.cap = cap;
    e.c = *count;
    e.cancel = cancel;
    /* A piece of n bytes gives at most n tokens: room is made before each piece. English averages
     * ~4 bytes per token, so start with len/4. */
    int r = mtk__enc_reserve(&e, len / 4 + 16 + (size_t)tok->num_prefix + (size_t)tok->num_suffix);
    for (int k = 0; k < tok->num_prefix && !r; k++) r = mtk__enc_emit(&e, tok->templ[k]);
    if (!r && len > 0) r = tok->raw_set.count ? mtk__enc_added(&e, &tok->raw_set, s, len, 1, 0) : mtk__enc_segment(&e, s, len, 1);
    for (int k = 0; k < tok->num_suffix && !r; k++) r = mtk__enc_emit(&e, tok->templ[tok->num_prefix + k]);
    free(clean);
    free(e.norm[0].p);
    free(e.norm[1].p);
    free(e.pre.p);
    *count = e.c;
    return r ? (r == -2 ? -2 : -1) : (int64_t)(e.c - first);
}

int64_t mt_tokenizer_encode(const mt_tokenizer* tok, const char* text, size_t len, int32_t** tokens, size_t* count, size_t* cap) {
    return mtk__encode(tok, text, len, tokens, count, cap, NULL);
}

size_t mt_tokenizer_token_bytes(const mt_tokenizer* tok, int32_t id, const char** bytes) {
    if (id < 0 || id >= tok->n_vocab || tok->id_span[id].len == 0) return 0;
    *bytes = (const char*)tok->blob + tok->id_span[id].off;
    return tok->id_span[id].len;
}

int32_t mt_tokenizer_token_id(const mt_tokenizer* tok, const char* bytes, size_t len) {
    for (int k = 0; k < tok->num_added; k++) {
        const mtk__added* a = &tok->added[k];
        if (a->len == len && memcmp(tok->blob + a->off, bytes, len) == 0) return a->id;
    }
    const mtk__tok_entry* e = len ? mtk__find(tok, (const uint8_t*)bytes, len) : NULL;
    return e ? e->id : -1;
}

/* The bytes token ids[k] contributes to a decoded text: its own, except that a Metaspace decoder
 * drops the U+2581s of the first token (copied into tmp). */
static size_t mtk__decode_piece(const mt_tokenizer* tok, const int32_t* ids, size_t k, const uint8_t** p, uint8_t* tmp) {
    mtk__span sp = tok->id_span[ids[k]];
    *p = tok->blob + sp.off;
    if (k != 0 || !tok->dec_first_drop_rep || tok->id_entry[ids[0]] < 0) return sp.len;
    const mtk__tok_entry* en = &tok->entries[tok->id_entry[ids[0]]];
    const uint8_t* src = tok->blob + en->off;
    size_t o = 0, rl = (size_t)tok->meta_rep_len;
    for (size_t i = 0; i < en->len;) {
        if (i + rl <= en->len && mtk__equal(src + i, tok->meta_rep, rl)) { i += rl; continue; }
        tmp[o++] = src[i++];
    }
    *p = tmp;
    return o;
}

mt_status mt_tokenizer_decode(const mt_tokenizer* tok, const int32_t* ids, size_t n, char** out, size_t* out_len, mt_error* err) {
    size_t total = 0;
    for (size_t k = 0; k < n; k++) {
        if (ids[k] < 0 || ids[k] >= tok->n_vocab || !tok->id_present[ids[k]]) /* a token may decode to nothing */
            return mt_fail(err, MT_ERR_RANGE, "token id %d at position %zu is not in the vocabulary", ids[k], k);
        total += tok->id_span[ids[k]].len;
    }
    char* buf = (char*)malloc(total + 1);
    uint8_t* tmp = (uint8_t*)malloc(n && tok->id_entry[ids[0]] >= 0 ? tok->entries[tok->id_entry[ids[0]]].len + 1u : 1u);
    if (!buf || !tmp) { free(buf); free(tmp); return mt_fail(err, MT_ERR_OOM, "out of memory decoding %zu tokens", n); }
    size_t o = 0;
    for (size_t k = 0; k < n; k++) {
        const uint8_t* p;
        size_t l = mtk__decode_piece(tok, ids, k, &p, tmp);
        memcpy(buf + o, p, l);
        o += l;
    }
    free(tmp);
    size_t strip = 0;
    while (strip < (size_t)tok->dec_strip && strip < o && buf[strip] == ' ') strip++;
    memmove(buf, buf + strip, o - strip);
    o -= strip;
    buf[o] = 0;
    *out = buf;
    if (out_len) *out_len = o;
    return MT_OK;
}

mt_tokenizer_kind mt_tokenizer_get_kind(const mt_tokenizer* tok) { return tok->kind; }
int64_t mt_tokenizer_vocab_size(const mt_tokenizer* tok) { return tok->n_vocab; }
int32_t mt_tokenizer_eod(const mt_tokenizer* tok) { return tok->eod; }
int32_t mt_tokenizer_bos(const mt_tokenizer* tok) { return tok->bos; }

const char* mt_tokenizer_kind_name(mt_tokenizer_kind kind) {
    switch (kind) {
        case MT_TOKENIZER_GPT2: return "gpt2";
        case MT_TOKENIZER_CL100K: return "cl100k_base";
        case MT_TOKENIZER_O200K: return "o200k_base";
        case MT_TOKENIZER_LLAMA3: return "llama3";
        case MT_TOKENIZER_HUGGINGFACE: return "huggingface";
        case MT_TOKENIZER_TIKTOKENIZER: return "tiktokenizer";
    }
    return "unknown";
}

mt_status mt_tokenizer_kind_from_name(const char* name, mt_tokenizer_kind* out, mt_error* err) {
    if (!strcmp(name, "r50k_base") || !strcmp(name, "gpt2")) *out = MT_TOKENIZER_GPT2;
    else if (!strcmp(name, "cl100k_base")) *out = MT_TOKENIZER_CL100K;
    else if (!strcmp(name, "o200k_base")) *out = MT_TOKENIZER_O200K;
    else if (!strcmp(name, "llama3")) *out = MT_TOKENIZER_LLAMA3;
    else return mt_fail(err, MT_ERR_ARG, "unknown tiktoken encoding '%s' (r50k_base, cl100k_base, o200k_base, llama3)", name);
    return MT_OK;
}

int mt_tokenizer_kind_from_path(const char* path, mt_tokenizer_kind* out) {
    const char* base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (strstr(base, "cl100k")) *out = MT_TOKENIZER_CL100K;
    else if (strstr(base, "o200k")) *out = MT_TOKENIZER_O200K;
    else if (strstr(base, "r50k") || strstr(base, "gpt2") || strstr(base, "gpt-2")) *out = MT_TOKENIZER_GPT2;
    else if (strstr(base, "llama") || strstr(base, "Llama") || !strcmp(base, "tokenizer.model")) *out = MT_TOKENIZER_LLAMA3;
    else return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.6 Loading: the parts every loader shares                                                      */
/* ---------------------------------------------------------------------------------------------- */

/* GPT-2's bytes_to_unicode(): printable bytes stand for themselves, the other 68 bytes for
 * U+0100.. in byte order. Returns the byte of a code point, or -1. */
static int mtk__gpt2_unbyte(uint32_t cp) {
    if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || (cp >= 0xAE && cp <= 0xFF)) return (int)cp;
    if (cp < 0x100 || cp >= 0x100 + 68) return -1;
    int k = (int)(cp - 0x100);
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
        if (!printable && k-- == 0) return b;
    }
    return -1;
}

/* Maps a token written in GPT-2's byte alphabet (UTF-8) back to its bytes; returns the length, or
 * -1 when a character is not in the alphabet. out has room for n bytes. */
static long mtk__gpt2_token_bytes(const uint8_t* s, size_t n, uint8_t* out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t bad = 0, k = s[i] < 0x80 ? 1 : mtk__utf8_valid_seq(s + i, n - i, &bad);
        if (!k || k > 2) return -1;
        uint32_t cp = k == 1 ? s[i] : ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3Fu);
        int b = mtk__gpt2_unbyte(cp);
        if (b < 0) return -1;
        out[o++] = (uint8_t)b;
        i += k;
    }
    return (long)o;
}

/* The bytes BPE works on for a vocabulary string: byte-level vocabularies write bytes in GPT-2's
 * alphabet; others are their own UTF-8. Returns the length (in out, room for n), or -1 for a
 * byte-level string outside the alphabet (a token the byte-level model cannot produce). */
static long mtk__vocab_bytes(const mt_tokenizer* tok, const char* s, size_t n, uint8_t* out) {
    if (tok->char_level) {
        memcpy(out, s, n);
        return (long)n;
    }
    return mtk__gpt2_token_bytes((const uint8_t*)s, n, out);
}

/* Adds an added token; match: cut it out of texts (0 for tiktoken's encode_ordinary specials). */
static mt_status mtk__added_add(mt_tokenizer* tok, const char* content, size_t len, int64_t id, int match, int normalized,
                                int lstrip, int rstrip, int special, mt_error* err) {
    if (id < 0 || id > 0x7FFFFFFE) return mt_fail(err, MT_ERR_FORMAT, "added token '%.60s' has id %lld", content, (long long)id);
    if (len == 0 || len > 0xFFFF) return mt_fail(err, MT_ERR_FORMAT, "added token %lld has %zu bytes", (long long)id, len);
    if (tok->num_added == tok->added_cap) {
        int cap = tok->added_cap ? tok->added_cap * 2 : 64;
        mtk__added* na = (mtk__added*)realloc(tok->added, (size_t)cap * sizeof(mtk__added));
        if (!na) return mt_fail(err, MT_ERR_OOM, "out of memory loading the added tokens");
        tok->added = na;
        tok->added_cap = cap;
    }
    mtk__added* a = &tok->added[tok->num_added];
    memset(a, 0, sizeof(*a));
    mt_status st = mtk__blob_put(tok, (const uint8_t*)content, len, &a->off, err);
    if (st) return st;
    a->len = (uint32_t)len;
    a->id = (int32_t)id;
    a->normalized = (uint8_t)(normalized != 0);
    a->lstrip = (uint8_t)(lstrip != 0);
    a->rstrip = (uint8_t)(rstrip != 0);
    a->special = (uint8_t)(special != 0);
    if (match) { a->moff = a->off; a->mlen = a->len; }
    tok->num_added++;
    return MT_OK;
}

/* A normalized added token is matched in normalized text, so its own text is normalized first (as
 * Hugging Face's AddedVocabulary does). Runs once the normalizer is known. */
static mt_status mtk__added_normalize(mt_tokenizer* tok, mt_error* err) {
    mtk__buf bufs[2];
    memset(bufs, 0, sizeof(bufs));
    mt_status st = MT_OK;
    for (int k = 0; k < tok->num_added && st == MT_OK; k++) {
        mtk__added* a = &tok->added[k];
        if (!a->normalized || !a->mlen || !tok->num_norm) continue;
        const uint8_t* t;
        size_t tn;
        uint8_t* copy = (uint8_t*)malloc(a->len);
        if (!copy) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); break; }
        memcpy(copy, tok->blob + a->off, a->len); /* the blob may move below */
        if (mtk__normalize(tok, copy, a->len, bufs, &t, &tn)) st = mt_fail(err, MT_ERR_OOM, "out of memory");
        else if (tn == 0) a->mlen = 0;
        else if ((st = mtk__blob_put(tok, t, tn, &a->moff, err)) == MT_OK) a->mlen = (uint32_t)tn;
        free(copy);
    }
    free(bufs[0].p);
    free(bufs[1].p);
    return st;
}

/* Parses "<0xNN>" (either case of hex digits): the byte, or -1. */
static int mtk__byte_token(const uint8_t* s, size_t n) {
    if (n != 6 || s[0] != '<' || s[1] != '0' || s[2] != 'x' || s[5] != '>') return -1;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        int c = s[k], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* What a vocabulary token decodes to: its bytes, through the decoder's per-token rules (<0xNN> to
 * the byte, the Replace decoder's pattern to its replacement). */
static mt_status mtk__decoded_span(mt_tokenizer* tok, const mtk__tok_entry* e, mtk__span* span, mt_error* err) {
    const uint8_t* p = tok->blob + e->off;
    span->off = e->off;
    span->len = e->len;
    int b = tok->dec_byte_fallback ? mtk__byte_token(p, e->len) : -1;
    if (b >= 0) {
        uint8_t byte = (uint8_t)b;
        return mtk__blob_put(tok, &byte, 1, &span->off, err) ? MT_ERR_OOM : (span->len = 1, MT_OK);
    }
    size_t rl = (size_t)tok->dec_rep_len, hits = 0;
    for (size_t i = 0; rl && i + rl <= e->len; i++) hits += mtk__equal(p + i, tok->dec_rep, rl);
    if (!hits) return MT_OK;
    uint8_t* tmp = (uint8_t*)malloc(e->len * 4 + 4);
    if (!tmp) return mt_fail(err, MT_ERR_OOM, "out of memory");
    size_t o = 0;
    for (size_t i = 0; i < e->len;) {
        if (i + rl <= e->len && mtk__equal(p + i, tok->dec_rep, rl)) {
            memcpy(tmp + o, tok->dec_rep_to, (size_t)tok->dec_rep_to_len);
            o += (size_t)tok->dec_rep_to_len;
            i += rl;
        } else {
            tmp[o++] = p[i++];
        }
    }
    mt_status st = mtk__blob_put(tok, tmp, o, &span->off, err);
    span->len = (uint32_t)o;
    free(tmp);
    return st;
}

/* After the vocabulary, merges, added tokens and the rest were read: the tables the encoder and
 * decoder use. The bytes table must be built (mtk__tok_index) and the merges indexed. */
static mt_status mtk__tok_finish(mt_tokenizer* tok, const char* path, mt_error* err) {
    mt_status st;
    for (int b = 0; b < 256; b++) { /* the first symbols: single bytes, or ASCII characters */
        uint8_t byte = (uint8_t)b;
        const mtk__tok_entry* e = (!tok->char_level || b < 0x80) ? mtk__find(tok, &byte, 1) : NULL;
        tok->sym_id[b] = e ? e->id : -1;
    }
    if (tok->byte_fallback)
        for (int b = 0; b < 256; b++) {
            char name[8];
            snprintf(name, sizeof(name), "<0x%02X>", b);
            const mtk__tok_entry* e = mtk__find(tok, (const uint8_t*)name, 6);
            tok->fallback_id[b] = e ? e->id : -1;
        }
    if (!tok->shortcut_all && (st = mtk__mark_shortcuts(tok, err))) return st;
    if ((st = mtk__added_normalize(tok, err))) return st;
    int64_t max_id = -1;
    for (uint32_t k = 0; k < tok->num_entries; k++)
        if (tok->entries[k].id > max_id) max_id = tok->entries[k].id;
    for (int k = 0; k < tok->num_added; k++)
        if (tok->added[k].id > max_id) max_id = tok->added[k].id;
    if (max_id < 0) return mt_fail(err, MT_ERR_FORMAT, "%s: no tokens", path);
    /* the id tables are sized by the largest id: a vocabulary is dense up to small gaps (tiktoken's
     * specials), so ids far beyond the token count are refused before they size an allocation */
    const int64_t tokens = (int64_t)tok->num_entries + tok->num_added;
    if (max_id >= 2 * tokens + 1024)
        return mt_fail(err, MT_ERR_FORMAT, "%s: token id %lld among only %lld tokens: ids this sparse are not a "
                       "vocabulary (the largest id must be below 2 x tokens + 1024)", path, (long long)max_id,
                       (long long)tokens);
    tok->n_vocab = max_id + 1;
    tok->id_entry = (int32_t*)malloc((size_t)tok->n_vocab * sizeof(int32_t));
    tok->id_span = (mtk__span*)calloc((size_t)tok->n_vocab, sizeof(mtk__span));
    tok->id_present = (uint8_t*)calloc((size_t)tok->n_vocab, 1);
    if (!tok->id_entry || !tok->id_span || !tok->id_present)
        return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
    memset(tok->id_entry, 0xFF, (size_t)tok->n_vocab * sizeof(int32_t));
    for (uint32_t k = 0; k < tok->num_entries; k++) {
        int32_t id = tok->entries[k].id;
        if (tok->id_entry[id] >= 0) return mt_fail(err, MT_ERR_FORMAT, "%s: token id %d appears twice", path, id);
        tok->id_entry[id] = (int32_t)k;
        tok->id_present[id] = 1;
        if ((st = mtk__decoded_span(tok, &tok->entries[k], &tok->id_span[id], err))) return st;
    }
    for (int k = 0; k < tok->num_added; k++) { /* an added token decodes to its text */
        const mtk__added* a = &tok->added[k];
        tok->id_span[a->id].off = a->off;
        tok->id_span[a->id].len = a->len;
        tok->id_present[a->id] = 1;
    }
    for (int32_t k = 0; k < tok->num_prefix + tok->num_suffix; k++)
        if (tok->templ[k] < 0 || tok->templ[k] >= tok->n_vocab || !tok->id_present[tok->templ[k]])
            return mt_fail(err, MT_ERR_FORMAT, "%s: the post-processor adds token id %d, which the vocabulary does not have", path,
                           tok->templ[k]);
    if ((st = mtk__added_set_build(tok, &tok->raw_set, 0, err))) return st;
    return mtk__added_set_build(tok, &tok->norm_set, 1, err);
}

/* ---------------------------------------------------------------------------------------------- */
/* A.7 GPT2BPETokenizer: GPT-2's encoder.json + vocab.bpe                                         */
/* ---------------------------------------------------------------------------------------------- */

mt_status mt_tokenizer_load_gpt2(mt_tokenizer** out, const char* vocab_json_path, const char* merges_path, mt_error* err) {
    mt_json* vocab = NULL;
    uint8_t *mg = NULL, *tmp = NULL;
    size_t mlen = 0;
    int64_t line = 0, merge = 0, eot = -1;
    mt_status st;
    *out = NULL;
    mt_tokenizer* tok = mtk__tok_new(MT_TOKENIZER_GPT2);
    if (!tok) return mt_fail(err, MT_ERR_OOM, "out of memory");
    tok->split = MTK__SPLIT_GPT2; /* byte-level, merges by rank, no ignore_merges, <|endoftext|> an added token */
    if ((st = mt_json_parse_file(&vocab, vocab_json_path, err))) goto done;
    if ((st = mtk__read_file(merges_path, &mg, &mlen, err))) goto done;
    if (vocab->type != MT_JSON_OBJECT) { st = mt_fail(err, MT_ERR_FORMAT, "%s: not a JSON object", vocab_json_path); goto done; }
    tmp = (uint8_t*)malloc(mlen + 64 * 1024);
    if (!tmp) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); goto done; }
    for (int k = 0; k < vocab->count; k++) { /* encoder.json: {"token": id, ...} */
        const mt_json* v = &vocab->items[k];
        size_t kl = strlen(vocab->keys[k]);
        if (v->type != MT_JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer > 0x7FFFFFFE) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: the id of token '%.60s' is not a token id", vocab_json_path, vocab->keys[k]);
            goto done;
        }
        if (kl > 64 * 1024) { st = mt_fail(err, MT_ERR_FORMAT, "%s: token %lld is too long", vocab_json_path, (long long)v->integer); goto done; }
        long nb = mtk__gpt2_token_bytes((const uint8_t*)vocab->keys[k], kl, tmp);
        if (nb <= 0) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: token '%.60s' is not in GPT-2's byte alphabet", vocab_json_path, vocab->keys[k]);
            goto done;
        }
        if ((st = mtk__tok_add(tok, tmp, (size_t)nb, MTK__NO_RANK, v->integer, 1, err))) goto done;
        if (!strcmp(vocab->keys[k], "<|endoftext|>")) eot = v->integer;
    }
    if ((st = mtk__tok_index(tok, vocab_json_path, err)) || (st = mtk__tok_require_bytes(tok, vocab_json_path, err))) goto done;
    if (eot < 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no <|endoftext|> token", vocab_json_path); goto done; }
    if ((st = mtk__added_add(tok, "<|endoftext|>", 13, eot, 1, 1, 0, 0, 1, err))) goto done;
    tok->eod = tok->bos = (int32_t)eot;

    /* vocab.bpe: "#version" line, then one merge "left right" per line, highest priority first. */
    for (size_t i = 0; i < mlen;) {
        size_t e = i;
        while (e < mlen && mg[e] != '\n') e++;
        line++;
        size_t le = e;
        if (le > i && mg[le - 1] == '\r') le--;
        if (le > i && !(line == 1 && mg[i] == '#')) {
            size_t sp = i;
            while (sp < le && mg[sp] != ' ') sp++;
            long na = sp < le ? mtk__gpt2_token_bytes(mg + i, sp - i, tmp) : -1;
            long nb = na > 0 ? mtk__gpt2_token_bytes(mg + sp + 1, le - sp - 1, tmp + na) : -1;
            if (na <= 0 || nb <= 0) {
                st = mt_fail(err, MT_ERR_FORMAT, "%s:%lld: expected two tokens separated by a space", merges_path, (long long)line);
                goto done;
            }
            const mtk__tok_entry* a = mtk__find(tok, tmp, (size_t)na);
            const mtk__tok_entry* b = mtk__find(tok, tmp + na, (size_t)nb);
            const mtk__tok_entry* ab = mtk__find(tok, tmp, (size_t)(na + nb));
            if (!a || !b || !ab) {
                st = mt_fail(err, MT_ERR_FORMAT, "%s:%lld: merge '%.*s' uses a token missing from %s", merges_path,
                             (long long)line, (int)(le - i > 60 ? 60 : le - i), (const char*)mg + i, vocab_json_path);
                goto done;
            }
            if ((st = mtk__pair_add(tok, a->id, b->id, (uint32_t)merge, ab->id, err))) goto done;
            merge++;
        }
        i = e + 1;
    }
    if (merge == 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no merges", merges_path); goto done; }
    if ((st = mtk__pairs_index(tok, err))) goto done;
    st = mtk__tok_finish(tok, vocab_json_path, err);
done:
    mt_json_free(vocab);
    free(mg);
    free(tmp);
    if (st != MT_OK) { mt_tokenizer_free(tok); return st; }
    *out = tok;
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.8 tiktoken rank files (TiktokenFileTokenizer, Llama3Tokenizer)                                */
/* ---------------------------------------------------------------------------------------------- */

static inline int mtk__b64(uint8_t c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

/* Standard base64 with padding; returns the decoded length or -1. */
static long mtk__b64_decode(const uint8_t* s, size_t n, uint8_t* out) {
    if (n == 0 || n % 4) return -1;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 4) {
        int v[4], pad = 0;
        for (int k = 0; k < 4; k++) {
            if (s[i + k] == '=' && i + 4 == n && k >= 2) { v[k] = 0; pad++; continue; }
            if (pad) return -1;
            v[k] = mtk__b64(s[i + k]);
            if (v[k] < 0) return -1;
        }
        uint32_t w = ((uint32_t)v[0] << 18) | ((uint32_t)v[1] << 12) | ((uint32_t)v[2] << 6) | (uint32_t)v[3];
        out[o++] = (uint8_t)(w >> 16);
        if (pad < 2) out[o++] = (uint8_t)(w >> 8);
        if (pad < 1) out[o++] = (uint8_t)w;
    }
    return (long)o;
}

static const char* const mtk__llama3_named_specials[12] = {
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", "<|image|>",
};

/* A special token of a tiktoken encoding: known by id and text, never matched in a text. */
static mt_status mtk__add_special(mt_tokenizer* tok, const char* text, int64_t id, mt_error* err) {
    return mtk__added_add(tok, text, strlen(text), id, 0, 0, 0, 0, 1, err);
}

/* The special tokens of each encoding (tiktoken_ext/openai_public.py; Llama-3: meta-llama's
 * models/llama3/tokenizer.py, ids from the number of ranks on). Returns the EOD text. */
static mt_status mtk__add_specials(mt_tokenizer* tok, mt_tokenizer_kind kind, int64_t num_ranks, const char** eod, mt_error* err) {
    mt_status st = MT_OK;
    switch (kind) {
        case MT_TOKENIZER_GPT2:
            *eod = "<|endoftext|>";
            return mtk__add_special(tok, "<|endoftext|>", 50256, err);
        case MT_TOKENIZER_CL100K:
            *eod = "<|endoftext|>";
            if ((st = mtk__add_special(tok, "<|endoftext|>", 100257, err))) return st;
            if ((st = mtk__add_special(tok, "<|fim_prefix|>", 100258, err))) return st;
            if ((st = mtk__add_special(tok, "<|fim_middle|>", 100259, err))) return st;
            if ((st = mtk__add_special(tok, "<|fim_suffix|>", 100260, err))) return st;
            return mtk__add_special(tok, "<|endofprompt|>", 100276, err);
        case MT_TOKENIZER_O200K:
            *eod = "<|endoftext|>";
            if ((st = mtk__add_special(tok, "<|endoftext|>", 199999, err))) return st;
            return mtk__add_special(tok, "<|endofprompt|>", 200018, err);
        case MT_TOKENIZER_LLAMA3:
            *eod = "<|end_of_text|>";
            for (int k = 0; k < 256; k++) {
                char name[64];
                if (k < 12) snprintf(name, sizeof(name), "%s", mtk__llama3_named_specials[k]);
                else snprintf(name, sizeof(name), "<|reserved_special_token_%d|>", k - 10);
                if ((st = mtk__add_special(tok, name, num_ranks + k, err))) return st;
            }
            return MT_OK;
        default: break;
    }
    return mt_fail(err, MT_ERR_ARG, "%s is not a tiktoken encoding", mt_tokenizer_kind_name(kind));
}

/* Special tokens must not take ids the ranks use (a wrong encoding for the file, e.g. cl100k's
 * ranks read as GPT-2's). */
static mt_status mtk__specials_free_ids(const mt_tokenizer* tok, const char* path, mt_error* err) {
    int64_t max_id = 0;
    for (uint32_t e = 0; e < tok->num_entries; e++)
        if (tok->entries[e].id > max_id) max_id = tok->entries[e].id;
    uint8_t* used = (uint8_t*)calloc((size_t)max_id + 1, 1);
    if (!used) return mt_fail(err, MT_ERR_OOM, "out of memory");
    for (uint32_t e = 0; e < tok->num_entries; e++) used[tok->entries[e].id] = 1;
    mt_status st = MT_OK;
    for (int k = 0; k < tok->num_added && st == MT_OK; k++)
        if (tok->added[k].id <= max_id && used[tok->added[k].id])
            st = mt_fail(err, MT_ERR_FORMAT, "%s: special token id %d is already an ordinary token (wrong encoding for this file?)",
                         path, tok->added[k].id);
    free(used);
    return st;
}

mt_status mt_tokenizer_load_tiktoken(mt_tokenizer** out, const char* path, mt_tokenizer_kind kind, mt_error* err) {
    static const mtk__split_kind split[4] = {MTK__SPLIT_GPT2, MTK__SPLIT_CL100K, MTK__SPLIT_O200K, MTK__SPLIT_LLAMA3};
    uint8_t *buf = NULL, *tmp = NULL;
    size_t len = 0;
    const char* eod = NULL;
    int64_t num_ranks = 0, line = 0;
    mt_status st;
    *out = NULL;
    if ((unsigned)kind > (unsigned)MT_TOKENIZER_LLAMA3) return mt_fail(err, MT_ERR_ARG, "%s is not a tiktoken encoding", mt_tokenizer_kind_name(kind));
    mt_tokenizer* tok = mtk__tok_new(kind);
    if (!tok) return mt_fail(err, MT_ERR_OOM, "out of memory");
    tok->split = split[kind];
    tok->shortcut_all = 1; /* tiktoken: a piece that is a token is that token */
    if ((st = mtk__read_file(path, &buf, &len, err))) { free(tok); return st; }
    tmp = (uint8_t*)malloc(len + 4);
    if (!tmp) { st = mt_fail(err, MT_ERR_OOM, "out of memory loading %s", path); goto done; }
    for (size_t i = 0; i < len;) {
        size_t e = i;
        while (e < len && buf[e] != '\n') e++;
        line++;
        size_t le = e;
        if (le > i && buf[le - 1] == '\r') le--;
        if (le > i) { /* "base64 rank"; empty lines are skipped, as tiktoken does */
            size_t sp = i;
            while (sp < le && buf[sp] != ' ') sp++;
            long nb = sp < le ? mtk__b64_decode(buf + i, sp - i, tmp) : -1;
            if (nb <= 0) {
                st = mt_fail(err, MT_ERR_FORMAT, "%s:%lld: expected '<base64 token> <rank>'", path, (long long)line);
                goto done;
            }
            int64_t rank = 0;
            size_t d = sp + 1;
            if (d >= le) { st = mt_fail(err, MT_ERR_FORMAT, "%s:%lld: missing rank", path, (long long)line); goto done; }
            for (; d < le; d++) {
                if (buf[d] < '0' || buf[d] > '9' || rank > 0x7FFFFFFE / 10) {
                    st = mt_fail(err, MT_ERR_FORMAT, "%s:%lld: bad rank '%.*s'", path, (long long)line, (int)(le - sp - 1),
                                 (const char*)buf + sp + 1);
                    goto done;
                }
                rank = rank * 10 + (buf[d] - '0');
            }
            if ((st = mtk__tok_add(tok, tmp, (size_t)nb, (uint32_t)rank, rank, 1, err))) goto done;
            num_ranks++;
        }
        i = e + 1;
    }
    if (num_ranks == 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no tokens in the file", path); goto done; }
    if ((st = mtk__tok_index(tok, path, err)) || (st = mtk__tok_require_bytes(tok, path, err))) goto done;
    if ((st = mtk__pairs_from_ranks(tok, err))) goto done;
    if ((st = mtk__add_specials(tok, kind, num_ranks, &eod, err)) || (st = mtk__specials_free_ids(tok, path, err))) goto done;
    if ((st = mtk__tok_finish(tok, path, err))) goto done;
    tok->eod = mt_tokenizer_token_id(tok, eod, strlen(eod));
    if (kind == MT_TOKENIZER_LLAMA3) tok->bos = mt_tokenizer_token_id(tok, "<|begin_of_text|>", 17);
done:
    free(buf);
    free(tmp);
    if (st != MT_OK) { mt_tokenizer_free(tok); return st; }
    *out = tok;
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.9 HuggingFaceTokenizer: tokenizer.json                                                        */
/* ---------------------------------------------------------------------------------------------- */
/* The file's parts are read in the order they depend on each other: the pre-tokenizer (byte-level
 * or not decides how vocabulary strings become bytes), the model, the normalizer, the added tokens,
 * the post-processor's template, the decoder; then tokenizer_config.json / special_tokens_map.json
 * for eos and bos. Anything this file does not implement is refused with one line naming it. */

static const char* mtk__jtype(const mt_json* v) {
    if (!v) return "missing";
    switch (v->type) {
        case MT_JSON_NULL: return "null";
        case MT_JSON_FALSE: case MT_JSON_TRUE: return "a boolean";
        case MT_JSON_NUMBER: return "a number";
        case MT_JSON_STRING: return "a string";
        case MT_JSON_ARRAY: return "an array";
        case MT_JSON_OBJECT: return "an object";
    }
    return "?";
}

static const char* mtk__jstr(const mt_json* obj, const char* key) {
    const mt_json* v = mt_json_get(obj, key);
    return v && v->type == MT_JSON_STRING ? v->string : NULL;
}

/* A boolean member: 0/1, def when absent or null, -1 when it is something else. */
static int mtk__jbool(const mt_json* obj, const char* key, int def) {
    const mt_json* v = mt_json_get(obj, key);
    if (!v || v->type == MT_JSON_NULL) return def;
    if (v->type == MT_JSON_TRUE) return 1;
    if (v->type == MT_JSON_FALSE) return 0;
    return -1;
}

static int mtk__jnull(const mt_json* v) { return !v || v->type == MT_JSON_NULL; }

/* The string of a Split/Replace pattern {"String": s} or {"Regex": r}; *is_regex says which. */
static const char* mtk__jpattern(const mt_json* obj, int* is_regex) {
    const mt_json* p = mt_json_get(obj, "pattern");
    const char* s;
    if ((s = mtk__jstr(p, "Regex"))) { *is_regex = 1; return s; }
    *is_regex = 0;
    return mtk__jstr(p, "String");
}

/* Appends the leaves of a (Sequence of) pre-tokenizers / normalizers / decoders / processors. */
static int mtk__jleaves(const mt_json* v, const char* list_key, const mt_json** out, int max, int n) {
    if (mtk__jnull(v)) return n;
    const char* type = mtk__jstr(v, "type");
    const mt_json* list = mt_json_get(v, list_key);
    if (type && !strcmp(type, "Sequence") && list && list->type == MT_JSON_ARRAY) {
        for (int k = 0; k < list->count; k++) n = mtk__jleaves(&list->items[k], list_key, out, max, n);
        return n;
    }
    if (n < max) out[n] = v;
    return n + 1;
}

static mt_status mtk__hf_pre_tokenizer(mt_tokenizer* tok, const mt_json* root, const char* path, mt_error* err) {
    const mt_json* leaf[16];
    int n = mtk__jleaves(mt_json_get(root, "pre_tokenizer"), "pretokenizers", leaf, 16, 0);
    int byte_level = 0, regexes = 0;
    tok->char_level = 1;
    if (n > 16) return mt_fail(err, MT_ERR_FORMAT, "%s: more than 16 pre-tokenizers", path);
    for (int k = 0; k < n; k++) {
        const char* type = mtk__jstr(leaf[k], "type");
        if (!type) return mt_fail(err, MT_ERR_FORMAT, "%s: a pre-tokenizer without a type", path);
        if (!strcmp(type, "ByteLevel")) {
            int aps = mtk__jbool(leaf[k], "add_prefix_space", 1), use_regex = mtk__jbool(leaf[k], "use_regex", 1);
            if (aps < 0 || use_regex < 0) return mt_fail(err, MT_ERR_FORMAT, "%s: malformed ByteLevel pre-tokenizer", path);
            if (byte_level) return mt_fail(err, MT_ERR_FORMAT, "%s: two ByteLevel pre-tokenizers are not supported", path);
            if (aps && regexes)
                return mt_fail(err, MT_ERR_FORMAT, "%s: ByteLevel(add_prefix_space) after a Split is not supported (it prefixes every piece)", path);
            byte_level = 1;
            tok->char_level = 0;
            tok->prefix_space = aps;
            if (use_regex) { tok->split = MTK__SPLIT_GPT2; regexes++; }
        } else if (!strcmp(type, "Split")) {
            int is_regex = 0;
            const char* pat = mtk__jpattern(leaf[k], &is_regex);
            const char* behavior = mtk__jstr(leaf[k], "behavior");
            if (!pat) return mt_fail(err, MT_ERR_FORMAT, "%s: a Split pre-tokenizer without a pattern", path);
            if (byte_level) return mt_fail(err, MT_ERR_FORMAT, "%s: a Split after ByteLevel is not supported", path);
            if (!is_regex) return mt_fail(err, MT_ERR_FORMAT, "%s: Split on the string '%.60s' is not supported (only the known regex patterns)", path, pat);
            if (!behavior || strcmp(behavior, "Isolated") || mtk__jbool(leaf[k], "invert", 0) != 0)
                return mt_fail(err, MT_ERR_FORMAT, "%s: Split with behavior %s%s is not supported (only Isolated, not inverted)", path,
                               behavior ? behavior : "(none)", mtk__jbool(leaf[k], "invert", 0) ? " inverted" : "");
            size_t np = sizeof(mtk__patterns) / sizeof(mtk__patterns[0]), p = 0;
            while (p < np && strcmp(mtk__patterns[p].pattern, pat)) p++;
            if (p == np)
                return mt_fail(err, MT_ERR_FORMAT,
                               "%s: the pre-tokenizer regex '%.200s' is not one this build implements (GPT-2, cl100k, o200k, Llama-3, "
                               "Qwen2, Megatron TikTokenizer v1, v2 = Mistral tekken)",
                               path, pat);
            if (regexes++) return mt_fail(err, MT_ERR_FORMAT, "%s: two split regexes are not supported", path);
            tok->split = mtk__patterns[p].kind;
        } else if (!strcmp(type, "Metaspace")) {
            const char* rep = mtk__jstr(leaf[k], "replacement");
            const char* scheme = mtk__jstr(leaf[k], "prepend_scheme");
            int aps = mtk__jbool(leaf[k], "add_prefix_space", 1), split = mtk__jbool(leaf[k], "split", 1);
            if (n != 1) return mt_fail(err, MT_ERR_FORMAT, "%s: Metaspace with other pre-tokenizers is not supported", path);
            if (!rep || !rep[0] || strlen(rep) > 4 || mtk__utf8_len((uint8_t)rep[0]) != strlen(rep) || aps < 0 || split < 0)
                return mt_fail(err, MT_ERR_FORMAT, "%s: malformed Metaspace pre-tokenizer", path);
            tok->metaspace = 1;
            tok->meta_rep_len = (int)strlen(rep);
            memcpy(tok->meta_rep, rep, strlen(rep));
            tok->meta_split = split;
            if (!scheme) tok->meta_scheme = aps ? 2 : 0; /* files older than prepend_scheme */
            else if (!strcmp(scheme, "always")) tok->meta_scheme = 2;
            else if (!strcmp(scheme, "first")) tok->meta_scheme = 1;
            else if (!strcmp(scheme, "never")) tok->meta_scheme = 0;
            else return mt_fail(err, MT_ERR_FORMAT, "%s: Metaspace prepend_scheme '%s' is unknown", path, scheme);
        } else {
            return mt_fail(err, MT_ERR_FORMAT, "%s: the %s pre-tokenizer is not supported (ByteLevel, Split, Metaspace, Sequence)", path, type);
        }
    }
    return MT_OK;
}

static mt_status mtk__hf_normalizer(mt_tokenizer* tok, const mt_json* root, const char* path, mt_error* err) {
    const mt_json* leaf[16];
    int n = mtk__jleaves(mt_json_get(root, "normalizer"), "normalizers", leaf, 16, 0);
    mt_status st;
    if (n > 16) return mt_fail(err, MT_ERR_FORMAT, "%s: more than 16 normalizers", path);
    if (n && !(tok->norm = (mtk__norm*)calloc((size_t)n, sizeof(mtk__norm)))) return mt_fail(err, MT_ERR_OOM, "out of memory");
    for (int k = 0; k < n; k++) {
        const char* type = mtk__jstr(leaf[k], "type");
        mtk__norm* s = &tok->norm[tok->num_norm];
        if (!type) return mt_fail(err, MT_ERR_FORMAT, "%s: a normalizer without a type", path);
        if (!strcmp(type, "NFC")) {
            s->kind = MTK__NORM_NFC;
        } else if (!strcmp(type, "Prepend")) {
            const char* p = mtk__jstr(leaf[k], "prepend");
            if (!p) return mt_fail(err, MT_ERR_FORMAT, "%s: Prepend normalizer without a string", path);
            s->kind = MTK__NORM_PREPEND;
            s->a_len = (uint32_t)strlen(p);
            if ((st = mtk__blob_put(tok, (const uint8_t*)p, s->a_len, &s->a_off, err))) return st;
        } else if (!strcmp(type, "Replace")) {
            int is_regex = 0;
            const char* a = mtk__jpattern(leaf[k], &is_regex);
            const char* b = mtk__jstr(leaf[k], "content");
            if (!a || !b) return mt_fail(err, MT_ERR_FORMAT, "%s: malformed Replace normalizer", path);
            if (is_regex) return mt_fail(err, MT_ERR_FORMAT, "%s: the Replace normalizer with the regex '%.60s' is not supported (string patterns only)", path, a);
            if (!a[0]) return mt_fail(err, MT_ERR_FORMAT, "%s: Replace normalizer with an empty pattern", path);
            s->kind = MTK__NORM_REPLACE;
            s->a_len = (uint32_t)strlen(a);
            s->b_len = (uint32_t)strlen(b);
            if ((st = mtk__blob_put(tok, (const uint8_t*)a, s->a_len, &s->a_off, err)) ||
                (st = mtk__blob_put(tok, (const uint8_t*)b, s->b_len, &s->b_off, err)))
                return st;
        } else {
            return mt_fail(err, MT_ERR_FORMAT, "%s: the %s normalizer is not supported (NFC, Prepend, Replace, Sequence)", path, type);
        }
        tok->num_norm++;
    }
    return MT_OK;
}

static mt_status mtk__hf_model(mt_tokenizer* tok, const mt_json* root, const char* path, mt_error* err) {
    const mt_json* model = mt_json_get(root, "model");
    const char* type = mtk__jstr(model, "type");
    mt_status st = MT_OK;
    if (!model || model->type != MT_JSON_OBJECT) return mt_fail(err, MT_ERR_FORMAT, "%s: no \"model\" object", path);
    if (!type || strcmp(type, "BPE"))
        return mt_fail(err, MT_ERR_FORMAT, "%s: model type %s is not supported (BPE only: WordPiece, Unigram and WordLevel are not)", path,
                       type ? type : "(none)");
    const mt_json* dropout = mt_json_get(model, "dropout");
    if (!mtk__jnull(dropout) && !(dropout->type == MT_JSON_NUMBER && dropout->number == 0.0))
        return mt_fail(err, MT_ERR_FORMAT, "%s: BPE dropout is not supported (it makes encoding random)", path);
    static const char* const affixes[2] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int k = 0; k < 2; k++) {
        const mt_json* a = mt_json_get(model, affixes[k]);
        if (!mtk__jnull(a) && !(a->type == MT_JSON_STRING && a->length == 0))
            return mt_fail(err, MT_ERR_FORMAT, "%s: BPE %s is not supported", path, affixes[k]);
    }
    int fuse = mtk__jbool(model, "fuse_unk", 0), fallback = mtk__jbool(model, "byte_fallback", 0), ignore = mtk__jbool(model, "ignore_merges", 0);
    if (fuse < 0 || fallback < 0 || ignore < 0) return mt_fail(err, MT_ERR_FORMAT, "%s: malformed BPE model options", path);
    tok->fuse_unk = fuse;
    tok->byte_fallback = fallback;
    tok->shortcut_all = ignore;
    const mt_json* vocab = mt_json_get(model, "vocab");
    const mt_json* merges = mt_json_get(model, "merges");
    if (!vocab || vocab->type != MT_JSON_OBJECT) return mt_fail(err, MT_ERR_FORMAT, "%s: the BPE vocab is %s, not an object", path, mtk__jtype(vocab));
    if (!merges || merges->type != MT_JSON_ARRAY) return mt_fail(err, MT_ERR_FORMAT, "%s: the BPE merges are %s, not an array", path, mtk__jtype(merges));
    size_t longest = 0;
    for (int k = 0; k < vocab->count; k++) {
        size_t l = strlen(vocab->keys[k]);
        if (l > longest) longest = l;
    }
    uint8_t* tmp = (uint8_t*)malloc(2 * longest + 16);
    if (!tmp) return mt_fail(err, MT_ERR_OOM, "out of memory");
    for (int k = 0; k < vocab->count && st == MT_OK; k++) {
        const mt_json* v = &vocab->items[k];
        const char* s = vocab->keys[k];
        size_t l = strlen(s);
        if (v->type != MT_JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer > 0x7FFFFFFE) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: the id of vocab token '%.60s' is not a token id", path, s);
            break;
        }
        long nb = mtk__vocab_bytes(tok, s, l, tmp);
        if (nb < 0) st = mtk__tok_add(tok, (const uint8_t*)s, l, MTK__NO_RANK, v->integer, 0, err); /* unreachable, kept for ids */
        else st = mtk__tok_add(tok, tmp, (size_t)nb, MTK__NO_RANK, v->integer, 1, err);
        if (st && err) {
            char msg[sizeof(err->message)];
            snprintf(msg, sizeof(msg), "%s", err->message);
            st = mt_fail(err, st, "%s: %s", path, msg);
        }
    }
    if (st == MT_OK) st = mtk__tok_index(tok, path, err);
    /* merges: "a b" (split at the one space) or ["a", "b"]; the rank is the position in the list */
    uint8_t* ab = NULL;
    if (st == MT_OK && !(ab = (uint8_t*)malloc(4 * longest + 16))) st = mt_fail(err, MT_ERR_OOM, "out of memory");
    for (int k = 0; k < merges->count && st == MT_OK; k++) {
        const mt_json* m = &merges->items[k];
        const char *a = NULL, *b = NULL;
        size_t al = 0, bl = 0;
        if (m->type == MT_JSON_STRING) {
            const char* sp = strchr(m->string, ' ');
            if (sp && !strchr(sp + 1, ' ')) { a = m->string; al = (size_t)(sp - m->string); b = sp + 1; bl = strlen(b); }
        } else if (m->type == MT_JSON_ARRAY && m->count == 2 && m->items[0].type == MT_JSON_STRING && m->items[1].type == MT_JSON_STRING) {
            a = m->items[0].string; al = m->items[0].length;
            b = m->items[1].string; bl = m->items[1].length;
        }
        if (!a || al > longest || bl > longest) { st = mt_fail(err, MT_ERR_FORMAT, "%s: merge %d is not \"a b\" or [a, b]", path, k); break; }
        long na = mtk__vocab_bytes(tok, a, al, ab), nb = na < 0 ? -1 : mtk__vocab_bytes(tok, b, bl, ab + na);
        if (na < 0 || nb < 0) continue; /* a token a byte-level model never produces: the merge cannot happen */
        const mtk__tok_entry* ea = na ? mtk__find(tok, ab, (size_t)na) : NULL;
        const mtk__tok_entry* eb = nb ? mtk__find(tok, ab + na, (size_t)nb) : NULL;
        const mtk__tok_entry* em = mtk__find(tok, ab, (size_t)(na + nb));
        if (!ea || !eb || !em) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: merge %d '%.40s' '%.40s' uses a token that is not in the vocab", path, k, a, b);
            break;
        }
        st = mtk__pair_add(tok, ea->id, eb->id, (uint32_t)k, em->id, err);
    }
    free(tmp);
    free(ab);
    if (st == MT_OK) st = mtk__pairs_index(tok, err);
    if (st == MT_OK) {
        const char* unk = mtk__jstr(model, "unk_token");
        if (unk) {
            size_t ul = strlen(unk);
            uint8_t* ub = (uint8_t*)malloc(ul + 1);
            long nb = ub ? mtk__vocab_bytes(tok, unk, ul, ub) : -1;
            const mtk__tok_entry* e = nb > 0 ? mtk__find(tok, ub, (size_t)nb) : NULL;
            for (uint32_t k = 0; k < tok->num_entries && !e; k++) /* a string the byte-level model cannot produce */
                if (!tok->entries[k].hashed && tok->entries[k].len == ul && !memcmp(tok->blob + tok->entries[k].off, unk, ul))
                    e = &tok->entries[k];
            free(ub);
            if (!e) return mt_fail(err, MT_ERR_FORMAT, "%s: unk_token '%.60s' is not in the vocab", path, unk);
            tok->unk_id = e->id;
        }
    }
    return st;
}

static mt_status mtk__hf_added_tokens(mt_tokenizer* tok, const mt_json* root, const char* path, mt_error* err) {
    const mt_json* list = mt_json_get(root, "added_tokens");
    if (mtk__jnull(list)) return MT_OK;
    if (list->type != MT_JSON_ARRAY) return mt_fail(err, MT_ERR_FORMAT, "%s: added_tokens is %s, not an array", path, mtk__jtype(list));
    for (int k = 0; k < list->count; k++) {
        const mt_json* t = &list->items[k];
        const mt_json* id = mt_json_get(t, "id");
        const mt_json* content = mt_json_get(t, "content");
        int single = mtk__jbool(t, "single_word", 0), lstrip = mtk__jbool(t, "lstrip", 0), rstrip = mtk__jbool(t, "rstrip", 0);
        int normalized = mtk__jbool(t, "normalized", 1), special = mtk__jbool(t, "special", 0);
        if (!id || id->type != MT_JSON_NUMBER || !id->is_integer || !content || content->type != MT_JSON_STRING || single < 0 ||
            lstrip < 0 || rstrip < 0 || normalized < 0 || special < 0)
            return mt_fail(err, MT_ERR_FORMAT, "%s: added token %d is malformed", path, k);
        if (single)
            return mt_fail(err, MT_ERR_FORMAT, "%s: added token '%.60s' is single_word, which is not supported", path, content->string);
        mt_status st = mtk__added_add(tok, content->string, content->length, id->integer, 1, normalized, lstrip, rstrip, special, err);
        if (st) return st;
    }
    return MT_OK;
}

/* The id of a special-token name of the post-processor (its own map, else a token's text). */
static mt_status mtk__hf_template_ids(const mt_json* pp, const char* name, int32_t* ids, int* n, int max,
                                     const char* path, mt_error* err) {
    const mt_json* map = mt_json_get(pp, "special_tokens");
    const mt_json* entry = mt_json_get(map, name);
    const mt_json* list = mt_json_get(entry, "ids");
    if (!list || list->type != MT_JSON_ARRAY) return mt_fail(err, MT_ERR_FORMAT, "%s: the template's special token '%.60s' has no ids", path, name);
    for (int k = 0; k < list->count; k++) {
        const mt_json* v = &list->items[k];
        if (v->type != MT_JSON_NUMBER || !v->is_integer || v->integer < 0 || v->integer > 0x7FFFFFFE || *n >= max)
            return mt_fail(err, MT_ERR_FORMAT, "%s: the template's special token '%.60s' has a bad id", path, name);
        ids[(*n)++] = (int32_t)v->integer;
    }
    return MT_OK;
}

static mt_status mtk__hf_post_processor(mt_tokenizer* tok, const mt_json* root, int include_special, const char* path, mt_error* err) {
    const mt_json* leaf[8];
    int n = mtk__jleaves(mt_json_get(root, "post_processor"), "processors", leaf, 8, 0), adders = 0;
    int32_t pre[64], post[64];
    int np = 0, ns = 0;
    mt_status st;
    if (n > 8) return mt_fail(err, MT_ERR_FORMAT, "%s: more than 8 post-processors", path);
    for (int k = 0; k < n; k++) {
        const char* type = mtk__jstr(leaf[k], "type");
        if (!type) return mt_fail(err, MT_ERR_FORMAT, "%s: a post-processor without a type", path);
        if (!strcmp(type, "ByteLevel")) continue; /* offsets only */
        if (adders++) return mt_fail(err, MT_ERR_FORMAT, "%s: two post-processors that add tokens are not supported", path);
        if (!strcmp(type, "TemplateProcessing")) {
            const mt_json* single = mt_json_get(leaf[k], "single");
            int seen_a = 0;
            if (!single || single->type != MT_JSON_ARRAY) return mt_fail(err, MT_ERR_FORMAT, "%s: TemplateProcessing without a single template", path);
            for (int i = 0; i < single->count; i++) {
                const mt_json* item = &single->items[i];
                const mt_json* spec = mt_json_get(item, "SpecialToken");
                const mt_json* seq = mt_json_get(item, "Sequence");
                if (seq) {
                    const char* which = mtk__jstr(seq, "id");
                    if (!which || strcmp(which, "A") || seen_a++)
                        return mt_fail(err, MT_ERR_FORMAT, "%s: the single-text template must hold sequence A once", path);
                } else if (spec && mtk__jstr(spec, "id")) {
                    if ((st = mtk__hf_template_ids(leaf[k], mtk__jstr(spec, "id"), seen_a ? post : pre, seen_a ? &ns : &np, 64, path, err)))
                        return st;
                } else {
                    return mt_fail(err, MT_ERR_FORMAT, "%s: malformed TemplateProcessing item", path);
                }
            }
            if (!seen_a) return mt_fail(err, MT_ERR_FORMAT, "%s: the single-text template must hold sequence A once", path);
        } else if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
            const mt_json* cls = mt_json_get(leaf[k], "cls");
            const mt_json* sep = mt_json_get(leaf[k], "sep");
            if (!cls || !sep || cls->type != MT_JSON_ARRAY || sep->type != MT_JSON_ARRAY || cls->count != 2 || sep->count != 2 ||
                !cls->items[1].is_integer || !sep->items[1].is_integer)
                return mt_fail(err, MT_ERR_FORMAT, "%s: malformed %s", path, type);
            pre[np++] = (int32_t)cls->items[1].integer;
            post[ns++] = (int32_t)sep->items[1].integer;
        } else {
            return mt_fail(err, MT_ERR_FORMAT,
                           "%s: the %s post-processor is not supported (TemplateProcessing, ByteLevel, BertProcessing, "
                           "RobertaProcessing, Sequence)",
                           path, type);
        }
    }
    if (!include_special || np + ns == 0) return MT_OK;
    tok->templ = (int32_t*)malloc((size_t)(np + ns) * sizeof(int32_t));
    if (!tok->templ) return mt_fail(err, MT_ERR_OOM, "out of memory");
    memcpy(tok->templ, pre, (size_t)np * sizeof(int32_t));
    memcpy(tok->templ + np, post, (size_t)ns * sizeof(int32_t));
    tok->num_prefix = np;
    tok->num_suffix = ns;
    return MT_OK;
}

static mt_status mtk__hf_decoder(mt_tokenizer* tok, const mt_json* root, const char* path, mt_error* err) {
    const mt_json* leaf[16];
    int n = mtk__jleaves(mt_json_get(root, "decoder"), "decoders", leaf, 16, 0), fused = 0;
    if (n > 16) return mt_fail(err, MT_ERR_FORMAT, "%s: more than 16 decoders", path);
    for (int k = 0; k < n; k++) {
        const char* type = mtk__jstr(leaf[k], "type");
        if (!type) return mt_fail(err, MT_ERR_FORMAT, "%s: a decoder without a type", path);
        if (!strcmp(type, "ByteLevel")) {
            if (tok->char_level) return mt_fail(err, MT_ERR_FORMAT, "%s: a ByteLevel decoder without a ByteLevel pre-tokenizer is not supported", path);
        } else if (!strcmp(type, "ByteFallback")) {
            tok->dec_byte_fallback = 1;
        } else if (!strcmp(type, "Fuse")) {
            fused = 1;
        } else if (!strcmp(type, "Replace") || !strcmp(type, "Metaspace")) {
            int is_regex = 0;
            const char* a = !strcmp(type, "Replace") ? mtk__jpattern(leaf[k], &is_regex) : mtk__jstr(leaf[k], "replacement");
            const char* b = !strcmp(type, "Replace") ? mtk__jstr(leaf[k], "content") : " ";
            if (!a || !b || is_regex || !a[0] || strlen(a) > 4 || strlen(b) > 4 || tok->dec_rep_len)
                return mt_fail(err, MT_ERR_FORMAT, "%s: the %s decoder is not supported here (one string replacement of up to 4 bytes)", path, type);
            tok->dec_rep_len = (int)strlen(a);
            memcpy(tok->dec_rep, a, strlen(a));
            tok->dec_rep_to_len = (int)strlen(b);
            memcpy(tok->dec_rep_to, b, strlen(b));
            if (!strcmp(type, "Metaspace")) {
                const char* scheme = mtk__jstr(leaf[k], "prepend_scheme");
                int aps = mtk__jbool(leaf[k], "add_prefix_space", 1);
                tok->dec_first_drop_rep = scheme ? strcmp(scheme, "never") != 0 : aps == 1;
                if (tok->dec_first_drop_rep && !tok->metaspace) { /* the first token's U+2581s are dropped */
                    tok->meta_rep_len = tok->dec_rep_len;
                    memcpy(tok->meta_rep, tok->dec_rep, (size_t)tok->dec_rep_len);
                }
            }
        } else if (!strcmp(type, "Strip")) {
            const char* content = mtk__jstr(leaf[k], "content");
            const mt_json* start = mt_json_get(leaf[k], "start");
            const mt_json* stop = mt_json_get(leaf[k], "stop");
            if (!fused || !content || strcmp(content, " ") || !start || !start->is_integer || start->integer < 0 || start->integer > 64 ||
                !stop || !stop->is_integer || stop->integer != 0)
                return mt_fail(err, MT_ERR_FORMAT, "%s: only Strip(' ', start, 0) after Fuse is supported as a decoder", path);
            tok->dec_strip = (int)start->integer;
        } else {
            return mt_fail(err, MT_ERR_FORMAT,
                           "%s: the %s decoder is not supported (ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence)", path,
                           type);
        }
    }
    return MT_OK;
}

/* eos_token / bos_token as transformers reads them: special_tokens_map.json over
 * tokenizer_config.json; a value is a string or {"content": ...}. Returns 1 and the text, 0 when
 * neither file names it (or a file is absent), -1 when a file is malformed. */
static int mtk__hf_config_token(const mt_json* config, const mt_json* map, const char* key, const char** out) {
    const mt_json* srcs[2] = {map, config};
    for (int k = 0; k < 2; k++) {
        const mt_json* v = mt_json_get(srcs[k], key);
        if (mtk__jnull(v)) continue;
        if (v->type == MT_JSON_STRING) { *out = v->string; return 1; }
        if (v->type == MT_JSON_OBJECT && mtk__jstr(v, "content")) { *out = mtk__jstr(v, "content"); return 1; }
        return -1;
    }
    return 0;
}

static mt_status mtk__hf_config(mt_tokenizer* tok, const char* dir, int include_special, mt_error* err) {
    static const char* const files[2] = {"tokenizer_config.json", "special_tokens_map.json"};
    mt_json* json[2] = {NULL, NULL};
    mt_status st = MT_OK;
    char path[4096 + 64];
    for (int k = 0; k < 2 && st == MT_OK; k++) {
        snprintf(path, sizeof(path), "%s/%s", dir, files[k]);
        struct stat sb;
        if (stat(path, &sb) == 0) st = mt_json_parse_file(&json[k], path, err);
    }
    /* eod: eos_token, else sep_token; bos: bos_token, else cls_token (as Megatron's HF wrapper) */
    static const char* const keys[2][2] = {{"eos_token", "sep_token"}, {"bos_token", "cls_token"}};
    int32_t* slot[2] = {&tok->eod, &tok->bos};
    for (int w = 0; w < 2 && st == MT_OK; w++) {
        for (int k = 0; k < 2; k++) {
            const char* name = NULL;
            int r = mtk__hf_config_token(json[0], json[1], keys[w][k], &name);
            if (r < 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s/%s: %s is neither a string nor {\"content\": ...}", dir, files[0], keys[w][k]); break; }
            if (!r) continue;
            *slot[w] = mt_tokenizer_token_id(tok, name, strlen(name));
            if (*slot[w] < 0 && tok->char_level == 0) { /* a byte-level vocabulary writes it in its alphabet */
                uint8_t tmp[256];
                long nb = strlen(name) < sizeof(tmp) ? mtk__gpt2_token_bytes((const uint8_t*)name, strlen(name), tmp) : -1;
                if (nb > 0) *slot[w] = mt_tokenizer_token_id(tok, (const char*)tmp, (size_t)nb);
            }
            if (*slot[w] < 0) st = mt_fail(err, MT_ERR_FORMAT, "%s: %s '%.60s' is not a token of tokenizer.json", dir, keys[w][k], name);
            break;
        }
    }
    /* add_bos_token / add_eos_token in tokenizer_config.json replace the post-processor's template
     * with [bos] $A [eos] (transformers' TokenizersBackend.update_post_processor: a key that is not
     * there counts as false, a missing bos/eos token drops its side). */
    const mt_json* add_bos = mt_json_get(json[0], "add_bos_token");
    const mt_json* add_eos = mt_json_get(json[0], "add_eos_token");
    if (st == MT_OK && include_special && (add_bos || add_eos)) {
        int32_t eos = -1;
        const char* name = NULL;
        if (mtk__hf_config_token(json[0], json[1], "eos_token", &name) == 1) eos = mt_tokenizer_token_id(tok, name, strlen(name));
        int b = add_bos && add_bos->type == MT_JSON_TRUE && tok->bos >= 0, e = add_eos && add_eos->type == MT_JSON_TRUE && eos >= 0;
        free(tok->templ);
        tok->templ = (int32_t*)malloc(2 * sizeof(int32_t));
        if (!tok->templ) st = mt_fail(err, MT_ERR_OOM, "out of memory");
        else {
            if (b) tok->templ[0] = tok->bos;
            if (e) tok->templ[b] = eos;
            tok->num_prefix = b;
            tok->num_suffix = e;
        }
    }
    mt_json_free(json[0]);
    mt_json_free(json[1]);
    return st;
}

mt_status mt_tokenizer_load_hf(mt_tokenizer** out, const char* path, int include_special_tokens, mt_error* err) {
    char file[4096], dir[4096];
    struct stat sb;
    mt_json* root = NULL;
    mt_status st;
    *out = NULL;
    if (strlen(path) > 4000) return mt_fail(err, MT_ERR_ARG, "tokenizer path longer than 4000 bytes");
    if (stat(path, &sb) != 0) return mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    if (S_ISDIR(sb.st_mode)) {
        snprintf(dir, sizeof(dir), "%s", path);
        snprintf(file, sizeof(file), "%s/tokenizer.json", path);
    } else {
        const char* slash = strrchr(path, '/');
        snprintf(dir, sizeof(dir), "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
        snprintf(file, sizeof(file), "%s", path);
    }
    mt_tokenizer* tok = mtk__tok_new(MT_TOKENIZER_HUGGINGFACE);
    if (!tok) return mt_fail(err, MT_ERR_OOM, "out of memory");
    if ((st = mt_json_parse_file(&root, file, err))) goto done;
    if (root->type != MT_JSON_OBJECT) { st = mt_fail(err, MT_ERR_FORMAT, "%s: not a JSON object", file); goto done; }
    if ((st = mtk__hf_pre_tokenizer(tok, root, file, err)) || (st = mtk__hf_model(tok, root, file, err)) ||
        (st = mtk__hf_normalizer(tok, root, file, err)) || (st = mtk__hf_added_tokens(tok, root, file, err)) ||
        (st = mtk__hf_post_processor(tok, root, include_special_tokens, file, err)) || (st = mtk__hf_decoder(tok, root, file, err)) ||
        (st = mtk__tok_finish(tok, file, err)))
        goto done;
    st = mtk__hf_config(tok, dir, include_special_tokens, err);
done:
    mt_json_free(root);
    if (st != MT_OK) { mt_tokenizer_free(tok); return st; }
    *out = tok;
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.10 TikTokenizer (Megatron's), and loading by --tokenizer-type                                */
/* ---------------------------------------------------------------------------------------------- */

static const char* const mtk__megatron_specials[7] = {"<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"};

void mt_tiktokenizer_options_init(mt_tiktokenizer_options* opt) {
    memset(opt, 0, sizeof(*opt));
    opt->pattern = "v2";
    opt->vocab_size = 131072;
    opt->num_special_tokens = 1000;
}

mt_status mt_tokenizer_load_tiktokenizer(mt_tokenizer** out, const char* json_path, const mt_tiktokenizer_options* opt,
                                        mt_error* err) {
    mt_tiktokenizer_options o;
    mt_json* vocab = NULL;
    uint8_t* tmp = NULL;
    mt_status st = MT_OK;
    *out = NULL;
    if (opt) o = *opt;
    else mt_tiktokenizer_options_init(&o);
    if (!o.pattern) o.pattern = "v2";
    if (o.vocab_size == 0) o.vocab_size = 131072;
    const char* const* specials = o.special_tokens ? o.special_tokens : mtk__megatron_specials;
    int nspec = o.special_tokens ? o.num_given_special_tokens : 7;
    if (strcmp(o.pattern, "v1") && strcmp(o.pattern, "v2"))
        return mt_fail(err, MT_ERR_ARG, "--tiktoken-pattern %s: expected v1 or v2", o.pattern);
    if (o.vocab_size < 0 || o.vocab_size > 0x7FFFFFFE) return mt_fail(err, MT_ERR_ARG, "vocab size %lld out of range", (long long)o.vocab_size);
    if (o.num_special_tokens < nspec || o.num_special_tokens >= o.vocab_size)
        return mt_fail(err, MT_ERR_ARG, "TikTokenizer needs %d <= --tiktoken-num-special-tokens (%lld) < vocab size (%lld)", nspec,
                       (long long)o.num_special_tokens, (long long)o.vocab_size);
    for (int k = 0; k < 7; k++) {
        int have = 0;
        for (int j = 0; j < nspec; j++) have |= !strcmp(specials[j], mtk__megatron_specials[k]);
        if (!have) return mt_fail(err, MT_ERR_ARG, "TikTokenizer special tokens must include %s (<unk> <s> </s> <mask> <pad> <cls> <sep>)", mtk__megatron_specials[k]);
    }
    for (int k = 0; k < nspec; k++)
        for (int j = 0; j < k; j++)
            if (!strcmp(specials[j], specials[k])) return mt_fail(err, MT_ERR_ARG, "TikTokenizer special token %s given twice", specials[k]);
    int64_t inner = o.vocab_size - o.num_special_tokens;
    mt_tokenizer* tok = mtk__tok_new(MT_TOKENIZER_TIKTOKENIZER);
    if (!tok) return mt_fail(err, MT_ERR_OOM, "out of memory");
    tok->split = !strcmp(o.pattern, "v1") ? MTK__SPLIT_TIKTOKEN_V1 : MTK__SPLIT_TIKTOKEN_V2;
    tok->shortcut_all = 1;
    if ((st = mt_json_parse_file(&vocab, json_path, err))) {
        FILE* f = st == MT_ERR_FORMAT ? fopen(json_path, "rb") : NULL;
        char head[64] = {0};
        if (f) {
            size_t got = fread(head, 1, sizeof(head) - 1, f);
            fclose(f);
            head[got] = 0;
            char* sp = strchr(head, ' ');
            if (sp && sp > head && sp[1] >= '0' && sp[1] <= '9' && mtk__b64((uint8_t)head[0]) >= 0) /* "<base64> <rank>" */
                st = mt_fail(err, MT_ERR_FORMAT, "%s is a tiktoken rank file, not Megatron's JSON vocabulary: use --tokenizer-type "
                             "TiktokenFileTokenizer", json_path);
        }
        goto done;
    }
    if (vocab->type != MT_JSON_ARRAY) {
        st = mt_fail(err, MT_ERR_FORMAT, "%s: Megatron's TikTokenizer reads a JSON list of {rank, token_bytes, token_str}, not %s (a tiktoken "
                     "rank file is --tokenizer-type TiktokenFileTokenizer)", json_path, mtk__jtype(vocab));
        goto done;
    }
    if (vocab->count < inner) {
        st = mt_fail(err, MT_ERR_FORMAT, "%s: %d tokens, fewer than vocab size %lld - %lld special tokens", json_path, vocab->count,
                     (long long)o.vocab_size, (long long)o.num_special_tokens);
        goto done;
    }
    if (!(tmp = (uint8_t*)malloc(64 * 1024))) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); goto done; }
    for (int64_t i = 0; i < inner && st == MT_OK; i++) {
        const mt_json* e = &vocab->items[i];
        const mt_json* rank = mt_json_get(e, "rank");
        const char* b64 = mtk__jstr(e, "token_bytes");
        if (e->type != MT_JSON_OBJECT || e->count != 3 || !rank || !rank->is_integer || rank->integer != i || !b64 || !mtk__jstr(e, "token_str")) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: entry %lld is not {\"rank\": %lld, \"token_bytes\": ..., \"token_str\": ...}", json_path,
                         (long long)i, (long long)i);
            break;
        }
        long nb = strlen(b64) <= 64 * 1024 ? mtk__b64_decode((const uint8_t*)b64, strlen(b64), tmp) : -1;
        if (nb <= 0 || (i < 256 && (nb != 1 || tmp[0] != i))) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: entry %lld: bad token_bytes '%.40s'", json_path, (long long)i, b64);
            break;
        }
        st = mtk__tok_add(tok, tmp, (size_t)nb, (uint32_t)(i + o.num_special_tokens), i + o.num_special_tokens, 1, err); /* rank order = id order */
    }
    if (st || (st = mtk__tok_index(tok, json_path, err)) || (st = mtk__pairs_from_ranks(tok, err))) goto done;
    for (int64_t k = 0; k < o.num_special_tokens && st == MT_OK; k++) { /* matched in text: allowed_special="all" */
        char filler[32];
        const char* name = filler;
        if (k < nspec) name = specials[k];
        else snprintf(filler, sizeof(filler), "<SPECIAL_%lld>", (long long)k);
        st = mtk__added_add(tok, name, strlen(name), k, 1, 0, 0, 0, 1, err);
    }
    if (st || (st = mtk__tok_finish(tok, json_path, err))) goto done;
    tok->eod = mt_tokenizer_token_id(tok, "</s>", 4);
    tok->bos = mt_tokenizer_token_id(tok, "<s>", 3);
done:
    mt_json_free(vocab);
    free(tmp);
    if (st != MT_OK) { mt_tokenizer_free(tok); return st; }
    *out = tok;
    return MT_OK;
}

void mt_tokenizer_args_init(mt_tokenizer_args* args) {
    memset(args, 0, sizeof(*args));
    args->tiktoken_num_special_tokens = 1000;
}

mt_status mt_tokenizer_load_by_type(mt_tokenizer** out, const mt_tokenizer_args* a, mt_error* err) {
    const char* type = a->type;
    *out = NULL;
    if (!type) return mt_fail(err, MT_ERR_ARG, "--tokenizer-type is required");
    if (!strcmp(type, "GPT2BPETokenizer")) {
        if (!a->vocab_file || !a->merge_file) return mt_fail(err, MT_ERR_ARG, "GPT2BPETokenizer needs --vocab-file and --merge-file");
        return mt_tokenizer_load_gpt2(out, a->vocab_file, a->merge_file, err);
    }
    if (!strcmp(type, "HuggingFaceTokenizer")) {
        if (!a->model) return mt_fail(err, MT_ERR_ARG, "HuggingFaceTokenizer needs --tokenizer-model (a directory with tokenizer.json, or the file)");
        if (a->vocab_file || a->merge_file)
            return mt_fail(err, MT_ERR_ARG, "HuggingFaceTokenizer reads --tokenizer-model's tokenizer.json; drop --vocab-file/--merge-file");
        return mt_tokenizer_load_hf(out, a->model, !a->hf_no_include_special_tokens, err);
    }
    if (!strcmp(type, "TikTokenizer")) {
        mt_tiktokenizer_options o;
        mt_tiktokenizer_options_init(&o);
        if (!a->model) return mt_fail(err, MT_ERR_ARG, "TikTokenizer needs --tokenizer-model (Megatron's JSON vocabulary)");
        if (a->tiktoken_pattern) o.pattern = a->tiktoken_pattern;
        if (a->vocab_size) o.vocab_size = a->vocab_size;
        o.num_special_tokens = a->tiktoken_num_special_tokens;
        o.special_tokens = a->special_tokens;
        o.num_given_special_tokens = a->num_special_tokens;
        return mt_tokenizer_load_tiktokenizer(out, a->model, &o, err);
    }
    if (!strcmp(type, "TiktokenFileTokenizer") || !strcmp(type, "Llama3Tokenizer")) {
        mt_tokenizer_kind kind;
        mt_status st;
        if (!a->model) return mt_fail(err, MT_ERR_ARG, "%s needs --tokenizer-model", type);
        if (!strcmp(type, "Llama3Tokenizer")) {
            kind = MT_TOKENIZER_LLAMA3;
            if (a->tiktoken_encoding && strcmp(a->tiktoken_encoding, "llama3"))
                return mt_fail(err, MT_ERR_ARG, "Llama3Tokenizer takes Llama-3's tokenizer.model (--tiktoken-encoding llama3)");
        } else if (a->tiktoken_encoding) {
            if ((st = mt_tokenizer_kind_from_name(a->tiktoken_encoding, &kind, err))) return st;
        } else if (!mt_tokenizer_kind_from_path(a->model, &kind)) {
            return mt_fail(err, MT_ERR_ARG, "cannot tell the encoding of %s from its name: give --tiktoken-encoding r50k_base|cl100k_base|o200k_base",
                           a->model);
        }
        if (!strcmp(type, "TiktokenFileTokenizer") && kind == MT_TOKENIZER_LLAMA3)
            return mt_fail(err, MT_ERR_ARG, "%s is Llama-3's: use --tokenizer-type Llama3Tokenizer", a->model);
        return mt_tokenizer_load_tiktoken(out, a->model, kind, err);
    }
    if (!strcmp(type, "NullTokenizer")) {
        if (a->vocab_size <= 0) return mt_fail(err, MT_ERR_ARG, "NullTokenizer needs --vocab-size");
        return MT_OK;
    }
    if (!strcmp(type, "SentencePieceTokenizer") || !strcmp(type, "GPTSentencePieceTokenizer") || !strcmp(type, "Llama2Tokenizer"))
        return mt_fail(err, MT_ERR_ARG,
                       "--tokenizer-type %s reads a SentencePiece .model file, which this build does not; use --tokenizer-type "
                       "HuggingFaceTokenizer with the model's tokenizer.json",
                       type);
    if (!strcmp(type, "BertWordPieceLowerCase") || !strcmp(type, "BertWordPieceCase"))
        return mt_fail(err, MT_ERR_ARG, "--tokenizer-type %s: BERT WordPiece tokenizers are not implemented (GPT models only)", type);
    if (!strcmp(type, "MultimodalTokenizer") || !strcmp(type, "NullMultimodalTokenizer") || !strcmp(type, "SFTTokenizer"))
        return mt_fail(err, MT_ERR_ARG, "--tokenizer-type %s is not implemented (text pretraining only)", type);
    return mt_fail(err, MT_ERR_ARG,
                   "--tokenizer-type %s is unknown (GPT2BPETokenizer, HuggingFaceTokenizer, TikTokenizer, NullTokenizer; this build's "
                   "own TiktokenFileTokenizer, Llama3Tokenizer)",
                   type);
}

/* ---------------------------------------------------------------------------------------------- */
/* B. JSON lines                                                                                  */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t* p;     /* cursor */
    const uint8_t* start;
    const uint8_t* end;
    mt_error* err;
} mtk__json;

static mt_status mtk__json_fail(mtk__json* j, const char* what) {
    if (j->p >= j->end) return mt_fail(j->err, MT_ERR_FORMAT, "malformed JSON: %s at the end of the line", what);
    return mt_fail(j->err, MT_ERR_FORMAT, "malformed JSON: %s at column %lld", what, (long long)(j->p - j->start) + 1);
}

static inline void mtk__json_ws(mtk__json* j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

/* Whether any of the 8 bytes at p is a quote, a backslash or a control character (< 0x20). */
static inline int mtk__json_special8(const uint8_t* p) {
    const uint64_t ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
    uint64_t w;
    memcpy(&w, p, 8);
    uint64_t quote = w ^ (ones * '"'), slash = w ^ (ones * '\\');
    uint64_t control = (w - ones * 0x20) & ~w & high;                                               /* a byte < 0x20 */
    return (control | ((quote - ones) & ~quote & high) | ((slash - ones) & ~slash & high)) != 0; /* a byte 0 */
}

static inline int mtk__hex4(const uint8_t* p, uint32_t* out) {
    uint32_t v = 0;
    for (int k = 0; k < 4; k++) {
        uint8_t c = p[k];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

/* Parses the string at j->p (on its opening quote). Without escapes the result is the input span
 * (*in_scratch = 0, *off = offset in the line); with escapes it is decoded into *scratch at
 * *off (*in_scratch = 1). scratch == NULL: validate only. */
static mt_status mtk__json_string(mtk__json* j, char** scratch, size_t* scratch_used, size_t* scratch_cap, int* in_scratch,
                                 size_t* off, size_t* len) {
    const uint8_t* q = ++j->p;
    int escapes = 0;
    for (;;) {
        /* Skip 8 bytes at a time while none is a quote, a backslash or a control character. */
        while (j->end - q >= 8 && !mtk__json_special8(q)) q += 8;
        if (q >= j->end || *q == '"') break;
        if (*q < 0x20) { j->p = q; return mtk__json_fail(j, "control character in a string"); }
        if (*q == '\\') {
            escapes = 1;
            if (j->end - q < 2) { q = j->end; break; }
            q++;
        }
        q++;
    }
    if (q >= j->end) { j->p = j->end; return mtk__json_fail(j, "unterminated string"); }
    if (!escapes || !scratch) {
        if (escapes) { /* validate the escapes without storing */
            for (const uint8_t* r = j->p; r < q; r++) {
                if (*r != '\\') continue;
                r++;
                if (*r == 'u') {
                    uint32_t u;
                    if (q - r < 5 || !mtk__hex4(r + 1, &u)) { j->p = r - 1; return mtk__json_fail(j, "bad \\u escape"); }
                    r += 4;
                } else if (*r == 0 || !strchr("\"\\/bfnrt", *r)) {
                    j->p = r - 1;
                    return mtk__json_fail(j, "bad escape");
                }
            }
        }
        if (in_scratch) *in_scratch = 0;
        if (off) *off = (size_t)(j->p - j->start);
        if (len) *len = (size_t)(q - j->p);
        j->p = q + 1;
        return MT_OK;
    }
    /* Decoded output is never longer than the escaped input. */
    size_t need = *scratch_used + (size_t)(q - j->p) + 1;
    if (need > *scratch_cap) {
        size_t cap = *scratch_cap ? *scratch_cap : 4096;
        while (cap < need) cap *= 2;
        char* ns = (char*)realloc(*scratch, cap);
        if (!ns) return mt_fail(j->err, MT_ERR_OOM, "out of memory parsing JSON");
        *scratch = ns;
        *scratch_cap = cap;
    }
    uint8_t* o = (uint8_t*)*scratch + *scratch_used;
    uint8_t* o0 = o;
    const uint8_t* r = j->p;
    while (r < q) {
        if (q - r >= 8 && !mtk__json_special8(r)) { /* no escape among the next 8 bytes */
            memcpy(o, r, 8);
            o += 8;
            r += 8;
            continue;
        }
        if (*r != '\\') { *o++ = *r++; continue; }
        uint8_t c = r[1];
        switch (c) {
            case '"': *o++ = '"'; break;
            case '\\': *o++ = '\\'; break;
            case '/': *o++ = '/'; break;
            case 'b': *o++ = '\b'; break;
            case 'f': *o++ = '\f'; break;
            case 'n': *o++ = '\n'; break;
            case 'r': *o++ = '\r'; break;
            case 't': *o++ = '\t'; break;
            case 'u': {
                uint32_t u, lo;
                if (q - r < 6 || !mtk__hex4(r + 2, &u)) { j->p = r; return mtk__json_fail(j, "bad \\u escape"); }
                r += 6;
                if (u >= 0xD800 && u < 0xDC00 && q - r >= 6 && r[0] == '\\' && r[1] == 'u' && mtk__hex4(r + 2, &lo) &&
                    lo >= 0xDC00 && lo < 0xE000) {
                    u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                    r += 6;
                } else if (u >= 0xD800 && u < 0xE000) {
                    u = 0xFFFD; /* a lone surrogate */
                }
                o += mtk__utf8_put(o, u);
                continue;
            }
            default: j->p = r; return mtk__json_fail(j, "bad escape");
        }
        r += 2;
    }
    if (in_scratch) *in_scratch = 1;
    if (off) *off = *scratch_used;
    if (len) *len = (size_t)(o - o0);
    *scratch_used += (size_t)(o - o0);
    j->p = q + 1;
    return MT_OK;
}

static const char* mtk__json_type(uint8_t c) {
    if (c == '"') return "a string";
    if (c == '{') return "an object";
    if (c == '[') return "an array";
    if (c == 't' || c == 'f') return "a boolean";
    if (c == 'n') return "null";
    return "a number";
}

static int mtk__json_lit(mtk__json* j, const char* lit) {
    size_t n = strlen(lit);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, lit, n) != 0) return 0;
    j->p += n;
    return 1;
}

static mt_status mtk__json_value(mtk__json* j, int depth);

static mt_status mtk__json_number(mtk__json* j) {
    const uint8_t* p = j->p;
    if (p < j->end && *p == '-') {
        p++;
        j->p = p;
        if (mtk__json_lit(j, "Infinity")) return MT_OK;
    }
    if (p >= j->end || *p < '0' || *p > '9') { j->p = p; return mtk__json_fail(j, "expected a value"); }
    if (*p == '0') p++;
    else while (p < j->end && *p >= '0' && *p <= '9') p++;
    if (p < j->end && *p == '.') {
        p++;
        if (p >= j->end || *p < '0' || *p > '9') { j->p = p; return mtk__json_fail(j, "bad number"); }
        while (p < j->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < j->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < j->end && (*p == '+' || *p == '-')) p++;
        if (p >= j->end || *p < '0' || *p > '9') { j->p = p; return mtk__json_fail(j, "bad number"); }
        while (p < j->end && *p >= '0' && *p <= '9') p++;
    }
    j->p = p;
    return MT_OK;
}

/* Skips (validates) one value at j->p. */
static mt_status mtk__json_value(mtk__json* j, int depth) {
    mt_status st;
    if (j->p >= j->end) return mtk__json_fail(j, "expected a value");
    if (depth > 512) return mtk__json_fail(j, "nesting deeper than 512");
    uint8_t c = *j->p;
    if (c == '"') return mtk__json_string(j, NULL, NULL, NULL, NULL, NULL, NULL);
    if (c == '{' || c == '[') {
        uint8_t close = c == '{' ? '}' : ']';
        j->p++;
        mtk__json_ws(j);
        if (j->p < j->end && *j->p == close) { j->p++; return MT_OK; }
        for (;;) {
            if (c == '{') {
                if (j->p >= j->end || *j->p != '"') return mtk__json_fail(j, "expected a key");
                if ((st = mtk__json_string(j, NULL, NULL, NULL, NULL, NULL, NULL))) return st;
                mtk__json_ws(j);
                if (j->p >= j->end || *j->p != ':') return mtk__json_fail(j, "expected ':'");
                j->p++;
                mtk__json_ws(j);
            }
            if ((st = mtk__json_value(j, depth + 1))) return st;
            mtk__json_ws(j);
            if (j->p < j->end && *j->p == ',') { j->p++; mtk__json_ws(j); continue; }
            if (j->p < j->end && *j->p == close) { j->p++; return MT_OK; }
            return mtk__json_fail(j, c == '{' ? "expected ',' or '}'" : "expected ',' or ']'");
        }
    }
    if (mtk__json_lit(j, "true") || mtk__json_lit(j, "false") || mtk__json_lit(j, "null") || mtk__json_lit(j, "NaN") ||
        mtk__json_lit(j, "Infinity"))
        return MT_OK;
    return mtk__json_number(j);
}

mt_status mt_json_object_strings(const char* line, size_t len, const char* const* keys, int num_keys, const char** values,
                                 size_t* lengths, char** scratch, size_t* scratch_cap, mt_error* err) {
    mtk__json j;
    mt_status st;
    size_t used = 0;
    /* Found values: offset, length, and 1 + in_scratch (0: missing). */
    enum { MAXK = 64 };
    size_t voff[MAXK], vlen[MAXK];
    int vfound[MAXK];
    if (num_keys > MAXK) return mt_fail(err, MT_ERR_ARG, "at most %d JSON keys", (int)MAXK);
    for (int k = 0; k < num_keys; k++) vfound[k] = 0;
    j.p = j.start = (const uint8_t*)line;
    j.end = j.p + len;
    j.err = err;
    mtk__json_ws(&j);
    if (j.p >= j.end || *j.p != '{') {
        if (j.p < j.end && *j.p && strchr("\"[tfn-0123456789NI", *j.p))
            return mt_fail(err, MT_ERR_FORMAT, "the line is %s, not a JSON object", mtk__json_type(*j.p));
        return mtk__json_fail(&j, "expected '{'");
    }
    j.p++;
    mtk__json_ws(&j);
    if (j.p < j.end && *j.p == '}') j.p++;
    else for (;;) {
        if (j.p >= j.end || *j.p != '"') return mtk__json_fail(&j, "expected a key");
        /* The key, decoded when it has escapes (into scratch, then dropped again). */
        size_t koff, klen, key_mark = used;
        int kscr;
        if ((st = mtk__json_string(&j, scratch, &used, scratch_cap, &kscr, &koff, &klen))) return st;
        const char* kp = kscr ? *scratch + koff : line + koff;
        int match = -1;
        for (int k = 0; k < num_keys; k++)
            if (strlen(keys[k]) == klen && memcmp(keys[k], kp, klen) == 0) { match = k; break; }
        used = key_mark;
        mtk__json_ws(&j);
        if (j.p >= j.end || *j.p != ':') return mtk__json_fail(&j, "expected ':' after a key");
        j.p++;
        mtk__json_ws(&j);
        if (match >= 0) {
            if (j.p >= j.end) return mtk__json_fail(&j, "expected a value");
            if (*j.p != '"') {
                uint8_t first = *j.p;
                if ((st = mtk__json_value(&j, 1))) return st; /* malformed beats "not a string" */
                return mt_fail(err, MT_ERR_FORMAT, "the value of key '%s' is %s, not a string", keys[match],
                               mtk__json_type(first));
            }
            int vscr;
            if ((st = mtk__json_string(&j, scratch, &used, scratch_cap, &vscr, &voff[match], &vlen[match]))) return st;
            vfound[match] = 1 + vscr;
        } else if ((st = mtk__json_value(&j, 1))) {
            return st;
        }
        mtk__json_ws(&j);
        if (j.p < j.end && *j.p == ',') { j.p++; mtk__json_ws(&j); continue; }
        if (j.p < j.end && *j.p == '}') { j.p++; break; }
        return mtk__json_fail(&j, "expected ',' or '}'");
    }
    mtk__json_ws(&j);
    if (j.p < j.end) return mtk__json_fail(&j, "extra data after the object");
    for (int k = 0; k < num_keys; k++) {
        if (!vfound[k]) return mt_fail(err, MT_ERR_FORMAT, "missing key '%s'", keys[k]);
        values[k] = vfound[k] == 2 ? *scratch + voff[k] : line + voff[k];
        lengths[k] = vlen[k];
    }
    return MT_OK;
}
/* ---------------------------------------------------------------------------------------------- */
/* C. The preprocess_data pipeline                                                                */
/* ---------------------------------------------------------------------------------------------- */
/* The calling thread reads the input in batches of whole lines (JSONL) or whole files (text) and
 * writes the results; `workers` threads parse and encode batches. A ring of 2*workers+2 batch slots
 * bounds the memory; batches are written strictly in input order, so the output does not depend
 * on the number of workers or on their timing. */

/* ---- input streams: plain files, and .gz / .zst when the build has zlib / zstd ---- */
/* An input may be any file Megatron could read: a regular file, a FIFO or a pipe (/dev/stdin), a
 * device. None may block the run past a cancellation: the file is opened with O_NONBLOCK (opening a
 * FIFO that has no writer yet returns at once) and every wait for bytes is a poll() of at most
 * MTK__POLL_MS, after which *cancel is checked again, so no signal can slip in between a check
 * and a blocking call. (On Linux a FIFO opened so reports nothing to poll() until a writer comes.)
 * zlib reads its file itself: a .gz input is switched back to blocking reads once its first bytes
 * are there, and a signal (the handler installed without SA_RESTART) ends a read that waits. */

#define MTK__POLL_MS 100

typedef struct {
    const char* path;
    mt_status status; /* why the last read failed */
    int fd;          /* plain and .zst; -1 when closed */
    const volatile sig_atomic_t* cancel;
#if defined(MT_HAVE_ZLIB)
    gzFile gz;
#endif
#if defined(MT_HAVE_ZSTD)
    ZSTD_DStream* zs;
    uint8_t* zbuf;   /* compressed bytes read, not yet decompressed: zbuf[zpos .. zlen) */
    size_t zpos, zlen, zcap;
    int zframe_open; /* inside a frame (the input must not end here) */
#endif
} mtk__in;

const char* mt_preprocess_compressions(void) {
#if defined(MT_HAVE_ZLIB) && defined(MT_HAVE_ZSTD)
    return ".gz .zst";
#elif defined(MT_HAVE_ZLIB)
    return ".gz";
#elif defined(MT_HAVE_ZSTD)
    return ".zst";
#else
    return "";
#endif
}

static int mtk__ends_with(const char* s, const char* suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

/* Waits until fd has bytes (or its end) to read, checking *cancel every MTK__POLL_MS. */
static mt_status mtk__in_wait(mtk__in* in, mt_error* err) {
    for (;;) {
        if (mtk__cancelled(in->cancel)) return in->status = mt_fail(err, MT_ERR_IO, "interrupted");
        struct pollfd p;
        p.fd = in->fd;
        p.events = POLLIN;
        p.revents = 0;
        int r = poll(&p, 1, MTK__POLL_MS);
        if (r > 0) return MT_OK;
        if (r < 0 && errno != EINTR && errno != EAGAIN)
            return in->status = mt_fail(err, MT_ERR_IO, "error reading %s: %s", in->path, strerror(errno));
    }
}

/* Up to n bytes from the file: the count (fewer only at its end), 0 at the end, or -1 (in->status). */
static long mtk__in_read_fd(mtk__in* in, uint8_t* buf, size_t n, mt_error* err) {
    size_t got = 0;
    while (got < n) {
        if (mtk__in_wait(in, err) != MT_OK) return -1;
        ssize_t r = read(in->fd, buf + got, n - got);
        if (r == 0) break;
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            in->status = mt_fail(err, MT_ERR_IO, "error reading %s: %s", in->path, strerror(errno));
            return -1;
        }
        got += (size_t)r;
    }
    return (long)got;
}

static void mtk__in_close(mtk__in* in) {
#if defined(MT_HAVE_ZLIB)
    if (in->gz) { gzclose(in->gz); in->fd = -1; } /* (gzclose closes the fd) */
#endif
#if defined(MT_HAVE_ZSTD)
    if (in->zs) { ZSTD_freeDStream(in->zs); free(in->zbuf); }
#endif
    if (in->fd >= 0) close(in->fd);
    memset(in, 0, sizeof(*in));
    in->fd = -1;
}

static mt_status mtk__in_open(mtk__in* in, const char* path, const volatile sig_atomic_t* cancel, mt_error* err) {
    memset(in, 0, sizeof(*in));
    in->fd = -1;
    in->path = path;
    in->cancel = cancel;
    int gz = mtk__ends_with(path, ".gz"), zst = mtk__ends_with(path, ".zst");
#if !defined(MT_HAVE_ZLIB)
    if (gz) return mt_fail(err, MT_ERR_IO, "cannot read %s: this build has no zlib (install zlib's headers, e.g. zlib1g-dev, and rebuild)", path);
#endif
#if !defined(MT_HAVE_ZSTD)
    if (zst) return mt_fail(err, MT_ERR_IO, "cannot read %s: this build has no zstd (install zstd's headers, e.g. libzstd-dev, and rebuild)", path);
#endif
    do {
        if (mtk__cancelled(cancel)) return mt_fail(err, MT_ERR_IO, "interrupted");
        in->fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    } while (in->fd < 0 && errno == EINTR);
    if (in->fd < 0) return mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
#if defined(MT_HAVE_ZLIB)
    if (gz) {
        int flags = fcntl(in->fd, F_GETFL);
        mt_status st = mtk__in_wait(in, err); /* a FIFO: its writer has come */
        if (st == MT_OK && (flags < 0 || fcntl(in->fd, F_SETFL, flags & ~O_NONBLOCK) != 0))
            st = mt_fail(err, MT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        if (st == MT_OK && !(in->gz = gzdopen(in->fd, "rb")))
            st = mt_fail(err, MT_ERR_OOM, "out of memory opening %s", path);
        if (st != MT_OK) { mtk__in_close(in); return st; }
        gzbuffer(in->gz, 1 << 17);
        return MT_OK;
    }
#endif
#if defined(MT_HAVE_ZSTD)
    if (zst) {
        in->zs = ZSTD_createDStream();
        in->zcap = ZSTD_DStreamInSize();
        in->zbuf = (uint8_t*)malloc(in->zcap);
        if (!in->zs || !in->zbuf || ZSTD_isError(ZSTD_initDStream(in->zs))) {
            mtk__in_close(in);
            return mt_fail(err, MT_ERR_OOM, "out of memory opening %s", path);
        }
    }
#endif
    (void)gz;
    (void)zst;
    return MT_OK;
}

/* Reads up to n decompressed bytes: the count, 0 at the end, or -1 (MT_ERR_IO / MT_ERR_FORMAT in err;
 * "interrupted" once *cancel is set). */
static long mtk__in_read(mtk__in* in, uint8_t* buf, size_t n, mt_error* err) {
    if (n > ((size_t)1 << 30)) n = (size_t)1 << 30;
    if (mtk__cancelled(in->cancel)) { in->status = mt_fail(err, MT_ERR_IO, "interrupted"); return -1; }
#if defined(MT_HAVE_ZLIB)
    if (in->gz) {
        int got = gzread(in->gz, buf, (unsigned)n);
        if (got < 0) {
            int code = 0;
            const char* msg = gzerror(in->gz, &code);
            if (mtk__cancelled(in->cancel)) in->status = mt_fail(err, MT_ERR_IO, "interrupted"); /* a read the signal ended */
            else if (code == Z_ERRNO) in->status = mt_fail(err, MT_ERR_IO, "error reading %s: %s", in->path, strerror(errno));
            else in->status = mt_fail(err, MT_ERR_FORMAT, "%s: corrupt gzip data (%s)", in->path, msg ? msg : "?");
            return -1;
        }
        return got;
    }
#endif
#if defined(MT_HAVE_ZSTD)
    if (in->zs) {
        ZSTD_outBuffer ob = {buf, n, 0};
        while (ob.pos < n) { /* fill the buffer, as a plain read does */
            if (in->zpos == in->zlen) {
                long r = mtk__in_read_fd(in, in->zbuf, in->zcap, err);
                if (r < 0) return -1;
                in->zlen = (size_t)r;
                in->zpos = 0;
                if (in->zlen == 0) {
                    if (in->zframe_open) { in->status = mt_fail(err, MT_ERR_FORMAT, "%s: truncated zstd data", in->path); return -1; }
                    break;
                }
            }
            ZSTD_inBuffer ib = {in->zbuf, in->zlen, in->zpos};
            size_t r = ZSTD_decompressStream(in->zs, &ob, &ib);
            in->zpos = ib.pos;
            if (ZSTD_isError(r)) { in->status = mt_fail(err, MT_ERR_FORMAT, "%s: corrupt zstd data (%s)", in->path, ZSTD_getErrorName(r)); return -1; }
            in->zframe_open = r != 0;
        }
        return (long)ob.pos;
    }
#endif
    return mtk__in_read_fd(in, buf, n, err);
}

static int mtk__in_is_open(const mtk__in* in) { return in->fd >= 0; }

enum { MTK__PP_EMPTY = 0, MTK__PP_READY, MTK__PP_BUSY, MTK__PP_DONE };

typedef struct {
    int64_t seq;
    int state;
    int file;             /* index into the expanded input list */
    int64_t first_line;   /* 1-based line number of the batch's first line (JSONL) */
    uint8_t* data;        /* the input bytes */
    size_t len, cap;
    size_t* doc_end;      /* text mode: end offset of each file's document in data */
    size_t num_text_docs, doc_end_cap;
    /* Results, per key k: tokens[k][0..ntok[k]); doc_len[d * num_keys + k] tokens of document d. */
    int32_t** tokens;
    size_t *ntok, *tcap;
    int64_t* doc_len;
    size_t num_docs, doc_len_cap;
    int64_t bad_lines, blank_lines;
    char* bad_msgs;       /* "file:line: problem\n" for each skipped line */
    size_t bad_len, bad_cap;
    mt_status status;     /* a failure stops the run */
    char message[sizeof(((mt_error*)0)->message)];
} mtk__pp_batch;

typedef struct {
    const mt_preprocess_config* cfg;
    const char* const* keys;
    int num_keys;
    char** files;
    int num_files;
    int64_t bytes_total;
    /* reader (calling thread only) */
    int cur;
    mtk__in in;
    int64_t line;
    uint8_t* carry;
    size_t carry_len, carry_cap;
    size_t batch_bytes, max_line;
    /* shared with the workers, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    int quit;
    mtk__pp_batch* slots;
    int num_slots;
} mtk__pp_ctx;

static int mtk__grow(void** p, size_t* cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 16;
    while (c < need) c *= 2;
    void* np = realloc(*p, c * elem);
    if (!np) return -1;
    *p = np;
    *cap = c;
    return 0;
}

static double mtk__now(void) {
    struct timespec ts;
    timespec_get(&ts, TIME_UTC);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the input files ---- */

static int mtk__cmp_str(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }

static mt_status mtk__pp_add_file(mtk__pp_ctx* c, const char* path, size_t* cap, int64_t size, mt_error* err) {
    if (mtk__grow((void**)&c->files, cap, (size_t)c->num_files + 1, sizeof(char*))) return mt_fail(err, MT_ERR_OOM, "out of memory");
    char* s = (char*)malloc(strlen(path) + 1);
    if (!s) return mt_fail(err, MT_ERR_OOM, "out of memory");
    strcpy(s, path);
    c->files[c->num_files++] = s;
    c->bytes_total += size;
    return MT_OK;
}

/* Every regular file under dir: depth first, each directory's entries sorted by name (strcmp),
 * names starting with '.' skipped. */
static mt_status mtk__pp_add_dir(mtk__pp_ctx* c, const char* dir, size_t* cap, int depth, mt_error* err) {
    if (depth > 64) return mt_fail(err, MT_ERR_IO, "%s: directories nested too deep", dir);
    DIR* d = opendir(dir);
    if (!d) return mt_fail(err, MT_ERR_IO, "cannot open directory %s: %s", dir, strerror(errno));
    char** names = NULL;
    size_t n = 0, ncap = 0;
    mt_status st = MT_OK;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        size_t l = strlen(dir) + strlen(e->d_name) + 2;
        char* p = (char*)malloc(l);
        if (!p || mtk__grow((void**)&names, &ncap, n + 1, sizeof(char*))) { free(p); st = mt_fail(err, MT_ERR_OOM, "out of memory"); break; }
        snprintf(p, l, "%s%s%s", dir, dir[strlen(dir) - 1] == '/' ? "" : "/", e->d_name);
        names[n++] = p;
    }
    closedir(d);
    if (n) qsort(names, n, sizeof(char*), mtk__cmp_str);
    for (size_t k = 0; k < n && st == MT_OK; k++) {
        struct stat sb;
        if (stat(names[k], &sb) != 0) st = mt_fail(err, MT_ERR_IO, "cannot stat %s: %s", names[k], strerror(errno));
        else if (S_ISDIR(sb.st_mode)) st = mtk__pp_add_dir(c, names[k], cap, depth + 1, err);
        else if (S_ISREG(sb.st_mode)) st = mtk__pp_add_file(c, names[k], cap, (int64_t)sb.st_size, err);
    }
    for (size_t k = 0; k < n; k++) free(names[k]);
    free(names);
    return st;
}

/* ---- reading batches (calling thread) ---- */

static size_t mtk__count_lines(const uint8_t* p, size_t n) {
    size_t k = 0;
    const uint8_t* end = p + n;
    while (p < end && (p = (const uint8_t*)memchr(p, '\n', (size_t)(end - p))) != NULL) { k++; p++; }
    return k;
}

/* The one message for a line over the limit (the reader and the workers both find them). */
static void mtk__line_too_long(char* out, size_t cap, const char* path, int64_t line, size_t limit) {
    if (line > 0) snprintf(out, cap, "%.400s: line %lld is longer than --max-line-bytes (%zu)", path, (long long)line, limit);
    else snprintf(out, cap, "%.400s is longer than --max-line-bytes (%zu): text input reads each file as one document", path, limit);
}

/* Next batch of whole lines of one file into b; *got = 0 when the input is exhausted. */
static mt_status mtk__pp_read_jsonl(mtk__pp_ctx* c, mtk__pp_batch* b, int* got, mt_error* err) {
    *got = 0;
    while (c->cur < c->num_files) {
        const char* path = c->files[c->cur];
        mt_status st;
        if (!mtk__in_is_open(&c->in)) {
            if ((st = mtk__in_open(&c->in, path, c->cfg->cancel, err))) return st;
            c->line = 1;
            c->carry_len = 0;
        }
        b->file = c->cur;
        b->first_line = c->line;
        b->len = 0;
        if (mtk__grow((void**)&b->data, &b->cap, c->carry_len + c->batch_bytes + 1, 1)) return mt_fail(err, MT_ERR_OOM, "out of memory");
        if (c->carry_len) memcpy(b->data, c->carry, c->carry_len);
        b->len = c->carry_len;
        c->carry_len = 0;
        for (;;) {
            if (mtk__grow((void**)&b->data, &b->cap, b->len + c->batch_bytes + 1, 1)) return mt_fail(err, MT_ERR_OOM, "out of memory");
            long got_n = mtk__in_read(&c->in, b->data + b->len, c->batch_bytes, err);
            if (got_n < 0) { st = c->in.status; mtk__in_close(&c->in); return st; }
            size_t n = (size_t)got_n;
            if (n == 0) {
                mtk__in_close(&c->in);
                c->cur++;
                if (b->len == 0) break; /* an empty file or one that ended on a batch boundary */
                c->line += (int64_t)mtk__count_lines(b->data, b->len);
                *got = 1;
                return MT_OK;
            }
            size_t k = n;
            while (k > 0 && b->data[b->len + k - 1] != '\n') k--;
            b->len += n;
            if (k > 0) { /* cut after the last newline; the rest starts the next batch */
                size_t cut = b->len - n + k;
                size_t rest = b->len - cut;
                if (mtk__grow((void**)&c->carry, &c->carry_cap, rest + 1, 1)) return mt_fail(err, MT_ERR_OOM, "out of memory");
                memcpy(c->carry, b->data + cut, rest);
                c->carry_len = rest;
                b->len = cut;
                c->line += (int64_t)mtk__count_lines(b->data, b->len);
                *got = 1;
                return MT_OK;
            }
            /* no newline yet: a line longer than the batch size, keep reading unless it is too long */
            if (b->len > c->max_line) {
                char msg[sizeof(err->message)];
                mtk__line_too_long(msg, sizeof(msg), path, c->line, c->max_line);
                mtk__in_close(&c->in);
                return mt_fail(err, MT_ERR_FORMAT, "%s", msg);
            }
        }
    }
    return MT_OK;
}

/* Next batch of whole files (one document each) into b. */
static mt_status mtk__pp_read_text(mtk__pp_ctx* c, mtk__pp_batch* b, int* got, mt_error* err) {
    *got = 0;
    b->len = 0;
    b->num_text_docs = 0;
    b->file = c->cur;
    b->first_line = 0;
    while (c->cur < c->num_files && (b->num_text_docs == 0 || b->len < c->batch_bytes)) {
        const char* path = c->files[c->cur];
        mtk__in in;
        mt_status st = mtk__in_open(&in, path, c->cfg->cancel, err);
        if (st) return st;
        size_t start = b->len;
        for (;;) {
            if (mtk__grow((void**)&b->data, &b->cap, b->len + (1 << 20) + 1, 1)) { mtk__in_close(&in); return mt_fail(err, MT_ERR_OOM, "out of memory reading %s", path); }
            size_t want = b->cap - b->len - 1; /* 1 MiB at a time: the limit below is checked between reads */
            long n = mtk__in_read(&in, b->data + b->len, want < ((size_t)1 << 20) ? want : ((size_t)1 << 20), err);
            if (n < 0) { st = in.status; mtk__in_close(&in); return st; }
            b->len += (size_t)n;
            if (n == 0) break;
            if (b->len - start > c->max_line) {
                char msg[sizeof(err->message)];
                mtk__line_too_long(msg, sizeof(msg), path, 0, c->max_line);
                mtk__in_close(&in);
                return mt_fail(err, MT_ERR_FORMAT, "%s", msg);
            }
        }
        mtk__in_close(&in);
        if (mtk__grow((void**)&b->doc_end, &b->doc_end_cap, b->num_text_docs + 1, sizeof(size_t))) return mt_fail(err, MT_ERR_OOM, "out of memory");
        b->doc_end[b->num_text_docs++] = b->len;
        c->cur++;
        *got = 1;
    }
    return MT_OK;
}

/* ---- encoding a batch (worker threads) ---- */

static int mtk__pp_doc(mtk__pp_ctx* c, mtk__pp_batch* b, const char* const* vals, const size_t* lens) {
    const mt_tokenizer* tok = c->cfg->tokenizer;
    int nk = c->num_keys;
    if (mtk__grow((void**)&b->doc_len, &b->doc_len_cap, (b->num_docs + 1) * (size_t)nk, sizeof(int64_t))) return -1;
    for (int k = 0; k < nk; k++) {
        int64_t n = mtk__encode(tok, vals[k], lens[k], &b->tokens[k], &b->ntok[k], &b->tcap[k], c->cfg->cancel);
        if (n == -2) return -3;
        if (n < 0) return -1;
        if (n > 0 && c->cfg->append_eod) {
            if (mtk__grow((void**)&b->tokens[k], &b->tcap[k], b->ntok[k] + 1, sizeof(int32_t))) return -1;
            b->tokens[k][b->ntok[k]++] = mt_tokenizer_eod(tok);
            n++;
        }
        if (n > 0x7FFFFFFF) return -2;
        b->doc_len[b->num_docs * (size_t)nk + (size_t)k] = n;
    }
    b->num_docs++;
    return 0;
}

static void mtk__pp_encode(mtk__pp_ctx* c, mtk__pp_batch* b, char** scratch, size_t* scratch_cap) {
    const char* vals[64];
    size_t lens[64];
    mt_error e;
    int nk = c->num_keys, r = 0;
    b->num_docs = 0;
    b->bad_lines = b->blank_lines = 0;
    b->bad_len = 0;
    b->status = MT_OK;
    for (int k = 0; k < nk; k++) b->ntok[k] = 0;
    if (c->cfg->format == MT_INPUT_TEXT) {
        size_t start = 0;
        for (size_t d = 0; d < b->num_text_docs && r == 0; d++) {
            for (int k = 0; k < nk; k++) { vals[k] = (const char*)b->data + start; lens[k] = b->doc_end[d] - start; }
            r = mtk__pp_doc(c, b, vals, lens);
            if (r == -2) snprintf(b->message, sizeof(b->message), "%s: more than 2^31-1 tokens in one document", c->files[b->file + (int)d]);
            start = b->doc_end[d];
        }
    } else {
        const char* path = c->files[b->file];
        const uint8_t *p = b->data, *end = b->data + b->len;
        int64_t line = b->first_line;
        for (; p < end && r == 0; line++) {
            const uint8_t* nl = (const uint8_t*)memchr(p, '\n', (size_t)(end - p));
            const uint8_t* e_ = nl ? nl : end;
            if ((size_t)(e_ - p) > c->max_line) { /* (the reader stops only the lines that outgrow a batch) */
                b->status = MT_ERR_FORMAT;
                mtk__line_too_long(b->message, sizeof(b->message), path, line, c->max_line);
                return;
            }
            if (line == 1 && e_ - p >= 3 && p[0] == 0xEF && p[1] == 0xBB && p[2] == 0xBF) p += 3; /* a UTF-8 BOM */
            const uint8_t* q = p;
            while (q < e_ && (*q == ' ' || *q == '\t' || *q == '\r')) q++;
            if (q == e_) {
                b->blank_lines++;
            } else {
                mt_status st = mt_json_object_strings((const char*)p, (size_t)(e_ - p), c->keys, nk, vals, lens, scratch, scratch_cap, &e);
                if (st == MT_ERR_FORMAT && c->cfg->skip_bad_lines) {
                    char msg[sizeof(e.message) + 300];
                    int m = snprintf(msg, sizeof(msg), "%s:%lld: %s\n", path, (long long)line, e.message);
                    if (m > 0 && (size_t)m < sizeof(msg) && !mtk__grow((void**)&b->bad_msgs, &b->bad_cap, b->bad_len + (size_t)m + 1, 1)) {
                        memcpy(b->bad_msgs + b->bad_len, msg, (size_t)m + 1);
                        b->bad_len += (size_t)m;
                    }
                    b->bad_lines++;
                } else if (st != MT_OK) {
                    b->status = st;
                    snprintf(b->message, sizeof(b->message), "%s:%lld: %.400s", path, (long long)line, e.message);
                    return;
                } else {
                    r = mtk__pp_doc(c, b, vals, lens);
                    if (r == -2) snprintf(b->message, sizeof(b->message), "%s:%lld: more than 2^31-1 tokens in one document", path, (long long)line);
                }
            }
            p = e_ + 1;
        }
    }
    if (r == -1) { b->status = MT_ERR_OOM; snprintf(b->message, sizeof(b->message), "out of memory encoding documents"); }
    if (r == -2) b->status = MT_ERR_RANGE;
    if (r == -3) { b->status = MT_ERR_IO; snprintf(b->message, sizeof(b->message), "interrupted"); }
}

static void* mtk__pp_worker(void* arg) {
    mtk__pp_ctx* c = (mtk__pp_ctx*)arg;
    char* scratch = NULL;
    size_t scratch_cap = 0;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        mtk__pp_batch* b = NULL;
        while (!c->quit) {
            for (int s = 0; s < c->num_slots; s++)
                if (c->slots[s].state == MTK__PP_READY && (!b || c->slots[s].seq < b->seq)) b = &c->slots[s];
            if (b) break;
            pthread_cond_wait(&c->cv_work, &c->mu);
        }
        if (c->quit) break;
        b->state = MTK__PP_BUSY;
        pthread_mutex_unlock(&c->mu);
        mtk__pp_encode(c, b, &scratch, &scratch_cap);
        pthread_mutex_lock(&c->mu);
        b->state = MTK__PP_DONE;
        pthread_cond_broadcast(&c->cv_done);
    }
    pthread_mutex_unlock(&c->mu);
    free(scratch);
    return NULL;
}

/* ---- the run ---- */

mt_status mt_preprocess(const mt_preprocess_config* cfg, mt_preprocess_stats* stats_out, mt_error* err) {
    static const char* const default_keys[1] = {"text"};
    mtk__pp_ctx c;
    mt_preprocess_stats stats;
    mt_indexed_writer** writers = NULL;
    pthread_t* threads = NULL;
    int nthreads = 0, workers, sync_ok = 0;
    size_t files_cap = 0;
    int64_t next_read = 0, next_write = 0;
    int input_done = 0;
    size_t inflight = 0, max_inflight; /* input bytes read but not yet written: bounds memory with big files */
    double t0 = mtk__now();
    mt_status st = MT_OK;

    memset(&c, 0, sizeof(c));
    memset(&stats, 0, sizeof(stats));
    c.cfg = cfg;
    c.keys = cfg->num_json_keys > 0 ? cfg->json_keys : default_keys;
    c.num_keys = cfg->num_json_keys > 0 ? cfg->num_json_keys : 1;
    c.in.fd = -1;
    c.batch_bytes = cfg->batch_bytes ? cfg->batch_bytes : ((size_t)1 << 20);
    c.max_line = cfg->max_line_bytes ? cfg->max_line_bytes : MT_PREPROCESS_MAX_LINE;
    workers = cfg->workers > 0 ? cfg->workers : 1;
    max_inflight = (size_t)(2 * workers + 2) * c.batch_bytes;
    if (max_inflight < ((size_t)1 << 30)) max_inflight = (size_t)1 << 30;
    if (!cfg->tokenizer) return mt_fail(err, MT_ERR_ARG, "no tokenizer");
    if (cfg->append_eod && mt_tokenizer_eod(cfg->tokenizer) < 0)
        return mt_fail(err, MT_ERR_ARG, "the tokenizer has no end-of-document token to append (a Hugging Face tokenizer names it "
                                        "eos_token in tokenizer_config.json)");
    if (!cfg->output_prefix || !cfg->output_prefix[0]) return mt_fail(err, MT_ERR_ARG, "no output prefix");
    if (cfg->num_inputs < 1) return mt_fail(err, MT_ERR_ARG, "no input files");
    if (c.num_keys > 64) return mt_fail(err, MT_ERR_ARG, "at most 64 JSON keys");
    if (cfg->format == MT_INPUT_TEXT && c.num_keys != 1)
        return mt_fail(err, MT_ERR_ARG, "text input has one document per file: give at most one key (it names the output)");
    for (int k = 0; k < c.num_keys; k++)
        for (int m = 0; m < k; m++)
            if (!strcmp(c.keys[k], c.keys[m])) return mt_fail(err, MT_ERR_ARG, "JSON key '%s' given twice", c.keys[k]);

    /* The inputs: files as given, directories expanded. */
    for (int i = 0; i < cfg->num_inputs && st == MT_OK; i++) {
        struct stat sb;
        if (stat(cfg->inputs[i], &sb) != 0) st = mt_fail(err, MT_ERR_IO, "cannot open %s: %s", cfg->inputs[i], strerror(errno));
        else if (S_ISDIR(sb.st_mode)) st = mtk__pp_add_dir(&c, cfg->inputs[i], &files_cap, 0, err);
        else st = mtk__pp_add_file(&c, cfg->inputs[i], &files_cap, S_ISREG(sb.st_mode) ? (int64_t)sb.st_size : 0, err);
    }
    if (st == MT_OK && c.num_files == 0) st = mt_fail(err, MT_ERR_IO, "no input files found in %s", cfg->inputs[0]);
    stats.bytes_total = c.bytes_total;

    /* One writer per key. */
    if (st == MT_OK) {
        writers = (mt_indexed_writer**)calloc((size_t)c.num_keys, sizeof(mt_indexed_writer*));
        if (!writers) st = mt_fail(err, MT_ERR_OOM, "out of memory");
    }
    for (int k = 0; k < c.num_keys && st == MT_OK; k++) {
        size_t l = strlen(cfg->output_prefix) + strlen(c.keys[k]) + 16;
        char* prefix = (char*)malloc(l);
        if (!prefix) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); break; }
        snprintf(prefix, l, "%s_%s_document", cfg->output_prefix, c.keys[k]);
        st = mt_indexed_writer_open(&writers[k], prefix, mt_indexed_dtype_for_vocab(mt_tokenizer_vocab_size(cfg->tokenizer)), err);
        free(prefix);
    }

    /* Batch slots and the worker threads. */
    if (st == MT_OK) {
        c.num_slots = 2 * workers + 2;
        c.slots = (mtk__pp_batch*)calloc((size_t)c.num_slots, sizeof(mtk__pp_batch));
        threads = (pthread_t*)calloc((size_t)workers, sizeof(pthread_t));
        if (!c.slots || !threads) st = mt_fail(err, MT_ERR_OOM, "out of memory");
        for (int s = 0; s < c.num_slots && st == MT_OK; s++) {
            mtk__pp_batch* b = &c.slots[s];
            b->tokens = (int32_t**)calloc((size_t)c.num_keys, sizeof(int32_t*));
            b->ntok = (size_t*)calloc((size_t)c.num_keys, sizeof(size_t));
            b->tcap = (size_t*)calloc((size_t)c.num_keys, sizeof(size_t));
            if (!b->tokens || !b->ntok || !b->tcap) st = mt_fail(err, MT_ERR_OOM, "out of memory");
        }
    }
    if (st == MT_OK) {
        if (pthread_mutex_init(&c.mu, NULL) || pthread_cond_init(&c.cv_work, NULL) || pthread_cond_init(&c.cv_done, NULL))
            st = mt_fail(err, MT_ERR_CONFIG, "cannot create the thread synchronisation");
        else
            sync_ok = 1;
    }
    if (st == MT_OK) { /* the workers block every signal (they inherit the mask): a signal reaches the reading thread */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        for (int t = 0; t < workers && st == MT_OK; t++) {
            if (pthread_create(&threads[t], NULL, mtk__pp_worker, &c) != 0) st = mt_fail(err, MT_ERR_CONFIG, "cannot start worker thread %d", t);
            else nthreads++;
        }
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }

    /* Read ahead, write in order. A failure of the reader is reported once the batches read before
     * it are written (one of them may fail first): the error is always the first in input order. */
    mt_status read_st = MT_OK;
    mt_error read_err;
    read_err.message[0] = 0;
    while (st == MT_OK) {
        while (!input_done && next_read - next_write < c.num_slots && (inflight == 0 || inflight < max_inflight)) {
            mtk__pp_batch* b = &c.slots[next_read % c.num_slots];
            int got = 0;
            read_st = cfg->format == MT_INPUT_TEXT ? mtk__pp_read_text(&c, b, &got, &read_err) : mtk__pp_read_jsonl(&c, b, &got, &read_err);
            if (read_st != MT_OK || !got) { input_done = 1; break; }
            pthread_mutex_lock(&c.mu);
            b->seq = next_read++;
            inflight += b->len;
            b->state = MTK__PP_READY;
            pthread_cond_signal(&c.cv_work);
            pthread_mutex_unlock(&c.mu);
        }
        if (next_write == next_read) {
            if (read_st != MT_OK) {
                st = read_st;
                if (err) *err = read_err;
            }
            break;
        }
        mtk__pp_batch* b = &c.slots[next_write % c.num_slots];
        pthread_mutex_lock(&c.mu);
        while (b->state != MTK__PP_DONE && !mtk__cancelled(cfg->cancel)) { /* a signal does not end a wait: look every 0.1 s */
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += MTK__POLL_MS * 1000000L;
            if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
            pthread_cond_timedwait(&c.cv_done, &c.mu, &until);
        }
        pthread_mutex_unlock(&c.mu);
        if (mtk__cancelled(cfg->cancel)) { st = mt_fail(err, MT_ERR_IO, "interrupted"); break; }
        if (b->status != MT_OK) { st = mt_fail(err, b->status, "%s", b->message); break; }
        if (b->bad_len && cfg->bad_line) { /* one message per skipped line */
            char* m = b->bad_msgs;
            while (*m) {
                char* nl = strchr(m, '\n');
                *nl = 0;
                cfg->bad_line(cfg->user, m);
                m = nl + 1;
            }
        }
        int nk = c.num_keys;
        size_t offs[64]; /* where each key's next document starts in its token array */
        for (int k = 0; k < nk; k++) offs[k] = 0;
        for (size_t d = 0; d < b->num_docs && st == MT_OK; d++) {
            for (int k = 0; k < nk && st == MT_OK; k++) {
                int64_t n = b->doc_len[d * (size_t)nk + (size_t)k];
                st = mt_indexed_writer_add_document(writers[k], b->tokens[k] + offs[k], &n, n > 0 ? 1 : 0, err);
                offs[k] += (size_t)n;
                stats.tokens += n;
                if (n == 0) stats.empty_docs++;
            }
        }
        if (st != MT_OK) break;
        stats.documents += (int64_t)b->num_docs;
        stats.bytes_read += (int64_t)b->len;
        stats.bad_lines += b->bad_lines;
        stats.blank_lines += b->blank_lines;
        stats.seconds = mtk__now() - t0;
        b->state = MTK__PP_EMPTY;
        inflight -= b->len;
        next_write++;
        if (cfg->progress) cfg->progress(cfg->user, &stats);
    }

    /* Stop the workers, finish or remove the outputs, free everything. */
    if (sync_ok) {
        pthread_mutex_lock(&c.mu);
        c.quit = 1;
        pthread_cond_broadcast(&c.cv_work);
        pthread_mutex_unlock(&c.mu);
    }
    for (int t = 0; t < nthreads; t++) pthread_join(threads[t], NULL);
    if (sync_ok) {
        pthread_mutex_destroy(&c.mu);
        pthread_cond_destroy(&c.cv_work);
        pthread_cond_destroy(&c.cv_done);
    }
    /* the datasets of every key are one set: all prepared (written and synced under temporary names)
     * before any is committed, so a failure of one key leaves every old dataset untouched */
    for (int k = 0; writers && st == MT_OK && k < c.num_keys; k++) {
        if (mtk__cancelled(cfg->cancel)) st = mt_fail(err, MT_ERR_IO, "interrupted");
        else st = mt_indexed_writer_prepare(writers[k], err);
    }
    if (st == MT_OK && mtk__cancelled(cfg->cancel)) st = mt_fail(err, MT_ERR_IO, "interrupted");
    if (writers && st == MT_OK) st = mt_indexed_writers_commit(writers, c.num_keys, err); /* frees them */
    for (int k = 0; writers && k < c.num_keys; k++)
        if (writers[k]) mt_indexed_writer_abort(writers[k]);
    mtk__in_close(&c.in);
    for (int s = 0; c.slots && s < c.num_slots; s++) {
        mtk__pp_batch* b = &c.slots[s];
        for (int k = 0; b->tokens && k < c.num_keys; k++) free(b->tokens[k]);
        free(b->tokens);
        free(b->ntok);
        free(b->tcap);
        free(b->data);
        free(b->doc_end);
        free(b->doc_len);
        free(b->bad_msgs);
    }
    free(c.slots);
    free(threads);
    free(writers);
    for (int i = 0; i < c.num_files; i++) free(c.files[i]);
    free(c.files);
    free(c.carry);
    stats.seconds = mtk__now() - t0;
    if (stats_out) *stats_out = stats;
    return st;
}

#ifdef __cplusplus
}
#endif

#endif /* MT_TOKENIZER_IMPLEMENTATION_ONCE */
#endif /* MT_TOKENIZER_IMPLEMENTATION */
