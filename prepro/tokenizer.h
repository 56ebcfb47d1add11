/*
 * prepro/tokenizer.h — byte-level BPE tokenizers and the preprocess_data pipeline (stb style).
 *
 * Tokenizers: GPT-2 (Megatron's GPT2BPETokenizer: --vocab-file encoder.json + --merge-file
 * vocab.bpe, or tiktoken's r50k_base file), cl100k_base, o200k_base and Llama-3 (tiktoken rank
 * files). Token ids are exactly tiktoken's `encode_ordinary` (special-token text such as
 * "<|endoftext|>" is encoded as plain text). Encoding a text takes three steps, as in tiktoken:
 *
 *   1. Invalid UTF-8 is replaced the way Python's bytes.decode('utf-8', errors='replace') does it:
 *      each maximal invalid subpart becomes U+FFFD.
 *   2. Pre-tokenization cuts the text into pieces with the encoding's split pattern (a regex in
 *      tiktoken). Each pattern is hand-written below as a small matcher that returns the same
 *      matches as the regex, backtracking included (e.g. `\s+(?!\S)` gives back one space).
 *      Character classes come from prepro/unicode_tables.h (the Unicode version of tiktoken's
 *      regex engine).
 *   3. Byte-pair encoding of each piece: a piece that is a token is one token; otherwise start
 *      from single bytes and repeatedly merge the adjacent pair whose concatenation has the
 *      lowest rank (leftmost on ties) until no pair is a token.
 *
 * The second half of this file is the preprocess_data pipeline (Megatron's
 * tools/preprocess_data.py): JSONL or plain-text documents in, one .bin/.idx dataset per JSON key
 * out, encoded by a pool of threads and written in input order, so the output bytes do not depend
 * on the number of workers. prepro/preprocess_data.c is its command line.
 *
 * Use: #define MT_TOKENIZER_IMPLEMENTATION in exactly one C or C++ file before including this
 * header, or before including it again after a declarations-only include (as megatron.h's banner
 * shows). It includes "megatron.h" (mt_status, mt_error, the indexed-dataset writer): keep the two
 * side by side, or put megatron.h's directory on the include path (-I). The implementation needs
 * C11 or C++ (timespec_get) and POSIX threads (-lpthread); a strict -std=c11 build needs no
 * feature-test macro. Library code never prints and never exits: failures come back as an mt_status
 * with a one-line message in the mt_error. A loaded tokenizer is immutable and can be shared by
 * threads.
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

/* The split pattern and special tokens. GPT2 is r50k_base (= GPT-2's encoder.json + vocab.bpe). */
typedef enum { MT_TOKENIZER_GPT2 = 0, MT_TOKENIZER_CL100K, MT_TOKENIZER_O200K, MT_TOKENIZER_LLAMA3 } mt_tokenizer_kind;

/* GPT2BPETokenizer: Megatron's --vocab-file (encoder.json) + --merge-file (vocab.bpe). Merge
 * priority is the merge's line in vocab.bpe; ids come from encoder.json. */
mt_status mt_tokenizer_load_gpt2(mt_tokenizer** out, const char* vocab_json_path, const char* merges_path, mt_error* err);
/* tiktoken rank file (base64 token, space, rank per line): r50k_base (kind GPT2), cl100k_base,
 * o200k_base, or Llama-3's tokenizer.model (kind LLAMA3: 256 special tokens after the ranks). */
mt_status mt_tokenizer_load_tiktoken(mt_tokenizer** out, const char* rank_file_path, mt_tokenizer_kind kind, mt_error* err);
void mt_tokenizer_free(mt_tokenizer* tok);

mt_tokenizer_kind mt_tokenizer_get_kind(const mt_tokenizer* tok);
/* "gpt2", "cl100k_base", "o200k_base", "llama3". */
const char* mt_tokenizer_kind_name(mt_tokenizer_kind kind);
/* Parses an encoding name: r50k_base|gpt2, cl100k_base, o200k_base, llama3. */
mt_status mt_tokenizer_kind_from_name(const char* name, mt_tokenizer_kind* out, mt_error* err);
/* Guesses the kind from a rank file's name (r50k/gpt2, cl100k, o200k, llama/tokenizer.model):
 * 1 and *out set when it can, else 0. */
int mt_tokenizer_kind_from_path(const char* path, mt_tokenizer_kind* out);

/* Number of token ids, specials included: tiktoken's n_vocab (max id + 1): 50257 GPT-2,
 * 100277 cl100k, 200019 o200k, 128256 Llama-3. */
int64_t mt_tokenizer_vocab_size(const mt_tokenizer* tok);
/* <|endoftext|> (GPT-2/cl100k/o200k), <|end_of_text|> = 128001 for Llama-3. */
int32_t mt_tokenizer_eod(const mt_tokenizer* tok);

/* Ordinary encoding (special-token text is encoded as plain text, like tiktoken's encode_ordinary).
 * Appends to *tokens (realloc'd as needed, capacity in *cap, used length in *count), returns the
 * count appended, or -1 when memory runs out. *tokens may start NULL with *count = *cap = 0.
 * Thread-safe: any number of threads may encode with one tokenizer at once. */
