/* tests/test_header.h — megatron.h as a single-file library, used the way a user would use it.
 *
 * Each test makes a fresh directory under /tmp (mkdtemp) and copies headers into it side by side:
 * megatron.h alone, then megatron.h with its companion headers from prepro/. There it writes small
 * programs, one per inclusion idiom:
 *   - the implementation macro, then the include (here included twice: still one implementation);
 *   - a declarations-only include, with the implementation include further down the same file;
 *   - two translation units, one holding the implementation, linked together (and, for megatron.h,
 *     a C implementation linked into a C++ program). With the companions, the first idiom is this
 *     program's implementation file;
 *   - megatron.h only: MT_STATIC, two translation units each holding a private (static) copy of the
 *     implementation, linked into one program (without MT_STATIC their symbols would collide), and
 *     neither object file exporting an mt_ function (checked with nm where it is on the PATH).
 * It compiles them as strict C and as C++ with every warning an error, links them with what the
 * banners say and runs them: each calls real functions and exits non-zero on a wrong result. The
 * directory is removed afterwards. Skips when cc or c++ is not on the PATH, or when not run from the
 * repository root. The compilers run in parallel (one shell script per test): a few seconds. */
#ifndef MT_TEST_HEADER_H
#define MT_TEST_HEADER_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "test_common.h"

/* The flags the banners give. megatron.h alone: strict C99, no feature-test macro. The companions:
 * C11 (tokenizer.h's timespec_get) and POSIX visible (safetensors.h's fileno), pthreads. */
#define TH_WARN "-Wall -Wextra -pedantic -Werror"
#define TH_CC_ALONE "cc -std=c99 " TH_WARN
#define TH_CC_COMPANIONS "cc -std=c11 -D_POSIX_C_SOURCE=200809L " TH_WARN
#define TH_CXX "c++ -std=c++17 " TH_WARN
#define TH_LIBS_ALONE "-lm -lpthread"
#define TH_LIBS_COMPANIONS "-lm -lpthread"

/* ---- the programs (valid C99/C11 and C++17 alike) ---------------------------------------------- */

#define TH_PRELUDE                                                                                 \
    "#include <stdio.h>\n"                                                                         \
    "#include <stdlib.h>\n"                                                                        \
    "#include <string.h>\n"                                                                        \
    "static int th_fails;\n"                                                                       \
    "#define CHECK(c) do { if (!(c)) { fprintf(stderr, \"check failed, line %d: %s\\n\", __LINE__, #c); " \
    "th_fails++; } } while (0)\n"

/* megatron.h: the config (GPT-2 124M), the parameter count and FLOP formula, the LR schedule, a
 * static inline helper of the declarations, an error path, and a .bin/.idx round trip. */
