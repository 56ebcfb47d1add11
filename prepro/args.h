/*
 * prepro/args.h — the prepro tools' one argv rule beyond their own parsers: `--flag=value` is
 * `--flag value`, as Python's argparse (and so Megatron's tools) accept it. The tools pass their
 * argv through mt_args_split_equals and parse the result as before. Also their integer flag values,
 * range-checked (mt_args_parse_int).
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

#endif