int64_t mt_tokenizer_encode(const mt_tokenizer* tok, const char* text, size_t len, int32_t** tokens, size_t* count, size_t* cap);
/* Bytes of one token (for decoding; special tokens give their text); returns the length and sets
 * *bytes, or 0 for an unknown id. */
size_t mt_tokenizer_token_bytes(const mt_tokenizer* tok, int32_t id, const char** bytes);
/* The id of a token given its bytes (ordinary or special token text), or -1. */
int32_t mt_tokenizer_token_id(const mt_tokenizer* tok, const char* bytes, size_t len);
/* Concatenated bytes of ids (malloc'd, NUL-terminated, caller frees). MT_ERR_RANGE for an unknown id. */
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
    int64_t bytes_read;    /* input bytes behind the documents written */
    int64_t bytes_total;   /* total input bytes (sum of the input file sizes) */
    int64_t bad_lines;     /* malformed lines skipped (skip_bad_lines) */
    int64_t blank_lines;   /* whitespace-only JSONL lines skipped */
    int64_t empty_docs;    /* documents that encoded to no tokens (zero-sequence documents) */
    double seconds;        /* since mt_preprocess started */
} mt_preprocess_stats;

typedef struct {
    const char* const* inputs;      /* files; a directory stands for every file under it (depth first,
                                     * each directory's entries sorted by name, hidden names skipped) */
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
    /* Optional, called from the calling thread: after each batch written, and for each skipped bad
     * line ("file:line: problem"), in input order. */
    void (*progress)(void* user, const mt_preprocess_stats* stats);
    void (*bad_line)(void* user, const char* message);
    void* user;
    /* Optional: when *cancel becomes non-zero (e.g. from a SIGINT handler), stop, remove the
     * temporary files and return MT_ERR_IO "interrupted". */
    const volatile sig_atomic_t* cancel;
} mt_preprocess_config;

/* Runs the whole job. Output files are written under temporary names and renamed into place only
 * when everything succeeded, so a failed or interrupted run leaves no dataset behind. The bytes
 * written do not depend on cfg->workers. stats may be NULL. */
mt_status mt_preprocess(const mt_preprocess_config* cfg, mt_preprocess_stats* stats, mt_error* err);

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
#include <sys/stat.h>
#include <time.h>

#include "unicode_tables.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* A.1 Small helpers                                                                              */
/* ---------------------------------------------------------------------------------------------- */

#define MTK__NO_RANK 0xFFFFFFFFu

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

/* cl100k_base (trailing_rule = 1):
 *   '(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s
 * Llama-3 (trailing_rule = 0; same matches except for `\s++$`):
 *   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+ */