#define TH_CHECK_MEGATRON                                                                          \
    "static int check_megatron(void) {\n"                                                          \
    "    mt_error err;\n"                                                                          \
    "    mt_config c, bad;\n"                                                                      \
    "    mt_config_defaults(&c);\n"                                                                \
    "    c.num_layers = 12; c.hidden_size = 768; c.num_attention_heads = 12; c.seq_length = 1024;\n" \
    "    c.vocab_size = 50257; c.micro_batch_size = 8; c.train_iters = 10; c.lr = 6e-4;\n"        \
    "    CHECK(mt_config_finalize(&c, &err) == MT_OK);\n"                                          \
    "    CHECK(c.padded_vocab_size == 50304 && c.ffn_hidden_size == 3072 && c.kv_channels == 64);\n" \
    "    CHECK(c.global_batch_size == 8 && mt_num_micro_batches(&c) == 1);\n"                      \
    "    CHECK(mt_num_parameters(&c) == 124475904);\n"                                             \
    "    double flops = mt_flops_per_iteration(&c, 8);\n"                                          \
    "    CHECK(flops > 6537477095423.5 && flops < 6537477095424.5);\n"                             \
    "    CHECK(mt_learning_rate(&c, 0) == 6e-4 && mt_learning_rate(&c, 80) == 0.0);\n"             \
    "    mt_param_info info[MT_NUM_PARAM_TENSORS];\n"                                              \
    "    CHECK(mt_param_layout(&c, info) == 124475904 && info[MT_P_QKV_WEIGHT].numel == 12 * 2304 * 768);\n" \
    "    CHECK(mt_tp_full_index(5, 2, 3, 4, 1) == 8);\n"                                           \
    "    mt_config_defaults(&bad);\n"                                                              \
    "    CHECK(mt_config_finalize(&bad, &err) == MT_ERR_CONFIG && strstr(err.message, \"--num-layers\"));\n" \
    "    CHECK(strcmp(mt_status_name(MT_ERR_IO), \"io error\") == 0);\n"                           \
    "    int32_t tokens[5] = {1, 2, 3, 65000, 7};\n"                                               \
    "    int64_t lengths[2] = {3, 2};\n"                                                           \
    "    mt_indexed_writer* w = NULL;\n"                                                           \
    "    CHECK(mt_indexed_writer_open(&w, \"th_data\", MT_DTYPE_UINT16, &err) == MT_OK);\n"        \
    "    if (w) {\n"                                                                               \
    "        CHECK(mt_indexed_writer_add_document(w, tokens, lengths, 2, &err) == MT_OK);\n"       \
    "        CHECK(mt_indexed_writer_finalize(w, &err) == MT_OK);\n"                               \
    "    }\n"                                                                                      \
    "    mt_indexed_dataset* ds = NULL;\n"                                                         \
    "    CHECK(mt_indexed_dataset_open(&ds, \"th_data\", &err) == MT_OK);\n"                       \
    "    if (ds) {\n"                                                                              \
    "        int32_t back[2] = {0, 0};\n"                                                          \
    "        CHECK(mt_indexed_dataset_num_sequences(ds) == 2 && mt_indexed_dataset_num_documents(ds) == 1);\n" \
    "        CHECK(mt_indexed_dataset_num_tokens(ds) == 5 && mt_indexed_dataset_dtype(ds) == MT_DTYPE_UINT16);\n" \
    "        CHECK(mt_indexed_dataset_read(ds, 1, 0, 2, back, &err) == MT_OK && back[0] == 65000 && back[1] == 7);\n" \
    "        mt_indexed_dataset_close(ds);\n"                                                      \
    "    }\n"                                                                                      \
    "    CHECK(mt_indexed_dataset_open(&ds, \"th_missing\", &err) == MT_ERR_IO);\n"                \
    "    return th_fails;\n"                                                                       \
    "}\n"

/* the companions: tokenizer names and the JSONL reader, a safetensors round trip, the HF
 * architectures (hf_gpt2.h, hf_llama.h, hf_moe.h) and a megatron.c checkpoint written and read back */
