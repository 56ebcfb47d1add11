/* prepro/merge_datasets.c — concatenate .bin/.idx datasets into one (Megatron's tools/merge_datasets.py).
 *
 *   merge_datasets --input DIR --output-prefix OUT
 *       merges every PREFIX.bin + PREFIX.idx pair in DIR, in sorted (byte-wise) order of PREFIX,
 *       exactly as merge_datasets.py does. Other files in DIR are ignored; a .bin without its .idx
 *       (or the reverse) is an error.
 *   merge_datasets --input PREFIX1 PREFIX2 ... --output-prefix OUT
 *       merges the given datasets in the order given (an extension to Megatron's tool).
 *
 * Each dataset is appended with the builder's add_index: its sequence lengths, its document indices
 * shifted by the sequences before it, and a byte copy of its .bin. All inputs must share one token
 * dtype (that of the first). The output is written under temporary names and renamed into place,
 * so a failed merge leaves nothing behind. */
#define MEGATRON_IMPLEMENTATION
#include "../megatron.h"
#include "args.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static void usage(void) {
    fprintf(stderr,
            "usage: merge_datasets --input DIR --output-prefix OUT\n"
            "       merge_datasets --input PREFIX [PREFIX ...] --output-prefix OUT\n"
            "  --input DIR      merge every PREFIX.{bin,idx} pair in DIR, in sorted order (as Megatron)\n"
            "  --input PREFIX.. merge these datasets, in the order given\n"
            "  --output-prefix  write OUT.bin and OUT.idx\n");
}

static int die(const char* msg) {
    fprintf(stderr, "merge_datasets: error: %s\n", msg);
    return 1;
}

static int is_dir(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_file(const char* path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

static int cmp_str(const void* a, const void* b) { return strcmp(*(const char* const*)a, *(const char* const*)b); }

/* Collects the sorted prefixes of the .bin/.idx pairs in dir into *out (malloc'd strings). */
static int list_dir(const char* dir, char*** out, int* count, char* msg, size_t msgn) {
    DIR* d = opendir(dir);
    if (!d) {
        snprintf(msg, msgn, "cannot read directory %s", dir);
        return -1;
    }
    char** names = NULL;
    int n = 0, cap = 0;
    struct dirent* e;
    char path[4096];
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5) continue;
        const char* ext = e->d_name + len - 4;
        if (strcmp(ext, ".bin") != 0 && strcmp(ext, ".idx") != 0) continue;
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        if (!is_file(path)) continue;
        /* The pair's other file must exist. */
        snprintf(path, sizeof(path), "%s/%.*s%s", dir, (int)(len - 4), e->d_name,
                 strcmp(ext, ".bin") == 0 ? ".idx" : ".bin");
        if (!is_file(path)) {
            snprintf(msg, msgn, "%s/%s has no matching %s", dir, e->d_name, strcmp(ext, ".bin") == 0 ? ".idx" : ".bin");
            closedir(d);
            for (int i = 0; i < n; i++) free(names[i]);
            free(names);
            return -1;
        }
        if (strcmp(ext, ".bin") != 0) continue; /* count each pair once */
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            names = (char**)realloc(names, (size_t)cap * sizeof(char*));
        }
        snprintf(path, sizeof(path), "%s/%.*s", dir, (int)(len - 4), e->d_name);
        names[n++] = strdup(path);
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof(char*), cmp_str);
    *out = names;
    *count = n;
    return 0;
}

int main(int argc, char** argv) {
    argv = mt_args_split_equals(argc, argv, &argc); /* --flag=value is --flag value, as argparse */
    if (!argv) return 1;
    const char* output = NULL;
    const char** inputs = (const char**)calloc((size_t)argc, sizeof(char*));
    int num_inputs = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--input") == 0) {
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) inputs[num_inputs++] = argv[++i];
        } else if (strcmp(argv[i], "--output-prefix") == 0) {
            if (i + 1 >= argc) return 1 + die("--output-prefix needs a value"); /* usage errors exit 2 */
            output = argv[++i];
        } else if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
            usage();
            return 0;
        } else {
            usage();
            fprintf(stderr, "merge_datasets: error: unknown argument %s\n", argv[i]);
            return 2;
        }
    }
    if (num_inputs == 0 || !output) {
        usage();
        return 1 + die("--input and --output-prefix are required");
    }

    char msg[8192];
    char** prefixes = NULL;
    int n = 0;
    if (num_inputs == 1 && is_dir(inputs[0])) {
        if (list_dir(inputs[0], &prefixes, &n, msg, sizeof(msg)) != 0) return die(msg);
        if (n == 0) {
            snprintf(msg, sizeof(msg), "no .bin/.idx pairs in %s", inputs[0]);
            return die(msg);
        }
    } else {
        prefixes = (char**)calloc((size_t)num_inputs, sizeof(char*));
        for (int i = 0; i < num_inputs; i++) prefixes[n++] = strdup(inputs[i]);
    }
    for (int i = 0; i < n; i++)
        if (strcmp(prefixes[i], output) == 0) {
            snprintf(msg, sizeof(msg), "the output prefix %s is also an input", output);
            return die(msg);
        }

    /* The output takes the first dataset's dtype (merge_datasets.py does the same). */
    mt_error err;
    mt_indexed_dataset* first = NULL;
    if (mt_indexed_dataset_open(&first, prefixes[0], &err) != MT_OK) return die(err.message);
    int dtype = mt_indexed_dataset_dtype(first);
    mt_indexed_dataset_close(first);

    mt_indexed_writer* w = NULL;
    if (mt_indexed_writer_open(&w, output, dtype, &err) != MT_OK) return die(err.message);
    for (int i = 0; i < n; i++) {
        if (mt_indexed_writer_add_index(w, prefixes[i], &err) != MT_OK) {
            mt_indexed_writer_abort(w);
            return die(err.message);
        }
    }
    int64_t seqs = mt_indexed_writer_num_sequences(w), docs = mt_indexed_writer_num_documents(w);
    if (mt_indexed_writer_finalize(w, &err) != MT_OK) return die(err.message);

    mt_indexed_dataset* out = NULL;
    long long tokens = -1;
    if (mt_indexed_dataset_open(&out, output, &err) == MT_OK) {
        tokens = (long long)mt_indexed_dataset_num_tokens(out);
        mt_indexed_dataset_close(out);
    }
    printf("merged %d dataset%s into %s.{bin,idx}: %lld documents, %lld sequences, %lld tokens (%s)\n", n,
           n == 1 ? "" : "s", output, (long long)docs, (long long)seqs, tokens, mt_indexed_dtype_name(dtype));
    for (int i = 0; i < n; i++) free(prefixes[i]);
    free(prefixes);
    free(inputs);
    return 0;
}
