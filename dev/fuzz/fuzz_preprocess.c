/*
 * fuzz_preprocess — preprocess_data whole: mt_preprocess on the input as a .jsonl file (the GPT-2
 * tokenizer, small batches so that lines cross batch boundaries, one or two workers), whose output
 * datasets are then opened and checked against the statistics it reported. (fuzz_jsonl runs the
 * line parser alone, many times faster; the inputs of both targets have the same form.)
 *
 * Input: options byte, the JSON keys (one per line, at most 4; none: "text"), FZ_SEP, the JSONL text.
 * Options: bit 1 --skip-bad-lines, bit 2 --append-eod, bit 3 two workers, bits 4-7 the batch size
 * (1 + 13 * value bytes).
 */
#include "fuzz_common.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

static mt_tokenizer* fz_gpt2;

int LLVMFuzzerInitialize(int* argc, char*** argv) {
    mt_error err;
    if (mt_tokenizer_load_gpt2(&fz_gpt2, "dev/data/gpt2/gpt2-vocab.json", "dev/data/gpt2/gpt2-merges.txt", &err) != MT_OK) {
        fprintf(stderr, "fuzz_jsonl: %s (run from the repository root)\n", err.message);
        abort();
    }
    return 0;
}

static void fz_pipeline(uint8_t opt, const char* const* keys, int nk, const uint8_t* text, size_t size) {
    fz_reset();
    char input[4200], prefix[4200];
    fz_write("in.jsonl", text, size, input, sizeof(input));
    fz_path("out", prefix, sizeof(prefix));
    const char* inputs[1] = {input};
    mt_preprocess_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.inputs = inputs;
    cfg.num_inputs = 1;
    cfg.format = MT_INPUT_JSONL;
    cfg.output_prefix = prefix;
    cfg.json_keys = keys;
    cfg.num_json_keys = nk;
    cfg.tokenizer = fz_gpt2;
    cfg.skip_bad_lines = (opt >> 1) & 1;
    cfg.append_eod = (opt >> 2) & 1;
    cfg.workers = 1 + ((opt >> 3) & 1);
    cfg.batch_bytes = 1 + 13 * (size_t)(opt >> 4);
    mt_preprocess_stats stats;
    mt_error err;
    if (mt_preprocess(&cfg, &stats, &err) != MT_OK) {
        fz_check_error(&err);
        return;
    }
    for (int k = 0; k < nk; k++) {
        char ds_prefix[4400];
        snprintf(ds_prefix, sizeof(ds_prefix), "%s_%s_document", prefix, keys[k]);
        mt_indexed_dataset* ds = NULL;
        FZ_ASSERT(mt_indexed_dataset_open(&ds, ds_prefix, &err) == MT_OK, "reading back %s: %s", ds_prefix, err.message);
        FZ_ASSERT(mt_indexed_dataset_num_documents(ds) == stats.documents, "%lld documents written, %lld reported",
                  (long long)mt_indexed_dataset_num_documents(ds), (long long)stats.documents);
        mt_indexed_dataset_close(ds);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_jsonl_input in;
    if (fz_jsonl_input_parse(data, size, &in) != 0) return 0;
    fz_pipeline(in.options, in.keys, in.num_keys, in.text, in.text_size);
    free(in.keys_copy);
    return 0;
}