#define TH_CHECK_COMPANIONS                                                                        \
    "static int check_companions(void) {\n"                                                        \
    "    mt_error err;\n"                                                                          \
    "    mt_tokenizer_kind kind = MT_TOKENIZER_GPT2;\n"                                            \
    "    CHECK(mt_tokenizer_kind_from_name(\"cl100k_base\", &kind, &err) == MT_OK && kind == MT_TOKENIZER_CL100K);\n" \
    "    CHECK(strcmp(mt_tokenizer_kind_name(MT_TOKENIZER_O200K), \"o200k_base\") == 0);\n"       \
    "    const char* const keys[1] = {\"text\"};\n"                                                \
    "    const char* values[1] = {NULL};\n"                                                        \
    "    size_t lengths[1] = {0}, cap = 0;\n"                                                      \
    "    char* scratch = NULL;\n"                                                                  \
    "    const char* line = \"{\\\"text\\\": \\\"a\\\\u00e9\\\"}\";\n"                             \
    "    CHECK(mt_json_object_strings(line, strlen(line), keys, 1, values, lengths, &scratch, &cap, &err) == MT_OK);\n" \
    "    CHECK(lengths[0] == 3 && memcmp(values[0], \"a\\xc3\\xa9\", 3) == 0);\n"                 \
    "    free(scratch);\n"                                                                         \
    "    float data[6] = {1.0f, -2.0f, 0.5f, 3.0f, 4.0f, 0.25f}, back[6] = {0};\n"                 \
    "    mt_st_write_tensor t;\n"                                                                  \
    "    memset(&t, 0, sizeof(t));\n"                                                              \
    "    t.name = \"w\"; t.dtype = MT_ST_BF16; t.ndim = 2; t.shape[0] = 2; t.shape[1] = 3; t.data = data;\n" \
    "    CHECK(mt_safetensors_write(\"th.safetensors\", &t, 1, NULL, &err) == MT_OK);\n"           \
    "    mt_safetensors* st = NULL;\n"                                                             \
    "    CHECK(mt_safetensors_open(&st, \"th.safetensors\", &err) == MT_OK);\n"                    \
    "    if (st) {\n"                                                                              \
    "        const mt_st_tensor* r = mt_safetensors_find(st, \"w\");\n"                            \
    "        CHECK(r && r->dtype == MT_ST_BF16 && r->numel == 6);\n"                               \
    "        if (r) CHECK(mt_safetensors_read_f32(st, r, back, &err) == MT_OK && memcmp(back, data, sizeof(data)) == 0);\n" \
    "        mt_safetensors_close(st);\n"                                                          \
    "    }\n"                                                                                      \
    "    mt_config g, l, g2;\n"                                                                    \
    "    mt_config_defaults(&g);\n"                                                                \
    "    g.num_layers = 2; g.hidden_size = 64; g.num_attention_heads = 4; g.seq_length = 32;\n"    \
    "    g.vocab_size = 100; g.train_iters = 1;\n"                                                 \
    "    l = g;\n"                                                                                 \
    "    l.normalization = MT_NORM_RMSNORM; l.swiglu = 1; l.position_embedding_type = MT_POSITION_ROPE;\n" \
    "    l.add_bias_linear = 0; l.untie_embeddings_and_output_weights = 1; l.num_query_groups = 2;\n" \
    "    CHECK(mt_config_finalize(&g, &err) == MT_OK && mt_config_finalize(&l, &err) == MT_OK);\n" \
    "    const mt_hf_arch* arch = NULL;\n"                                                         \
    "    CHECK(mt_hf_arch_for_config(&g, &arch, &err) == MT_OK && arch == &mt_hf_gpt2_arch);\n"    \
    "    CHECK(arch && strcmp(arch->name, \"GPT2LMHeadModel\") == 0 && mt_hf_gpt2_num_tensors(&g) == 28);\n" \
    "    CHECK(mt_hf_arch_for_config(&l, &arch, &err) == MT_OK && arch == &mt_hf_llama_arch);\n"   \
    "    int64_t n = mt_num_parameters(&g);\n"                                                     \
    "    float* params = (float*)malloc(sizeof(float) * (size_t)n);\n"                             \
    "    float* read = NULL;\n"                                                                    \
    "    int64_t header[MT_CK_HEADER_WORDS];\n"                                                    \
    "    CHECK(params != NULL);\n"                                                                 \
    "    if (!params) return th_fails;\n"                                                          \
    "    for (int64_t i = 0; i < n; i++) params[i] = (float)i * 0.001f;\n"                         \
    "    CHECK(mt_hf_checkpoint_write(\"th_ckpt\", &g, params, 7, &err) == MT_OK);\n"              \
    "    CHECK(mt_hf_checkpoint_read(\"th_ckpt\", -1, 0, &g2, &read, header, NULL, &err) == MT_OK);\n" \
    "    CHECK(read && memcmp(read, params, sizeof(float) * (size_t)n) == 0);\n"                   \
    "    CHECK(header[MT_CK_MAGIC] == MT_CKPT_MAGIC && g2.num_layers == 2 && g2.hidden_size == 64);\n" \
    "    free(params);\n"                                                                          \
    "    free(read);\n"                                                                            \
    "    return th_fails;\n"                                                                       \
    "}\n"

