/*
 * fuzz_indexed — Megatron's .idx/.bin dataset reader and the GPT datasets built on it: mt_indexed_dataset_open
 * (validation of the index), reads of every sequence (in range, and out of range: refused), and
 * mt_gpt_data_open (--split, the document/sample/shuffle indices, the blend of two datasets) with
 * samples fetched from each split.
 *
 * Input: parameters, FZ_SEP, a.idx, FZ_SEP, a.bin[, FZ_SEP, b.idx, FZ_SEP, b.bin]. Parameters (little
 * endian): seq_length 2..65 (1 byte), seed (4), samples per split (3 x 2 bytes; >= 0x8000: None, else at
 * most 511), --split numbers (3 bytes), flags (1 byte: bit 0 weights "0.3 a 0.7 b" when there is a
 * second dataset, bit 1 the same dataset twice).
 */
#include "fuzz_common.h"

static void fz_read_all(const mt_indexed_dataset* ds) {
    mt_error err;
    const int64_t N = mt_indexed_dataset_num_sequences(ds), D = mt_indexed_dataset_num_documents(ds);
    FZ_ASSERT(N >= 0 && D >= 0, "%lld sequences, %lld documents", (long long)N, (long long)D);
    int64_t prev = 0;
    for (int64_t k = 0; k <= D && k < 4096; k++) {
        int64_t s = mt_indexed_dataset_document_start(ds, k);
        FZ_ASSERT(s >= prev && s <= N, "document %lld starts at %lld (previous %lld, N %lld)", (long long)k, (long long)s,
                  (long long)prev, (long long)N);
        prev = s;
    }
    FZ_ASSERT(mt_indexed_dataset_document_start(ds, -1) == -1 && mt_indexed_dataset_document_start(ds, D + 1) == -1,
              "document_start out of range");
    FZ_ASSERT(mt_indexed_dataset_sequence_length(ds, -1) == -1 && mt_indexed_dataset_sequence_length(ds, N) == -1,
              "sequence_length out of range");
    int32_t buf[4096];
    int64_t total = 0;
    for (int64_t i = 0; i < N && i < 4096; i++) {
        int64_t len = mt_indexed_dataset_sequence_length(ds, i);
        FZ_ASSERT(len >= 0, "sequence %lld of length %lld", (long long)i, (long long)len);
        total += len;
        int64_t count = len < 4096 ? len : 4096;
        mt_status st = mt_indexed_dataset_read(ds, i, len - count, count, buf, &err);
        if (st != MT_OK) { /* only a token that does not fit int32, or a float dtype, may be refused */
            const int dtype = mt_indexed_dataset_dtype(ds);
            FZ_ASSERT(st == MT_ERR_RANGE || (st == MT_ERR_FORMAT && (dtype == MT_DTYPE_FLOAT32 || dtype == MT_DTYPE_FLOAT64)),
                      "reading sequence %lld: %s", (long long)i, err.message);
            fz_check_error(&err);
        }
        FZ_ASSERT(mt_indexed_dataset_read(ds, i, len - count, count + 1, buf, &err) != MT_OK, "a read past sequence %lld",
                  (long long)i);
        FZ_ASSERT(mt_indexed_dataset_read(ds, i, -1, 1, buf, &err) != MT_OK, "a read at offset -1");
    }
    FZ_ASSERT(mt_indexed_dataset_read(ds, N, 0, 1, buf, &err) != MT_OK, "a read of sequence N");
    if (N <= 4096) FZ_ASSERT(total == mt_indexed_dataset_num_tokens(ds), "%lld tokens in the sequences, %lld in the index",
                             (long long)total, (long long)mt_indexed_dataset_num_tokens(ds));
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_parts p;
    fz_split(data, size, &p);
    size_t n;
    const uint8_t* params = fz_part(&p, 0, &n);
    fz_bytes b = {params, n};
    const int seq_length = 2 + (int)(fz_take(&b, 1) % 64);
    const uint32_t seed = (uint32_t)fz_take(&b, 4);
    int64_t samples[3];
    for (int k = 0; k < 3; k++) {
        uint64_t v = fz_take(&b, 2);
        samples[k] = v >= 0x8000 ? -1 : (int64_t)(v % 512);
    }
    char split[64];
    unsigned s0 = (unsigned)fz_take(&b, 1), s1 = (unsigned)fz_take(&b, 1), s2 = (unsigned)fz_take(&b, 1);
    snprintf(split, sizeof(split), "%u,%u,%u", s0, s1, s2);
    const unsigned flags = (unsigned)fz_take(&b, 1);

    fz_reset();
    char path[4200], prefix_a[4200], prefix_b[4200];
    size_t ni, nb;
    const uint8_t* idx = fz_part(&p, 1, &ni);
    const uint8_t* bin = fz_part(&p, 2, &nb);
    fz_write("a.idx", idx, ni, path, sizeof(path));
    fz_write("a.bin", bin, nb, path, sizeof(path));
    fz_path("a", prefix_a, sizeof(prefix_a));
    int two = p.count >= 5;
    if (two) {
        idx = fz_part(&p, 3, &ni);
        bin = fz_part(&p, 4, &nb);
        fz_write("b.idx", idx, ni, path, sizeof(path));
        fz_write("b.bin", bin, nb, path, sizeof(path));
    }
    fz_path(two ? "b" : "a", prefix_b, sizeof(prefix_b));
    if (flags & 2) two = 1; /* the same dataset twice */

    mt_error err;
    mt_indexed_dataset* ds = NULL;
    if (mt_indexed_dataset_open(&ds, prefix_a, &err) != MT_OK) {
        FZ_ASSERT(ds == NULL, "a failed open left a dataset");
        fz_check_error(&err);
        return 0;
    }
    fz_read_all(ds);
    mt_indexed_dataset_close(ds);

    const char* prefixes[2] = {prefix_a, prefix_b};
    const double weights[2] = {0.3, 0.7};
    mt_gpt_data* d = NULL;
    mt_status st = mt_gpt_data_open(&d, two ? 2 : 1, prefixes, two && (flags & 1) ? weights : NULL, split, seq_length, seed,
                                    samples, &err);
    if (st != MT_OK) {
        fz_check_error(&err);
        return 0;
    }
    int32_t* tokens = (int32_t*)malloc(sizeof(int32_t) * (size_t)(seq_length + 1));
    for (int s = 0; s < 3; s++) {
        const int64_t count = mt_gpt_data_num_samples(d, s);
        FZ_ASSERT(count >= 0, "split %d: %lld samples", s, (long long)count);
        if (samples[s] >= 0 && !two) FZ_ASSERT(count == 0 || count >= samples[s], "split %d: %lld samples of %lld asked",
                                                s, (long long)count, (long long)samples[s]);
        const int64_t at[] = {0, 1, count / 2, count - 2, count - 1};
        for (size_t k = 0; k < sizeof(at) / sizeof(at[0]); k++) {
            if (at[k] < 0 || at[k] >= count) continue;
            st = mt_gpt_data_get(d, s, at[k], tokens, &err);
            if (st != MT_OK) {
                FZ_ASSERT(st == MT_ERR_RANGE, "split %d sample %lld: %s", s, (long long)at[k], err.message);
                fz_check_error(&err);
            }
        }
        FZ_ASSERT(mt_gpt_data_get(d, s, count, tokens, &err) != MT_OK, "sample %lld of %lld", (long long)count,
                  (long long)count);
    }
    free(tokens);
    mt_gpt_data_close(d);
    return 0;
}
