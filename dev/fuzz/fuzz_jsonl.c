/*
 * fuzz_jsonl — preprocess_data's JSON line parser: mt_json_object_strings on every line of the input,
 * each line in its own allocation; every value it returns must lie in the line or its scratch.
 * (fuzz_preprocess runs the whole pipeline on inputs of the same form.)
 *
 * Input: options byte (unused here), the JSON keys (one per line, at most 4; none: "text"), FZ_SEP,
 * the JSONL text.
 */
#include "fuzz_common.h"
#define MT_TOKENIZER_IMPLEMENTATION
#include "prepro/tokenizer.h"

static void fz_lines(const char* const* keys, int nk, const uint8_t* text, size_t size) {
    const char* values[4];
    size_t lengths[4];
    char* scratch = NULL;
    size_t scratch_cap = 0;
    mt_error err;
    for (size_t at = 0; at < size;) {
        const uint8_t* nl = (const uint8_t*)memchr(text + at, '\n', size - at);
        size_t len = nl ? (size_t)(nl - text) - at : size - at;
        /* the line in its own allocation, so that a read past its end is seen */
        char* line = (char*)malloc(len ? len : 1);
        memcpy(line, text + at, len);
        if (mt_json_object_strings(line, len, keys, nk, values, lengths, &scratch, &scratch_cap, &err) == MT_OK) {
            for (int k = 0; k < nk; k++) {
                int in_line = values[k] >= line && values[k] + lengths[k] <= line + len;
                int in_scratch = scratch && values[k] >= scratch && values[k] + lengths[k] <= scratch + scratch_cap;
                FZ_ASSERT(in_line || in_scratch || lengths[k] == 0, "value %d outside the line and the scratch", k);
                fz_touch(values[k], lengths[k]);
            }
        } else {
            fz_check_error(&err);
        }
        free(line);
        at += len + 1;
    }
    free(scratch);
}

int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    fz_jsonl_input in;
    if (fz_jsonl_input_parse(data, size, &in) != 0) return 0;
    fz_lines(in.keys, in.num_keys, in.text, in.text_size);
    free(in.keys_copy);
    return 0;
}