#define TH_MAIN(call)                                                                              \
    "int main(void) {\n"                                                                           \
    "    if (" call " != 0) { fprintf(stderr, \"checks failed\\n\"); return 1; }\n"                \
    "    return 0;\n"                                                                              \
    "}\n"

/* megatron.h alone */
#define TH_IMPL_MEGATRON "#define MEGATRON_IMPLEMENTATION\n#include \"megatron.h\"\n"
static const char th_alone_single[] = /* the macro, then the include (twice: still one implementation) */
    TH_PRELUDE TH_IMPL_MEGATRON "#include \"megatron.h\"\n" TH_CHECK_MEGATRON TH_MAIN("check_megatron()");
static const char th_alone_later[] = /* declarations first; the implementation at the end of the file */
    "#include \"megatron.h\"\n" TH_PRELUDE TH_CHECK_MEGATRON TH_MAIN("check_megatron()") TH_IMPL_MEGATRON;
static const char th_alone_impl[] = TH_IMPL_MEGATRON; /* two files: the implementation ... */
static const char th_alone_main[] = /* ... and a program that sees the declarations only */
    "#include \"megatron.h\"\n" TH_PRELUDE TH_CHECK_MEGATRON TH_MAIN("check_megatron()");
/* MT_STATIC: two files, each with its own static copy of the implementation */
#define TH_IMPL_STATIC "#define MT_STATIC\n#define MEGATRON_IMPLEMENTATION\n#include \"megatron.h\"\n"
static const char th_static_a[] =
    TH_IMPL_STATIC TH_PRELUDE TH_CHECK_MEGATRON "int other_copy(void);\n" TH_MAIN("(check_megatron() + other_copy())");
static const char th_static_b[] =
    TH_IMPL_STATIC "int other_copy(void) { return mt_indexed_dtype_size(MT_DTYPE_UINT16) == 2 ? 0 : 1; }\n";
/* the two objects link, and neither exports an mt_ function (nm, where it is on the PATH) */
#define TH_STATIC_LINK(CC, LD, o)                                                                  \
    CC " -c static_a." o " -o static_a_" o ".o && " CC " -c static_b." o " -o static_b_" o ".o && " \
    "! { nm static_a_" o ".o static_b_" o ".o 2>/dev/null | grep ' T mt_'; } && "                  \
    LD " static_a_" o ".o static_b_" o ".o -o static_" o " " TH_LIBS_ALONE

/* megatron.h with the companions */
#define TH_IMPL_ALL_MACROS                                                                         \
    "#define MEGATRON_IMPLEMENTATION\n#define MT_TOKENIZER_IMPLEMENTATION\n"                       \
    "#define MT_SAFETENSORS_IMPLEMENTATION\n#define MT_HF_IMPLEMENTATION\n"
#define TH_INCLUDE_ALL                                                                             \
    "#include \"megatron.h\"\n#include \"tokenizer.h\"\n#include \"safetensors.h\"\n#include \"hf_checkpoint.h\"\n"
#define TH_IMPL_ALL TH_IMPL_ALL_MACROS TH_INCLUDE_ALL
#define TH_CHECK_BOTH "(check_megatron() + check_companions())"
static const char th_comp_later[] = /* declarations (through hf_gpt2.h), the implementations at the end */
    "#include \"hf_gpt2.h\"\n#include \"tokenizer.h\"\n" TH_PRELUDE TH_CHECK_MEGATRON TH_CHECK_COMPANIONS
    TH_MAIN(TH_CHECK_BOTH) TH_IMPL_ALL;