static size_t mtk__split_cl100k(const uint8_t* s, size_t n, size_t i, int trailing_rule) {
    if (s[i] == '\'') {
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
    if (f & MT_UC_N) { /* \p{N}{1,3} */
        size_t e = i + l;
        for (int k = 1; k < 3 && e < n; k++) {
            size_t m = mtk__ch(s, e, &g);
            if (!(g & MT_UC_N)) break;
            e += m;
        }
        return e;
    }
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
static size_t mtk__o200k_upper_lower(const uint8_t* s, size_t n, size_t p) {
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
    return e + mtk__contraction_ci(s, n, e);
}
static size_t mtk__o200k_upper_then_lower(const uint8_t* s, size_t n, size_t p) {
    size_t q = mtk__run_any(s, n, p, MTK__O200K_A);
    if (q == p) return 0;
    size_t e = mtk__run_any(s, n, q, MTK__O200K_B);
    return e + mtk__contraction_ci(s, n, e);
}

/* o200k_base:
 *   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *  |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
 *  |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
 * The optional prefix is not possessive: each letter alternative is tried with it, then without. */
static size_t mtk__split_o200k(const uint8_t* s, size_t n, size_t i) {
    unsigned f, g;
    size_t l = mtk__ch(s, i, &f), e;
    int prefix = !(f & (MT_UC_L | MT_UC_N | MT_UC_NL)) && i + l < n;
    if (prefix && (e = mtk__o200k_upper_lower(s, n, i + l))) return e;
    if ((e = mtk__o200k_upper_lower(s, n, i))) return e;
    if (prefix && (e = mtk__o200k_upper_then_lower(s, n, i + l))) return e;
    if ((e = mtk__o200k_upper_then_lower(s, n, i))) return e;
    if (f & MT_UC_N) {
        e = i + l;
        for (int k = 1; k < 3 && e < n; k++) {
            size_t m = mtk__ch(s, e, &g);
            if (!(g & MT_UC_N)) break;
            e += m;
        }
        return e;
    }
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

static inline size_t mtk__split(mt_tokenizer_kind kind, const uint8_t* s, size_t n, size_t i) {
    switch (kind) {
        case MT_TOKENIZER_GPT2: return mtk__split_gpt2(s, n, i);
        case MT_TOKENIZER_CL100K: return mtk__split_cl100k(s, n, i, 1);
        case MT_TOKENIZER_LLAMA3: return mtk__split_cl100k(s, n, i, 0);
        case MT_TOKENIZER_O200K: return mtk__split_o200k(s, n, i);
    }
    return i;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.3 The vocabulary: token bytes -> (rank, id) hash table                                        */
/* ---------------------------------------------------------------------------------------------- */

typedef struct {
    uint32_t off;  /* bytes in tok->blob */
    uint32_t len;
    uint32_t rank; /* merge priority (= the id for tiktoken files); MTK__NO_RANK: never a merge result */
    int32_t id;
} mtk__tok_entry;

struct mt_tokenizer {
    mt_tokenizer_kind kind;
    uint8_t* blob;               /* every token's bytes */
    size_t blob_len, blob_cap;
    mtk__tok_entry* entries;      /* ordinary tokens [0, num_ordinary), then special tokens */
    uint32_t num_entries, entries_cap, num_ordinary;
    uint64_t* slots;             /* open addressing over ordinary tokens: (hash >> 32) << 32 | (entry + 1) */
    uint32_t slot_bits;
    int32_t* id_entry;           /* id -> entry, -1 where no token has that id */
    int64_t n_vocab;
    int32_t eod;
    uint32_t max_token_len;
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

/* The ordinary token with these bytes, or NULL. */
static inline const mtk__tok_entry* mtk__find(const mt_tokenizer* tok, const uint8_t* p, size_t n) {
    uint64_t h = mtk__hash(p, n);
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

static void mtk__tok_reset(mt_tokenizer* tok) {
    free(tok->blob);
    free(tok->entries);
    free(tok->slots);
    free(tok->id_entry);
    memset(tok, 0, sizeof(*tok));
}

void mt_tokenizer_free(mt_tokenizer* tok) {
    if (!tok) return;
    mtk__tok_reset(tok);
    free(tok);
}

static mt_status mtk__tok_add(mt_tokenizer* tok, const uint8_t* bytes, size_t len, uint32_t rank, int64_t id, mt_error* err) {
    if (id < 0 || id > 0x7FFFFFFE) return mt_fail(err, MT_ERR_FORMAT, "token id %lld out of range", (long long)id);
    if (len == 0 || len > 0xFFFF) return mt_fail(err, MT_ERR_FORMAT, "token %lld has %zu bytes", (long long)id, len);
    if (tok->blob_len + len > tok->blob_cap) {
        size_t cap = tok->blob_cap ? tok->blob_cap * 2 : (1 << 20);
        while (cap < tok->blob_len + len) cap *= 2;
        if (cap > 0xFFFFFFFFu) return mt_fail(err, MT_ERR_FORMAT, "vocabulary too large");
        uint8_t* nb = (uint8_t*)realloc(tok->blob, cap);
        if (!nb) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
        tok->blob = nb;
        tok->blob_cap = cap;
    }
    if (tok->num_entries == tok->entries_cap) {
        uint32_t cap = tok->entries_cap ? tok->entries_cap * 2 : 65536;
        mtk__tok_entry* ne = (mtk__tok_entry*)realloc(tok->entries, cap * sizeof(mtk__tok_entry));
        if (!ne) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
        tok->entries = ne;
        tok->entries_cap = cap;
    }
    mtk__tok_entry* e = &tok->entries[tok->num_entries++];
    e->off = (uint32_t)tok->blob_len;
    e->len = (uint32_t)len;
    e->rank = rank;
    e->id = (int32_t)id;
    memcpy(tok->blob + tok->blob_len, bytes, len);
    tok->blob_len += len;
    return MT_OK;
}

/* After the ordinary tokens were added (and before the specials): builds the hash table. */
static mt_status mtk__tok_index(mt_tokenizer* tok, const char* path, mt_error* err) {
    tok->num_ordinary = tok->num_entries;
    uint32_t bits = 10;
    while (((uint64_t)1 << bits) < (uint64_t)tok->num_ordinary * 2) bits++;
    tok->slot_bits = bits;
    tok->slots = (uint64_t*)calloc((size_t)1 << bits, sizeof(uint64_t));
    if (!tok->slots) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
    uint64_t mask = ((uint64_t)1 << bits) - 1;
    for (uint32_t k = 0; k < tok->num_ordinary; k++) {
        const mtk__tok_entry* e = &tok->entries[k];
        const uint8_t* p = tok->blob + e->off;
        if (mtk__find(tok, p, e->len))
            return mt_fail(err, MT_ERR_FORMAT, "%s: token %d repeats the bytes of another token", path, e->id);
        uint64_t h = mtk__hash(p, e->len), i = h & mask;
        while (tok->slots[i]) i = (i + 1) & mask;
        tok->slots[i] = (h & 0xFFFFFFFF00000000ull) | (uint64_t)(k + 1);
        if (e->len > tok->max_token_len) tok->max_token_len = e->len;
    }
    for (int b = 0; b < 256; b++) {
        uint8_t byte = (uint8_t)b;
        if (!mtk__find(tok, &byte, 1))
            return mt_fail(err, MT_ERR_FORMAT, "%s: no token for the single byte 0x%02x: not a byte-level BPE vocabulary", path, b);
    }
    return MT_OK;
}

/* After everything was added: the id -> entry map, n_vocab and the EOD id. */
static mt_status mtk__tok_finish(mt_tokenizer* tok, const char* path, const char* eod_text, mt_error* err) {
    int64_t max_id = -1;
    for (uint32_t k = 0; k < tok->num_entries; k++)
        if (tok->entries[k].id > max_id) max_id = tok->entries[k].id;
    tok->n_vocab = max_id + 1;
    tok->id_entry = (int32_t*)malloc((size_t)tok->n_vocab * sizeof(int32_t));
    if (!tok->id_entry) return mt_fail(err, MT_ERR_OOM, "out of memory loading the vocabulary");
    memset(tok->id_entry, 0xFF, (size_t)tok->n_vocab * sizeof(int32_t));
    for (uint32_t k = 0; k < tok->num_entries; k++) {
        int32_t id = tok->entries[k].id;
        if (tok->id_entry[id] >= 0) {
            if (k >= tok->num_ordinary)
                return mt_fail(err, MT_ERR_FORMAT,
                               "%s: special token id %d is already an ordinary token (wrong encoding for this file?)", path, id);
            return mt_fail(err, MT_ERR_FORMAT, "%s: token id %d appears twice", path, id);
        }
        tok->id_entry[id] = (int32_t)k;
    }
    tok->eod = mt_tokenizer_token_id(tok, eod_text, strlen(eod_text));
    if (tok->eod < 0) return mt_fail(err, MT_ERR_FORMAT, "%s: no %s token", path, eod_text);
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* A.4 Byte-pair encoding of one piece                                                             */
/* ---------------------------------------------------------------------------------------------- */

#define MTK__BPE_SMALL 128 /* pieces up to this many bytes: tiktoken's quadratic scan on the stack */

static inline uint32_t mtk__rank(const mt_tokenizer* tok, const uint8_t* p, size_t n) {
    const mtk__tok_entry* e = mtk__find(tok, p, n);
    return e ? e->rank : MTK__NO_RANK;
}

static inline int32_t mtk__id(const mt_tokenizer* tok, const uint8_t* p, size_t n) {
    const mtk__tok_entry* e = mtk__find(tok, p, n);
    return e ? e->id : 0; /* always found: single bytes and merge results are tokens */
}

/* tiktoken's _byte_pair_merge: parts start at start[0..np-1) (start[np-1] = n is a sentinel);
 * rank[k] is the rank of parts k and k+1 together. Merge the lowest rank (leftmost on ties). */
static void mtk__bpe_small(const mt_tokenizer* tok, const uint8_t* p, size_t n, int32_t* out, size_t* count) {
    uint32_t start[MTK__BPE_SMALL + 1], rank[MTK__BPE_SMALL + 1];
    size_t np = n + 1;
    for (size_t k = 0; k <= n; k++) start[k] = (uint32_t)k;
    for (size_t k = 0; k + 1 < n; k++) rank[k] = mtk__rank(tok, p + k, 2);
    rank[n - 1] = rank[n] = MTK__NO_RANK;
    for (;;) {
        uint32_t best = MTK__NO_RANK;
        size_t b = 0;
        for (size_t k = 0; k + 1 < np; k++)
            if (rank[k] < best) { best = rank[k]; b = k; }
        if (best == MTK__NO_RANK) break;
        if (b > 0) rank[b - 1] = b + 2 < np ? mtk__rank(tok, p + start[b - 1], start[b + 2] - start[b - 1]) : MTK__NO_RANK;
        rank[b] = b + 3 < np ? mtk__rank(tok, p + start[b], start[b + 3] - start[b]) : MTK__NO_RANK;
        memmove(start + b + 1, start + b + 2, (np - b - 2) * sizeof(uint32_t));
        memmove(rank + b + 1, rank + b + 2, (np - b - 2) * sizeof(uint32_t));
        np--;
    }
    for (size_t k = 0; k + 1 < np; k++) out[(*count)++] = mtk__id(tok, p + start[k], start[k + 1] - start[k]);
}

/* The same merges for long pieces (e.g. a long run of spaces) in O(n log n): parts form a linked
 * list indexed by their start byte, candidate pairs sit in a min-heap ordered by (rank, start);
 * an entry is stale when its left part is gone or has a different right neighbour since. */
typedef struct { uint32_t rank, pos, end; } mtk__heap_item;

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

static int mtk__bpe_large(const mt_tokenizer* tok, const uint8_t* p, size_t n, int32_t* out, size_t* count) {
    /* next[k]: start of the part after the part starting at k (n for the last); prev likewise. */
    uint32_t* next = (uint32_t*)malloc((n + 1) * 2 * sizeof(uint32_t));
    mtk__heap_item* heap = (mtk__heap_item*)malloc(3 * n * sizeof(mtk__heap_item));
    uint8_t* alive = (uint8_t*)malloc(n + 1);
    if (!next || !heap || !alive) { free(next); free(heap); free(alive); return -1; }
    uint32_t* prev = next + n + 1;
    size_t hn = 0;
    for (size_t k = 0; k <= n; k++) { next[k] = (uint32_t)(k + 1); prev[k] = (uint32_t)(k - 1); alive[k] = 1; }
    for (size_t k = 0; k + 1 < n; k++) {
        uint32_t r = mtk__rank(tok, p + k, 2);
        if (r != MTK__NO_RANK) { mtk__heap_item it = {r, (uint32_t)k, (uint32_t)(k + 2)}; mtk__heap_push(heap, &hn, it); }
    }
    while (hn > 0) {
        mtk__heap_item it = mtk__heap_pop(heap, &hn);
        uint32_t a = it.pos;
        if (!alive[a] || next[a] >= n || next[next[a]] != it.end) continue; /* stale */
        uint32_t b = next[a];
        alive[b] = 0;
        next[a] = next[b];
        if (next[b] < n) prev[next[b]] = a;
        if (next[a] < n) { /* new pair (a, right neighbour) */
            uint32_t end = next[next[a]];
            uint32_t r = mtk__rank(tok, p + a, end - a);
            if (r != MTK__NO_RANK) { mtk__heap_item ni = {r, a, end}; mtk__heap_push(heap, &hn, ni); }
        }
        if (a > 0) { /* new pair (left neighbour, a) */
            uint32_t l = prev[a], end = next[a];
            uint32_t r = mtk__rank(tok, p + l, end - l);
            if (r != MTK__NO_RANK) { mtk__heap_item ni = {r, l, end}; mtk__heap_push(heap, &hn, ni); }
        }
    }
    for (uint32_t k = 0; k < n; k = next[k]) out[(*count)++] = mtk__id(tok, p + k, next[k] - k);
    free(next);
    free(heap);
    free(alive);
    return 0;
}

/* Appends the tokens of one piece (out has room for n more). */
static inline int mtk__bpe(const mt_tokenizer* tok, const uint8_t* p, size_t n, int32_t* out, size_t* count) {
    if (n <= tok->max_token_len) {
        const mtk__tok_entry* e = mtk__find(tok, p, n);
        if (e) { out[(*count)++] = e->id; return 0; }
    }
    if (n <= MTK__BPE_SMALL) { mtk__bpe_small(tok, p, n, out, count); return 0; }
    return mtk__bpe_large(tok, p, n, out, count);
}

/* ---------------------------------------------------------------------------------------------- */
/* A.5 Public tokenizer API                                                                       */
/* ---------------------------------------------------------------------------------------------- */

/* Grows *tokens to hold at least `need` ids (doubling). */
static int mtk__reserve(int32_t** tokens, size_t* cap, size_t need) {
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap : 1024;
    while (ncap < need) ncap *= 2;
    int32_t* nt = (int32_t*)realloc(*tokens, ncap * sizeof(int32_t));
    if (!nt) return -1;
    *tokens = nt;
    *cap = ncap;
    return 0;
}

int64_t mt_tokenizer_encode(const mt_tokenizer* tok, const char* text, size_t len, int32_t** tokens, size_t* count, size_t* cap) {
    const uint8_t* s = (const uint8_t*)text;
    uint8_t* clean = NULL;
    size_t first = *count;
    if (len == 0) return 0;
    size_t bad = mtk__utf8_first_invalid(s, len);
    if (bad < len) {
        clean = mtk__utf8_replace(s, len, bad, &len);
        if (!clean) return -1;
        s = clean;
    }
    /* A piece of n bytes gives at most n tokens: make room for that before each piece (English
     * averages ~4 bytes per token, so start with len/4). */
    size_t c = *count, i = 0;
    if (mtk__reserve(tokens, cap, c + len / 4 + 16) != 0) { free(clean); return -1; }
    int32_t* out = *tokens;
    mt_tokenizer_kind kind = tok->kind;
    while (i < len) {
        size_t e = mtk__split(kind, s, len, i);
        if (e <= i) { /* no match (cannot happen with these patterns): tiktoken skips the text */
            unsigned f;
            i += mtk__ch(s, i, &f);
            continue;
        }
        if (*cap - c < e - i) {
            if (mtk__reserve(tokens, cap, c + (e - i)) != 0) { free(clean); *count = c; return -1; }
            out = *tokens;
        }
        if (mtk__bpe(tok, s + i, e - i, out, &c) != 0) { free(clean); *count = c; return -1; }
        i = e;
    }
    free(clean);
    *count = c;
    return (int64_t)(c - first);
}

size_t mt_tokenizer_token_bytes(const mt_tokenizer* tok, int32_t id, const char** bytes) {
    if (id < 0 || id >= tok->n_vocab || tok->id_entry[id] < 0) return 0;
    const mtk__tok_entry* e = &tok->entries[tok->id_entry[id]];
    *bytes = (const char*)tok->blob + e->off;
    return e->len;
}

int32_t mt_tokenizer_token_id(const mt_tokenizer* tok, const char* bytes, size_t len) {
    const mtk__tok_entry* e = mtk__find(tok, (const uint8_t*)bytes, len);
    if (e) return e->id;
    for (uint32_t k = tok->num_ordinary; k < tok->num_entries; k++) {
        const mtk__tok_entry* s = &tok->entries[k];
        if (s->len == len && memcmp(tok->blob + s->off, bytes, len) == 0) return s->id;
    }
    return -1;
}

mt_status mt_tokenizer_decode(const mt_tokenizer* tok, const int32_t* ids, size_t n, char** out, size_t* out_len, mt_error* err) {
    size_t total = 0;
    for (size_t k = 0; k < n; k++) {
        const char* b;
        size_t l = mt_tokenizer_token_bytes(tok, ids[k], &b);
        if (!l) return mt_fail(err, MT_ERR_RANGE, "token id %d at position %zu is not in the vocabulary", ids[k], k);
        total += l;
    }
    char* buf = (char*)malloc(total + 1);
    if (!buf) return mt_fail(err, MT_ERR_OOM, "out of memory decoding %zu tokens", n);
    size_t o = 0;
    for (size_t k = 0; k < n; k++) {
        const char* b = NULL;
        size_t l = mt_tokenizer_token_bytes(tok, ids[k], &b);
        memcpy(buf + o, b, l);
        o += l;
    }
    buf[o] = 0;
    *out = buf;
    if (out_len) *out_len = o;
    return MT_OK;
}

mt_tokenizer_kind mt_tokenizer_get_kind(const mt_tokenizer* tok) { return tok->kind; }
int64_t mt_tokenizer_vocab_size(const mt_tokenizer* tok) { return tok->n_vocab; }
int32_t mt_tokenizer_eod(const mt_tokenizer* tok) { return tok->eod; }

const char* mt_tokenizer_kind_name(mt_tokenizer_kind kind) {
    switch (kind) {
        case MT_TOKENIZER_GPT2: return "gpt2";
        case MT_TOKENIZER_CL100K: return "cl100k_base";
        case MT_TOKENIZER_O200K: return "o200k_base";
        case MT_TOKENIZER_LLAMA3: return "llama3";
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

/* ---- tiktoken rank files ---- */

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

static mt_status mtk__add_special(mt_tokenizer* tok, const char* text, int64_t id, mt_error* err) {
    return mtk__tok_add(tok, (const uint8_t*)text, strlen(text), MTK__NO_RANK, id, err);
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
    }
    return mt_fail(err, MT_ERR_ARG, "unknown tokenizer kind %d", (int)kind);
}

mt_status mt_tokenizer_load_tiktoken(mt_tokenizer** out, const char* path, mt_tokenizer_kind kind, mt_error* err) {
    uint8_t *buf = NULL, *tmp = NULL;
    size_t len = 0;
    const char* eod = NULL;
    int64_t num_ranks = 0, line = 0;
    mt_status st;
    *out = NULL;
    if ((unsigned)kind > (unsigned)MT_TOKENIZER_LLAMA3) return mt_fail(err, MT_ERR_ARG, "unknown tokenizer kind %d", (int)kind);
    mt_tokenizer* tok = (mt_tokenizer*)calloc(1, sizeof(mt_tokenizer));
    if (!tok) return mt_fail(err, MT_ERR_OOM, "out of memory");
    tok->kind = kind;
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
            if ((st = mtk__tok_add(tok, tmp, (size_t)nb, (uint32_t)rank, rank, err))) goto done;
            num_ranks++;
        }
        i = e + 1;
    }
    if (num_ranks == 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no tokens in the file", path); goto done; }
    if ((st = mtk__tok_index(tok, path, err))) goto done;
    if ((st = mtk__add_specials(tok, kind, num_ranks, &eod, err))) goto done;
    st = mtk__tok_finish(tok, path, eod, err);
done:
    free(buf);
    free(tmp);
    if (st != MT_OK) { mt_tokenizer_free(tok); return st; }
    *out = tok;
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* B. JSON                                                                                        */
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
/* A.6 GPT-2's encoder.json + vocab.bpe                                                           */
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

/* Maps a token written in GPT-2's unicode alphabet (UTF-8) back to its bytes; returns the length or -1. */
static long mtk__gpt2_token_bytes(const uint8_t* s, size_t n, uint8_t* out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        size_t bad = 0, k = s[i] < 0x80 ? 1 : mtk__utf8_valid_seq(s + i, n - i, &bad);
        if (!k) return -1;
        uint32_t cp = s[i];
        if (k == 2) cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3Fu);
        else if (k > 2) return -1;
        int b = mtk__gpt2_unbyte(cp);
        if (b < 0) return -1;
        out[o++] = (uint8_t)b;
        i += k;
    }
    return (long)o;
}

mt_status mt_tokenizer_load_gpt2(mt_tokenizer** out, const char* vocab_json_path, const char* merges_path, mt_error* err) {
    uint8_t *js = NULL, *mg = NULL, *tmp = NULL, *tmp2 = NULL;
    char* scratch = NULL;
    size_t jlen = 0, mlen = 0, scap = 0, used = 0;
    int64_t line = 0, merge = 0;
    mtk__json j;
    mt_status st;
    const char* eod = "<|endoftext|>";
    *out = NULL;
    mt_tokenizer* tok = (mt_tokenizer*)calloc(1, sizeof(mt_tokenizer));
    if (!tok) return mt_fail(err, MT_ERR_OOM, "out of memory");
    tok->kind = MT_TOKENIZER_GPT2;
    if ((st = mtk__read_file(vocab_json_path, &js, &jlen, err))) goto done;
    if ((st = mtk__read_file(merges_path, &mg, &mlen, err))) goto done;
    tmp = (uint8_t*)malloc(jlen + mlen + 8);
    tmp2 = (uint8_t*)malloc(jlen + mlen + 8);
    if (!tmp || !tmp2) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); goto done; }

    /* encoder.json: {"token": id, ...}. Special tokens (<|endoftext|>) are kept aside, as tiktoken does. */
    j.p = j.start = js;
    j.end = js + jlen;
    j.err = err;
    mtk__json_ws(&j);
    if (j.p >= j.end || *j.p != '{') { st = mt_fail(err, MT_ERR_FORMAT, "%s: not a JSON object", vocab_json_path); goto done; }
    j.p++;
    mtk__json_ws(&j);
    {
        int64_t specials_id[2] = {-1, -1};
        while (j.p < j.end && *j.p != '}') {
            size_t koff, klen;
            int kscr;
            used = 0;
            if (*j.p != '"') { st = mtk__json_fail(&j, "expected a key"); break; }
            if ((st = mtk__json_string(&j, &scratch, &used, &scap, &kscr, &koff, &klen))) break;
            const uint8_t* kp = kscr ? (const uint8_t*)scratch + koff : js + koff;
            mtk__json_ws(&j);
            if (j.p >= j.end || *j.p != ':') { st = mtk__json_fail(&j, "expected ':'"); break; }
            j.p++;
            mtk__json_ws(&j);
            int64_t id = 0;
            const uint8_t* d = j.p;
            while (j.p < j.end && *j.p >= '0' && *j.p <= '9' && id <= 0x7FFFFFFF) id = id * 10 + (*j.p++ - '0');
            if (j.p == d || id > 0x7FFFFFFE) { st = mtk__json_fail(&j, "expected a token id"); break; }
            if (klen == 13 && memcmp(kp, "<|endoftext|>", 13) == 0) specials_id[0] = id;
            else if (klen == 15 && memcmp(kp, "<|startoftext|>", 15) == 0) specials_id[1] = id;
            else {
                long nb = mtk__gpt2_token_bytes(kp, klen, tmp);
                if (nb <= 0) {
                    st = mt_fail(err, MT_ERR_FORMAT, "%s: token '%.*s' is not in GPT-2's byte alphabet", vocab_json_path,
                                 (int)(klen > 60 ? 60 : klen), (const char*)kp);
                    break;
                }
                /* Merge priority comes from vocab.bpe below; single bytes are never merge results. */
                if ((st = mtk__tok_add(tok, tmp, (size_t)nb, MTK__NO_RANK, id, err))) break;
            }
            mtk__json_ws(&j);
            if (j.p < j.end && *j.p == ',') { j.p++; mtk__json_ws(&j); continue; }
            if (j.p >= j.end || *j.p != '}') { st = mtk__json_fail(&j, "expected ',' or '}'"); break; }
        }
        if (st) {
            char msg[sizeof(err->message)];
            snprintf(msg, sizeof(msg), "%s", err ? err->message : "");
            st = mt_fail(err, st, "%s: %s", vocab_json_path, msg);
            goto done;
        }
        if (tok->num_entries == 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no tokens", vocab_json_path); goto done; }
        if ((st = mtk__tok_index(tok, vocab_json_path, err))) goto done;
        if (specials_id[0] < 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no <|endoftext|> token", vocab_json_path); goto done; }
        if ((st = mtk__add_special(tok, "<|endoftext|>", specials_id[0], err))) goto done;
        if (specials_id[1] >= 0 && (st = mtk__add_special(tok, "<|startoftext|>", specials_id[1], err))) goto done;
    }

    /* vocab.bpe: "#version" line, then one merge "left right" per line, highest priority first.
     * The token made by the merge on line k gets rank 256 + k, as tiktoken's data_gym loader does. */
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
            mtk__tok_entry* w = &tok->entries[ab - tok->entries];
            if (w->rank == MTK__NO_RANK) w->rank = (uint32_t)(256 + merge);
            merge++;
        }
        i = e + 1;
    }
    if (merge == 0) { st = mt_fail(err, MT_ERR_FORMAT, "%s: no merges", merges_path); goto done; }
    st = mtk__tok_finish(tok, vocab_json_path, eod, err);
done:
    free(js);
    free(mg);
    free(tmp);
    free(tmp2);
    free(scratch);
    if (st != MT_OK) { mt_tokenizer_free(tok); return st; }
    *out = tok;
    return MT_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* C. The preprocess_data pipeline                                                                */
/* ---------------------------------------------------------------------------------------------- */
/* The calling thread reads the input in batches of whole lines (JSONL) or whole files (text) and
 * writes the results; `workers` threads parse and encode batches. A ring of 2*workers+2 batch slots
 * bounds the memory; batches are written strictly in input order, so the output does not depend
 * on the number of workers or on their timing. */

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
    FILE* f;
    int64_t line;
    uint8_t* carry;
    size_t carry_len, carry_cap;
    size_t batch_bytes;
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

/* Next batch of whole lines of one file into b; *got = 0 when the input is exhausted. */
static mt_status mtk__pp_read_jsonl(mtk__pp_ctx* c, mtk__pp_batch* b, int* got, mt_error* err) {
    *got = 0;
    while (c->cur < c->num_files) {
        const char* path = c->files[c->cur];
        if (!c->f) {
            c->f = fopen(path, "rb");
            if (!c->f) return mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
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
            size_t n = fread(b->data + b->len, 1, c->batch_bytes, c->f);
            if (n == 0) {
                int bad = ferror(c->f);
                fclose(c->f);
                c->f = NULL;
                c->cur++;
                if (bad) return mt_fail(err, MT_ERR_IO, "error reading %s", path);
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
            /* no newline yet: a line longer than the batch size, keep reading */
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
        FILE* f = fopen(path, "rb");
        if (!f) return mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        for (;;) {
            if (mtk__grow((void**)&b->data, &b->cap, b->len + (1 << 20) + 1, 1)) { fclose(f); return mt_fail(err, MT_ERR_OOM, "out of memory reading %s", path); }
            size_t n = fread(b->data + b->len, 1, b->cap - b->len - 1, f);
            b->len += n;
            if (n == 0) break;
        }
        int bad = ferror(f);
        fclose(f);
        if (bad) return mt_fail(err, MT_ERR_IO, "error reading %s", path);
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
        int64_t n = mt_tokenizer_encode(tok, vals[k], lens[k], &b->tokens[k], &b->ntok[k], &b->tcap[k]);
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
    c.batch_bytes = cfg->batch_bytes ? cfg->batch_bytes : ((size_t)1 << 20);
    workers = cfg->workers > 0 ? cfg->workers : 1;
    max_inflight = (size_t)(2 * workers + 2) * c.batch_bytes;
    if (max_inflight < ((size_t)1 << 30)) max_inflight = (size_t)1 << 30;
    if (!cfg->tokenizer) return mt_fail(err, MT_ERR_ARG, "no tokenizer");
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
    for (int t = 0; t < workers && st == MT_OK; t++) {
        if (pthread_create(&threads[t], NULL, mtk__pp_worker, &c) != 0) st = mt_fail(err, MT_ERR_CONFIG, "cannot start worker thread %d", t);
        else nthreads++;
    }

    /* Read ahead, write in order. */
    while (st == MT_OK) {
        while (!input_done && next_read - next_write < c.num_slots && (inflight == 0 || inflight < max_inflight)) {
            mtk__pp_batch* b = &c.slots[next_read % c.num_slots];
            int got = 0;
            st = cfg->format == MT_INPUT_TEXT ? mtk__pp_read_text(&c, b, &got, err) : mtk__pp_read_jsonl(&c, b, &got, err);
            if (st != MT_OK) break;
            if (!got) { input_done = 1; break; }
            pthread_mutex_lock(&c.mu);
            b->seq = next_read++;
            inflight += b->len;
            b->state = MTK__PP_READY;
            pthread_cond_signal(&c.cv_work);
            pthread_mutex_unlock(&c.mu);
        }
        if (st != MT_OK || next_write == next_read) break;
        mtk__pp_batch* b = &c.slots[next_write % c.num_slots];
        pthread_mutex_lock(&c.mu);
        while (b->state != MTK__PP_DONE) pthread_cond_wait(&c.cv_done, &c.mu);
        pthread_mutex_unlock(&c.mu);
        if (cfg->cancel && *cfg->cancel) { st = mt_fail(err, MT_ERR_IO, "interrupted"); break; }
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
    for (int k = 0; writers && st == MT_OK && k < c.num_keys; k++) st = mt_indexed_writer_prepare(writers[k], err);
    if (writers && st == MT_OK) st = mt_indexed_writers_commit(writers, c.num_keys, err); /* frees them */
    for (int k = 0; writers && k < c.num_keys; k++)
        if (writers[k]) mt_indexed_writer_abort(writers[k]);
    if (c.f) fclose(c.f);
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
