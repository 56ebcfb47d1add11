/*
 * prepro/args.h — the prepro tools' one argv rule beyond their own parsers: `--flag=value` is
 * `--flag value`, as Python's argparse (and so Megatron's tools) accept it. The tools pass their
 * argv through mt_args_split_equals and parse the result as before. Also their integer flag values,
 * range-checked (mt_args_parse_int), and the tokenizer flags that preprocess_data and dataset_info
 * share (mt_args_tokenizer_flag, when prepro/tokenizer.h is included first).
 */
#ifndef MT_PREPRO_ARGS_H
#define MT_PREPRO_ARGS_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A copy of argv with every "--name=value" (after argv[0]) split into "--name" and "value" (argv's
 * strings are cut in place); its length in *out_argc. NULL when out of memory. Free the array. */
static char** mt_args_split_equals(int argc, char** argv, int* out_argc) {
    char** args = (char**)malloc(((size_t)argc * 2 + 1) * sizeof(char*));
    int n = 0;
    if (!args) return NULL;
    for (int i = 0; i < argc; i++) {
        char* eq = i > 0 && !strncmp(argv[i], "--", 2) ? strchr(argv[i], '=') : NULL;
        if (eq) {
            *eq = 0;
            args[n++] = argv[i];
            args[n++] = eq + 1;
        } else {
            args[n++] = argv[i];
        }
    }
    args[n] = NULL;
    *out_argc = n;
    return args;
}

/* A whole-string decimal integer in [lo, hi] into *out (1); else one error line on stderr, naming the
 * tool and the flag, and 0. */
static inline int mt_args_parse_int(const char* tool, const char* flag, const char* s, long long lo, long long hi,
                                    long long* out) {
    char* end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || (errno && errno != ERANGE)) {
        fprintf(stderr, "%s: error: %s %s: not an integer\n", tool, flag, s);
        return 0;
    }
    if (errno == ERANGE || v < lo || v > hi) {
        fprintf(stderr, "%s: error: %s %s: must be between %lld and %lld\n", tool, flag, s, lo, hi);
        return 0;
    }
    *out = v;
    return 1;
}

/* ---- the tokenizer flags, Megatron's names (the tools that include prepro/tokenizer.h first) ---- */
#ifdef MT_TOKENIZER_H
/* argv[*i] when it is one of the tokenizer flags (--tokenizer-type, --tokenizer-model, --vocab-file,
 * --merge-file, --vocab-size, --tiktoken-pattern, --tiktoken-num-special-tokens,
 * --tokenizer-special-tokens TOK... (alias --tiktoken-special-tokens), --tiktoken-encoding,
 * --tokenizer-hf-no-include-special-tokens): its value(s) into *t, *i moved past them, 1. Not one
 * of them: 0. A missing or bad value: one error line on stderr naming the tool and the flag, -1.
 * List values point into argv (argparse's nargs='+': a later use replaces an earlier one). */
static inline int mt_args_tokenizer_flag(const char* tool, int argc, char** argv, int* i, mt_tokenizer_args* t) {
    const char* a = argv[*i];
    const char** dst = !strcmp(a, "--tokenizer-type") ? &t->type : !strcmp(a, "--tokenizer-model") ? &t->model
                     : !strcmp(a, "--vocab-file") ? &t->vocab_file : !strcmp(a, "--merge-file") ? &t->merge_file
                     : !strcmp(a, "--tiktoken-pattern") ? &t->tiktoken_pattern
                     : !strcmp(a, "--tiktoken-encoding") ? &t->tiktoken_encoding : NULL;
    int list = !strcmp(a, "--tokenizer-special-tokens") || !strcmp(a, "--tiktoken-special-tokens");
    int number = !strcmp(a, "--vocab-size") || !strcmp(a, "--tiktoken-num-special-tokens");
    if (!strcmp(a, "--tokenizer-hf-no-include-special-tokens")) {
        t->hf_no_include_special_tokens = 1;
        return 1;
    }
    if (!strcmp(a, "--tokenizer-hf-no-use-fast")) {
        fprintf(stderr, "%s: error: %s: this build implements Hugging Face's fast tokenizer (tokenizer.json) only\n", tool, a);
        return -1;
    }
    if (!dst && !list && !number) return 0;
    if (*i + 1 >= argc || (list && !strncmp(argv[*i + 1], "--", 2))) {
        fprintf(stderr, "%s: error: %s needs a value\n", tool, a);
        return -1;
    }
    if (dst) {
        *dst = argv[++*i];
    } else if (list) {
        int start = *i + 1, end = start;
        while (end < argc && strncmp(argv[end], "--", 2) != 0) end++;
        t->special_tokens = (const char* const*)(argv + start);
        t->num_special_tokens = end - start;
        *i = end - 1;
    } else {
        long long v;
        if (!mt_args_parse_int(tool, a, argv[++*i], 1, 0x7FFFFFFE, &v)) return -1;
        if (!strcmp(a, "--vocab-size")) t->vocab_size = v;
        else t->tiktoken_num_special_tokens = v;
    }
    return 1;
}
#endif

#endif