/* The implementation file is the first idiom: the macros, then the includes. hf_llama.h first (it
 * brings megatron.h, safetensors.h, hf_checkpoint.h and hf_gpt2.h), then all of them again, which
 * must add nothing. (A one-file program of this idiom would only compile the same code again.) */
static const char th_comp_impl[] =
    TH_IMPL_ALL_MACROS "#include \"hf_llama.h\"\n#include \"tokenizer.h\"\n" TH_INCLUDE_ALL;
static const char th_comp_main[] =
    "#include \"tokenizer.h\"\n#include \"hf_checkpoint.h\"\n" TH_PRELUDE TH_CHECK_MEGATRON TH_CHECK_COMPANIONS
    TH_MAIN(TH_CHECK_BOTH);

/* ---- the harness ------------------------------------------------------------------------------- */

typedef struct {
    const char* what; /* for the failure line */
    const char* build; /* shell commands, run in the directory */
    const char* run;   /* the program built */
} th_case;

static int th_write_file(const char* dir, const char* name, const void* data, size_t n) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE* f = fopen(path, "wb");
    if (!f) return -1;
    int bad = fwrite(data, 1, n, f) != n;
    if (fclose(f) != 0) bad = 1;
    return bad ? -1 : 0;
}

/* Copies the repository's file src into dir under its base name. */
static int th_copy(const char* src, const char* dir) {
    size_t n = 0;
    char* text = test_read_file(src, &n);
    if (!text) return -1;
    const char* base = strrchr(src, '/');
    int r = th_write_file(dir, base ? base + 1 : src, text, n);
    free(text);
    return r;
}

static void th_remove_dir(const char* dir) {
    if (strncmp(dir, "/tmp/mt_test_header_", 20) != 0 || strchr(dir, '\'')) return; /* never anything else */
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    if (system(cmd) != 0) printf("    note: could not remove %s\n", dir);
}

/* Prints the first lines of dir/name, indented, after a failure line. */
static void th_print_log(const char* dir, const char* name) {
    char path[512];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    char* text = test_read_file(path, NULL);
    if (!text) return;
    int lines = 0;
    for (char* p = text; *p && lines < 6; lines++) {
        char* nl = strchr(p, '\n');
        if (nl) *nl = 0;
        printf("      | %s\n", p);
        if (!nl) break;
        p = nl + 1;
    }
    free(text);
}

static int th_exit_status(int status) { return status == -1 ? -1 : WIFEXITED(status) ? WEXITSTATUS(status) : 128; }

/* Writes the sources, builds every case in parallel (one shell script: each case's commands in the
 * background, its output in build<i>.log and its status in build<i>.rc), then runs each program.
 * Prints one FAIL line (and the start of the compiler's or program's output) per failed step. */
static test_result th_build_and_run(const char* dir, const char* const* sources, int num_sources,
                                    const th_case* cases, int num_cases) {
    for (int i = 0; i + 1 < num_sources * 2; i += 2) {
        if (th_write_file(dir, sources[i], sources[i + 1], strlen(sources[i + 1])) != 0) {
            printf("    FAIL header: cannot write %s/%s\n", dir, sources[i]);
            return TEST_FAIL;
        }
    }
    char script[8192];
    size_t used = (size_t)snprintf(script, sizeof(script), "cd '%s' || exit 1\n", dir);
    for (int i = 0; i < num_cases && used < sizeof(script); i++)
        used += (size_t)snprintf(script + used, sizeof(script) - used, "{ ( %s ) > build%d.log 2>&1; echo $? > build%d.rc; } &\n",
                                 cases[i].build, i, i);
    if (used >= sizeof(script) - 8) {
        printf("    FAIL header: the build script does not fit its buffer\n");
        return TEST_FAIL;
    }
    strcat(script, "wait\n");
    if (th_write_file(dir, "build.sh", script, strlen(script)) != 0) {
        printf("    FAIL header: cannot write %s/build.sh\n", dir);
        return TEST_FAIL;
    }
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "sh '%s/build.sh'", dir);
    int status = th_exit_status(system(cmd));
    if (status != 0) {
        printf("    FAIL header: `%s` exited with %d\n", cmd, status);
        return TEST_FAIL;
    }
    test_result result = TEST_PASS;
    for (int i = 0; i < num_cases; i++) {
        char name[64], path[600];
        snprintf(path, sizeof(path), "%s/build%d.rc", dir, i);
        char* rc = test_read_file(path, NULL);
        int code = rc ? atoi(rc) : -1;
        free(rc);
        if (code != 0) {
            printf("    FAIL header: %s: the build failed (exit %d): %s\n", cases[i].what, code, cases[i].build);
            snprintf(name, sizeof(name), "build%d.log", i);
            th_print_log(dir, name);
            result = TEST_FAIL;
            continue;
        }
        snprintf(cmd, sizeof(cmd), "cd '%s' && rm -rf th_data.* th.safetensors th_ckpt && ./%s > run%d.log 2>&1", dir,
                 cases[i].run, i);
        code = th_exit_status(system(cmd));
        if (code != 0) {
            printf("    FAIL header: %s: ./%s exited with %d\n", cases[i].what, cases[i].run, code);
            snprintf(name, sizeof(name), "run%d.log", i);
            th_print_log(dir, name);
            result = TEST_FAIL;
        }
    }
    return result;
}

/* Skips unless cc and c++ are on the PATH and the repository's files are here; then makes the
 * directory and copies `files` into it. */
static test_result th_prepare(char* dir, size_t dir_size, const char* const* files, int num_files) {
    if (system("command -v cc > /dev/null 2>&1") != 0) SKIP("no cc on the PATH");
    if (system("command -v c++ > /dev/null 2>&1") != 0) SKIP("no c++ on the PATH");
    for (int i = 0; i < num_files; i++)
        if (access(files[i], R_OK) != 0) SKIP_OR_FAIL_STRICT("no %s (run from the repository root)", files[i]);
    snprintf(dir, dir_size, "/tmp/mt_test_header_XXXXXX");
    if (!mkdtemp(dir)) {
        printf("    FAIL header: mkdtemp %s failed\n", dir);
        return TEST_FAIL;
    }
    for (int i = 0; i < num_files; i++) {
        if (th_copy(files[i], dir) != 0) {
            printf("    FAIL header: cannot copy %s into %s\n", files[i], dir);
            th_remove_dir(dir);
            return TEST_FAIL;
        }
    }
    return TEST_PASS;
}

/* megatron.h copied alone: each idiom in C99 and C++17, and a C implementation in a C++ program. */
static test_result test_header_alone_each_idiom(void) {
    static const char* const files[] = {"megatron.h"};
    char dir[256];
    test_result r = th_prepare(dir, sizeof(dir), files, 1);
    if (r != TEST_PASS) return r;
    static const char* const sources[] = {
        "single.c", th_alone_single, "later.c", th_alone_later, "impl.c", th_alone_impl, "main.c", th_alone_main,
        "single.cpp", th_alone_single, "later.cpp", th_alone_later, "impl.cpp", th_alone_impl, "main.cpp", th_alone_main,
        "static_a.c", th_static_a, "static_b.c", th_static_b, "static_a.cpp", th_static_a, "static_b.cpp", th_static_b,
    };
    static const th_case cases[] = {
        {"C99, implementation macro then include", TH_CC_ALONE " single.c -o single_c " TH_LIBS_ALONE, "single_c"},
        {"C99, declarations then implementation in one file", TH_CC_ALONE " later.c -o later_c " TH_LIBS_ALONE,
         "later_c"},
        {"C99, implementation and program in two files",
         TH_CC_ALONE " -c impl.c -o impl_c.o && " TH_CC_ALONE " -c main.c -o main_c.o && "
         "cc impl_c.o main_c.o -o two_c " TH_LIBS_ALONE, "two_c"},
        {"C++17, implementation macro then include", TH_CXX " single.cpp -o single_cpp " TH_LIBS_ALONE, "single_cpp"},
        {"C++17, declarations then implementation in one file", TH_CXX " later.cpp -o later_cpp " TH_LIBS_ALONE,
         "later_cpp"},
        {"C++17, implementation and program in two files",
         TH_CXX " -c impl.cpp -o impl_cpp.o && " TH_CXX " -c main.cpp -o main_cpp.o && "
         "c++ impl_cpp.o main_cpp.o -o two_cpp " TH_LIBS_ALONE, "two_cpp"},
        {"a C99 implementation linked into a C++17 program",
         TH_CC_ALONE " -c impl.c -o impl_mixed.o && " TH_CXX " -c main.cpp -o main_mixed.o && "
         "c++ impl_mixed.o main_mixed.o -o mixed " TH_LIBS_ALONE, "mixed"},
        {"C99, MT_STATIC: two private copies of the implementation in one program", TH_STATIC_LINK(TH_CC_ALONE, "cc", "c"),
         "static_c"},
        {"C++17, MT_STATIC: two private copies of the implementation in one program", TH_STATIC_LINK(TH_CXX, "c++", "cpp"),
         "static_cpp"},
    };
    r = th_build_and_run(dir, sources, (int)(sizeof(sources) / sizeof(sources[0]) / 2), cases,
                         (int)(sizeof(cases) / sizeof(cases[0])));
    th_remove_dir(dir);
    return r;
}

/* megatron.h and the companion headers side by side (a user's copy): each idiom in C11 and C++17
 * (the first idiom is the implementation file of the two-file program). */
static test_result test_header_with_companions_each_idiom(void) {
    static const char* const files[] = {"megatron.h",          "prepro/tokenizer.h",     "prepro/unicode_tables.h",
                                        "prepro/safetensors.h", "prepro/hf_checkpoint.h", "prepro/hf_gpt2.h",
                                        "prepro/hf_llama.h",   "prepro/hf_moe.h"};
    char dir[256];
    test_result r = th_prepare(dir, sizeof(dir), files, (int)(sizeof(files) / sizeof(files[0])));
    if (r != TEST_PASS) return r;
    static const char* const sources[] = {
        "later.c", th_comp_later, "impl.c", th_comp_impl, "main.c", th_comp_main,
        "later.cpp", th_comp_later, "impl.cpp", th_comp_impl, "main.cpp", th_comp_main,
    };
    static const th_case cases[] = {
        {"C11, declarations then implementations in one file",
         TH_CC_COMPANIONS " later.c -o later_c " TH_LIBS_COMPANIONS, "later_c"},
        {"C11, implementations and program in two files",
         TH_CC_COMPANIONS " -c impl.c -o impl_c.o && " TH_CC_COMPANIONS " -c main.c -o main_c.o && "
         "cc impl_c.o main_c.o -o two_c " TH_LIBS_COMPANIONS, "two_c"},
        {"C++17, declarations then implementations in one file",
         TH_CXX " later.cpp -o later_cpp " TH_LIBS_COMPANIONS, "later_cpp"},
        {"C++17, implementations and program in two files",
         TH_CXX " -c impl.cpp -o impl_cpp.o && " TH_CXX " -c main.cpp -o main_cpp.o && "
         "c++ impl_cpp.o main_cpp.o -o two_cpp " TH_LIBS_COMPANIONS, "two_cpp"},
    };
    r = th_build_and_run(dir, sources, (int)(sizeof(sources) / sizeof(sources[0]) / 2), cases,
                         (int)(sizeof(cases) / sizeof(cases[0])));
    th_remove_dir(dir);
    return r;
}

static const test_case header_tests[] = {
    {"header_alone_each_idiom", test_header_alone_each_idiom},
    {"header_with_companions_each_idiom", test_header_with_companions_each_idiom},
};

#endif
