/*
 * megatron.h — the public C API of megatron.c plus its host-only code, as one single-file library in
 * the stb manner.
 *
 * megatron.c is Megatron-LM's pretraining system as a small C/CUDA codebase. This header is the one
 * file you copy into another project. It declares the whole C API (C99 and C++, extern "C", every
 * public name prefixed mt_ / MT_) and implements its host-only part: Megatron's .bin/.idx datasets,
 * the GPT sample index and blending, the .npy writer, the configuration, learning-rate schedules and
 * FLOP formula, the parallel geometry (tensor-parallel shards, rank layout and pipeline stages, the
 * DDP buffer, pipeline schedules), the memory plan of any layout, the CPU AdamW, checkpoints (the
 * files and the rules for writing and reading them, and a reader of any layout) and TensorBoard
 * event files. A plain C program has all of that without CUDA.
 *
 * Use. Include it wherever you need the declarations. In exactly one C or C++ file of the program,
 * define MEGATRON_IMPLEMENTATION before including it: that file also gets the implementation.
 *
 *     // data.c: the one file that holds the implementation
 *     #define MEGATRON_IMPLEMENTATION
 *     #include "megatron.h"
 *
 *     // main.c, and any other file: declarations only
 *     #include "megatron.h"
 *
 *     cc -std=c99 data.c main.c -o prog -lm
 *
 * The implementation may also follow the declarations in the same file (when a header of yours has
 * already included megatron.h): `#define MEGATRON_IMPLEMENTATION` and `#include "megatron.h"` again
 * further down. The declarations and the implementation each appear once per translation unit,
 * however often the header is included.
 *
 * Define MT_STATIC as well (in the one file that defines MEGATRON_IMPLEMENTATION, before its first
 * include of the header) to make every function of the implementation static, private to that file,
 * as stb's STB_xxx_STATIC does: for a program that uses the header in one file only, or that links a
 * library holding a copy of its own. MT_DEF is the linkage macro this sets (define it yourself to
 * override it); the trainer API of section 15 keeps extern linkage (megatron.o defines it). The
 * header's version: MT_VERSION_MAJOR, MT_VERSION_MINOR, MT_VERSION_PATCH.
 *
 * Link: -lm (sqrt, pow, cos, ceil, nearbyint) -lpthread (the thread pool of the CPU AdamW; part of
 * libc from glibc 2.34 on).
 * Platform: POSIX. Besides ISO C the implementation calls open, read, write, close, fcntl, stat, fstat,
 * fsync, mmap, munmap, mkdir, rmdir, unlink, rename, opendir, readdir, closedir, getpid, gettimeofday,
 * uname and pthreads (<dirent.h>, <fcntl.h>, <sys/mman.h>, <sys/stat.h>, <unistd.h>, <sys/time.h>,
 * <sys/utsname.h>, <pthread.h>); it looks at /proc/<pid> to tell whether the process that left a
 * temporary file is gone (Linux; elsewhere such files are kept). On x86 with GCC or Clang the CPU
 * AdamW also uses AVX2 intrinsics (<immintrin.h>) in a function compiled for AVX2 + FMA, called only
 * when the CPU has them. Those headers are POSIX's own and declare these functions in strict ISO
 * modes too (glibc does; tests/test_header.h builds with -std=c99 -pedantic), so no feature-test
 * macro is needed: neither _POSIX_C_SOURCE nor
 * _GNU_SOURCE, and this header defines neither. On a system that hides them, define
 * _POSIX_C_SOURCE=200809L when compiling the implementation file.
 * The files it reads and writes are little-endian, as is every host it targets.
 *
 * The GPU side (the trainer, mt_comm_id_create, mt_device_*; section 15) is declared here and
 * implemented in megatron.cu, which defines MEGATRON_IMPLEMENTATION itself: megatron.o (built by
 * nvcc) holds this header's implementation too, so a program that links it (with -lcudart -lcublas
 * -lcublasLt -lnccl) defines MEGATRON_IMPLEMENTATION nowhere else, as train_gpt.c does.
 *
 * Companion headers (prepro/): tokenizer.h (MT_TOKENIZER_IMPLEMENTATION), safetensors.h
 * (MT_SAFETENSORS_IMPLEMENTATION) and hf_checkpoint.h with hf_gpt2.h and hf_llama.h
 * (MT_HF_IMPLEMENTATION) follow the same scheme. They include "megatron.h": keep them next to it, or
 * put its directory on the include path (-I), as this repository's builds do.
 *
 * Errors: every fallible function returns an mt_status and, when given a non-NULL mt_error*, a
 * one-line message naming the problem. Library code never exits and never prints.
 *
 * Sections (declarations in this order, then the implementation in the same order, each opening
 * with its banner; section 15 is implemented in megatron.cu):
 *    1. Status and errors
 *    2. Indexed datasets (.bin/.idx, Megatron MMIDIDX v1): reader and writer
 *    3. GPT datasets: --split, document/sample/shuffle index, blending, bit-exact with Megatron
 *    4. .npy writer (Megatron's index cache format)
 *    5. Training configuration, learning-rate schedule, FLOP formula
 *    6. Parameter tensors and tensor-parallel shards
 *    7. Rank layout and pipeline stages (the layer split)
 *    8. DDP buffer layout: buckets and distributed-optimizer shards
 *    9. Pipeline schedules
 *   10. Memory plan of any layout: arenas, recompute, optimizer pieces, --plan-layouts
 *   11. Thread pool
 *   12. CPU AdamW (optimizer offload)
 *   13. Checkpoint files: header and checks, names, tracker, retention, commit, integrity
 *   14. Checkpoints at any layout: the reader of any rank's part
 *   15. The trainer API (GPU; implemented in megatron.cu)
 *   16. TensorBoard event files
 */
#ifndef MEGATRON_H
#define MEGATRON_H

#include <stddef.h>
#include <stdint.h>

/* This header's version (semantic versioning: MAJOR changes with an incompatible change of the API,
 * MINOR with additions, PATCH with fixes). For the preprocessor only: nothing writes it into a file or
 * a log (the checkpoint format has its own MT_CKPT_VERSION, the datasets Megatron's version word). */
#define MT_VERSION_MAJOR 0
#define MT_VERSION_MINOR 1
#define MT_VERSION_PATCH 0

/* The linkage of every public function this header implements, on its declaration and its definition:
 * extern, or static (and unused-tolerant on GCC and Clang) where MT_STATIC is defined before the
 * include (see "Use." above). Not on section 15's trainer API: megatron.o defines it, another
 * translation unit, so those declarations are always extern. */
#ifndef MT_DEF
#ifdef MT_STATIC
#if defined(__GNUC__) || defined(__clang__)
#define MT_DEF static __attribute__((unused))
#else
#define MT_DEF static
#endif
#else
#define MT_DEF extern
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------- */
/* 1. Status and errors                                                                            */
/* ---------------------------------------------------------------------------------------------- */

typedef enum {
    MT_OK = 0,
    MT_ERR_IO,       /* a file could not be opened, read, written or renamed */
    MT_ERR_FORMAT,   /* a file's contents are not what they must be */
    MT_ERR_ARG,      /* a bad argument or flag value */
    MT_ERR_CONFIG,   /* an inconsistent configuration */
    MT_ERR_OOM,      /* host or device memory exhausted */
    MT_ERR_CUDA,     /* a CUDA runtime or cuBLAS call failed */
    MT_ERR_NCCL,     /* an NCCL call failed */
    MT_ERR_RANGE,    /* an index out of range */
    MT_ERR_NAN       /* a NaN or Inf where training needs a finite number (the loss, the gradient norm) */
} mt_status;

/* One clear line describing the last failure of a call that was handed this struct. */
typedef struct {
    char message[512];
} mt_error;

MT_DEF const char* mt_status_name(mt_status status);
/* printf-style: fills err (if not NULL) and returns status, so error paths read
 * `return mt_fail(err, MT_ERR_IO, "cannot open %s", path);` */
MT_DEF mt_status mt_fail(mt_error* err, mt_status status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;


/* ---------------------------------------------------------------------------------------------- */
/* 2. Indexed datasets (.bin/.idx, Megatron MMIDIDX v1): reader and writer                         */
/*    A dataset is <prefix>.idx + <prefix>.bin (megatron/core/datasets/indexed_dataset.py). The    */
/*    .idx is a 34-byte header (magic "MMIDIDX\0\0", u64 version 1, u8 dtype code, u64 N          */
/*    sequences, u64 D document-index entries), then int32 lengths[N], int64 byte pointers[N] and  */
/*    int64 document_indices[D] (0 ... N; document k is sequences [doc[k], doc[k+1])), little      */
/*    endian, unaligned, optionally followed by int8 modes[N] (multimodal). The .bin is the tokens */
/*    of every sequence back to back, headerless.                                                  */
/* ---------------------------------------------------------------------------------------------- */

/* Files: how this library and its tools read inputs and commit outputs (also used by megatron.cu's
 * checkpoints and the prepro/ tools).
 * - Where a regular file is meant (.idx/.bin, config, tokenizer and checkpoint files), a FIFO, a
 *   directory or a device is refused with one line before any open that could block: stat first,
 *   then open with O_NONBLOCK and fstat (still a regular file), then back to blocking reads.
 * - An output is written to mt_temporary_path(path) = "<path>.tmp.<pid>", fsync'ed, closed and
 *   moved into place with mt_commit_file (rename, then the directory fsync'ed), so a reader finds the
 *   old file or the new one. mt_remove_stale_temporaries(path), called by every writer before it
 *   starts, removes "<path>.tmp.<pid>..." files and trees of processes that are gone (a process not
 *   in /proc; where there is no /proc nothing is removed; a dataset writer first puts back an old
 *   pair that a crashed commit moved aside, see the writer below). Two writers of one path at once (even on
 *   two hosts of a shared file system) are not supported, as in Megatron. */
MT_DEF int mt_open_regular_file(const char* path, mt_error* err); /* read-only fd, or -1 (err set) */
/* A whole regular file of at most max_bytes, malloc'd and NUL-terminated (size excludes the NUL). */
MT_DEF mt_status mt_read_file(const char* path, size_t max_bytes, char** data, size_t* size, mt_error* err);
MT_DEF char* mt_temporary_path(const char* path); /* malloc'd "<path>.tmp.<pid>", NULL when out of memory */
/* rename(tmp, path) and fsync of path's directory; on failure tmp is removed. */
MT_DEF mt_status mt_commit_file(const char* tmp, const char* path, mt_error* err);
/* The whole file path from n chunks, committed as above (stale temporaries removed first). */
MT_DEF mt_status mt_write_file(const char* path, int n, const void* const* chunks, const size_t* sizes, mt_error* err);
MT_DEF int mt_sync_directory_of(const char* path); /* fsync of the directory holding path: 0 or -1 */
MT_DEF int mt_remove_stale_temporaries(const char* path); /* how many it removed */
MT_DEF int mt_remove_tree(const char* path);              /* rm -rf (no symlink followed): 0, or -1 */

/* Megatron's DType codes. preprocess writes 8 (uint16) for vocabularies < 65500, else 4 (int32). */
enum {
    MT_DTYPE_UINT8 = 1,
    MT_DTYPE_INT8 = 2,
    MT_DTYPE_INT16 = 3,
    MT_DTYPE_INT32 = 4,
    MT_DTYPE_INT64 = 5,
    MT_DTYPE_FLOAT64 = 6,
    MT_DTYPE_FLOAT32 = 7,
    MT_DTYPE_UINT16 = 8
};
MT_DEF size_t mt_indexed_dtype_size(int dtype_code);      /* bytes per token, 0 for an unknown code */
MT_DEF const char* mt_indexed_dtype_name(int dtype_code); /* "uint16", "int32", ... or "unknown" */
MT_DEF int mt_indexed_dtype_for_vocab(int64_t vocab_size); /* DType.optimal_dtype: 8 (uint16) if < 65500 else 4 */

/* Reader. Both files are mmapped and fully validated at open (header, sizes, document indices,
 * pointers = prefix sum of length*itemsize, .bin size); afterwards reads cannot go out of bounds.
 * A dataset is read-only and may be shared by threads. */
typedef struct mt_indexed_dataset mt_indexed_dataset;
MT_DEF mt_status mt_indexed_dataset_open(mt_indexed_dataset** out, const char* prefix, mt_error* err);
MT_DEF void mt_indexed_dataset_close(mt_indexed_dataset* ds);
MT_DEF const char* mt_indexed_dataset_prefix(const mt_indexed_dataset* ds);
MT_DEF int mt_indexed_dataset_dtype(const mt_indexed_dataset* ds);
MT_DEF int64_t mt_indexed_dataset_num_sequences(const mt_indexed_dataset* ds);
MT_DEF int64_t mt_indexed_dataset_num_documents(const mt_indexed_dataset* ds); /* D - 1 */
MT_DEF int64_t mt_indexed_dataset_num_tokens(const mt_indexed_dataset* ds);
/* Tokens of sequence i; -1 if i is out of range. */
MT_DEF int64_t mt_indexed_dataset_sequence_length(const mt_indexed_dataset* ds, int64_t i);
/* First sequence of document k, for k in [0, num_documents] (k = num_documents gives N); -1 if out
 * of range. A document with no sequences has document_start(k) == document_start(k+1). */
MT_DEF int64_t mt_indexed_dataset_document_start(const mt_indexed_dataset* ds, int64_t k);
/* count tokens of sequence seq starting at token offset, converted to int32 (integer dtypes only;
 * an int64 or uint token that does not fit int32 is MT_ERR_RANGE). */
MT_DEF mt_status mt_indexed_dataset_read(const mt_indexed_dataset* ds, int64_t seq, int64_t offset, int64_t count,
                                         int32_t* out, mt_error* err);

/* Writer: Megatron's IndexedDatasetBuilder. Writes <prefix>.bin.tmp.<pid> and <prefix>.idx.tmp.<pid>
 * (removing those of processes that are gone first) and commits them in finalize, so a failed or
 * aborted run leaves nothing behind. A pair is committed so that no instant shows a new .bin beside
 * an old .idx: the old .idx and then the old .bin are moved aside first, then the new .bin and last
 * the new .idx are renamed into place (both fsync'ed before), so the names never show a mixed pair
 * and the format stays Megatron's own. While no .idx is at its name (a commit under way, or one a
 * crash cut short) the reader above reads the old pair where the commit moved it
 * (<name>.tmp.<pid>.old), and the next writer of the prefix renames it back before it removes stale
 * temporaries: a reader finds the old pair or the new one, never nothing, and the old pair stays
 * until a new complete one replaces it. The reader checks, after mapping the .bin, that the .idx
 * path still names the file it mapped, so a dataset committed while it is being opened is refused
 * ("open it again") rather than read as a mix. Integer dtypes only; every token is range-checked against the
 * dtype before anything is written, so a rejected add_document leaves the writer unchanged. */
typedef struct mt_indexed_writer mt_indexed_writer;
MT_DEF mt_status mt_indexed_writer_open(mt_indexed_writer** out, const char* prefix, int dtype_code, mt_error* err);
/* One document of num_sequences sequences (tokens holds sum(sequence_lengths) tokens back to back).
 * num_sequences == 0 writes an empty document (a repeated entry in the document index), exactly as
 * Megatron's add_document does for a document that tokenizes to nothing. */
MT_DEF mt_status mt_indexed_writer_add_document(mt_indexed_writer* w, const int32_t* tokens,
                                                const int64_t* sequence_lengths, int64_t num_sequences,
                                                mt_error* err);
/* Appends a whole dataset (Megatron's add_index, used for merging): its lengths, its document
 * indices shifted by the current sequence count, and a byte copy of its .bin. The dtypes must match. */
MT_DEF mt_status mt_indexed_writer_add_index(mt_indexed_writer* w, const char* other_prefix, mt_error* err);
MT_DEF int64_t mt_indexed_writer_num_sequences(const mt_indexed_writer* w);
MT_DEF int64_t mt_indexed_writer_num_documents(const mt_indexed_writer* w);
/* Writes the .idx, renames both files into place and frees w, in every case (on failure the
 * temporary files are removed): mt_indexed_writer_prepare then mt_indexed_writers_commit of one. */
MT_DEF mt_status mt_indexed_writer_finalize(mt_indexed_writer* w, mt_error* err);
MT_DEF void mt_indexed_writer_abort(mt_indexed_writer* w); /* removes the temporary files, frees */
/* Several datasets as one set (preprocess_data's --json-keys): prepare each (the .bin flushed, the
 * .idx written, both fsync'ed under their temporary names; w stays open and abort still removes
 * them), and only when every one is prepared, commit them all: every old .idx and every old .bin
 * moved aside, then every new .bin and every new .idx renamed into place, then the old ones removed.
 * A failure (while preparing or committing) leaves every old dataset as it was; a crash while
 * committing leaves each dataset old or new (the old one read from, and at the next writer's open
 * restored from, where it was moved aside). Commit frees every writer. */
MT_DEF mt_status mt_indexed_writer_prepare(mt_indexed_writer* w, mt_error* err);
MT_DEF mt_status mt_indexed_writers_commit(mt_indexed_writer** writers, int count, mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* 3. GPT datasets: --split, document/sample/shuffle index, blending, bit-exact with Megatron      */
/*    megatron/core/datasets/{gpt_dataset.py, helpers.cpp, blended_dataset.py,                     */
/*    blended_megatron_dataset_builder.py, blended_megatron_dataset_config.py}. Every array below  */
/*    equals, element for element and in Megatron's dtype, what Megatron caches as                 */
/*    *-GPTDataset-{train,valid,test}-{document,sample,shuffle}_index.npy and                      */
/*    *-BlendedDataset-*-dataset_{index,sample_index}.npy for the same data, flags and seed.       */
/* ---------------------------------------------------------------------------------------------- */

enum { MT_SPLIT_TRAIN = 0, MT_SPLIT_VALID = 1, MT_SPLIT_TEST = 2 };
MT_DEF const char* mt_split_name(int split); /* "train", "valid", "test" */

/* --split "969,30,1": the numbers matched by the regex [.0-9]+, padded with zeros to three,
 * normalised by their sum; split i covers [begin[i], end[i]) of [0, 1], or is empty (Megatron's
 * None) when end <= begin. */
typedef struct {
    int present[3];
    double begin[3], end[3];
} mt_split_matrix;
MT_DEF mt_status mt_split_parse(const char* split, mt_split_matrix* out, mt_error* err);
/* Sequence range of split i in a dataset of n sequences: [int(round(begin*n)), int(round(end*n))),
 * Python's round, i.e. half to even (nearbyint under the default rounding mode). Empty: 0, 0. */
MT_DEF void mt_split_range(const mt_split_matrix* m, int split, int64_t n, int64_t* begin, int64_t* end);

/* Megatron's requested samples per split (training.py, get_train_valid_test_num_samples):
 * train train_iters*gbs, valid (train_iters // eval_interval + 1) * eval_iters * gbs, test
 * eval_iters*gbs. (With --train-samples, put that in out[0] instead.) eval_interval <= 0 counts as
 * no evaluation during training (valid = eval_iters*gbs). Negative counts, or products that do not
 * fit int64, are MT_ERR_CONFIG naming the flags. */
MT_DEF mt_status mt_gpt_num_samples(int64_t train_iters, int64_t eval_interval, int64_t eval_iters,
                                    int64_t global_batch_size, int64_t out[3], mt_error* err);

/* numpy.random.RandomState's generator: legacy MT19937 seeded with init_genrand(seed), and the
 * Fisher-Yates shuffle of RandomState.shuffle (for i = n-1 .. 1: j = random_interval(i), swap),
 * where random_interval(max) draws (32-bit, or 64-bit hi-word-first when max > 0xffffffff) words
 * masked by the smallest all-ones mask >= max until one is <= max. */
typedef struct {
    uint32_t key[624];
    int pos;
} mt_mt19937;
MT_DEF void mt_mt19937_seed(mt_mt19937* rng, uint32_t seed);
MT_DEF uint32_t mt_mt19937_next32(mt_mt19937* rng);
MT_DEF uint64_t mt_mt19937_next64(mt_mt19937* rng);
MT_DEF uint64_t mt_mt19937_interval(mt_mt19937* rng, uint64_t max);
/* Shuffles n elements of itemsize bytes (1, 2, 4 or 8) in place, exactly as RandomState.shuffle. */
MT_DEF void mt_shuffle(mt_mt19937* rng, void* data, int64_t n, size_t itemsize);

/* numpy's float64 sum (pairwise summation) and utils.normalize (w / sum(w)). */
MT_DEF double mt_numpy_sum(const double* x, int64_t n);
MT_DEF void mt_normalize_weights(const double* w, int n, double* out);

/* One split of one indexed dataset: Megatron's GPTDataset (the "mid-level" dataset).
 * Sequences [begin, end) of ds form one epoch of tokens_per_epoch tokens; with S = seq_length:
 *   num_epochs     the smallest E >= 1 with E*T >= num_samples*S + 1 (1 when num_samples < 0,
 *                  Megatron's None);
 *   separate final epoch  if E > 1 and (num_samples - ((E-1)*T - 1)//S) < int(0.80 * ((T-1)//S));
 *   document_index the split's sequence ids tiled E times and shuffled (E-1 epochs and the last
 *                  epoch shuffled separately when the final epoch is separate), int32;
 *   sample_index   [n+1][2] rows (position in document_index, token offset), n = (E*T - 1)//S,
 *                  helpers.cpp build_sample_idx; int32, or int64 when the document index is
 *                  longer than INT32_MAX;
 *   shuffle_index  a permutation of [0, n) (of [0, sans) and [sans, n) separately when the final
 *                  epoch is separate); uint32, or int64 when n >= 2^32 - 2.
 * One RandomState(seed) per dataset: document-index shuffle(s), then shuffle-index shuffle(s).
 * Sample k is tokens [k*S, k*S + S] of the shuffled token stream: S + 1 tokens. Building takes
 * O(E*sequences + n) memory and time; the dataset keeps a pointer to ds, which must outlive it. */
typedef struct mt_gpt_dataset mt_gpt_dataset;
typedef struct {
    int64_t begin, end;            /* the split's sequences */
    int64_t tokens_per_epoch;      /* T */
    int64_t num_samples_requested; /* -1: None */
    int64_t num_epochs;            /* E */
    int separate_final_epoch;
    int64_t num_samples_sans_final_epoch; /* first shuffle range: sans if separate, else n */
    int64_t num_samples;                  /* n = len(dataset) */
    int64_t document_index_length;
    const int32_t* document_index;
    int sample_index_itemsize; /* 4: int32, 8: int64 */
    const void* sample_index;  /* (n + 1) * 2 elements */
    int shuffle_index_itemsize; /* 4: uint32, 8: int64 */
    const void* shuffle_index;  /* n elements */
} mt_gpt_dataset_info;
MT_DEF mt_status mt_gpt_dataset_build(mt_gpt_dataset** out, const mt_indexed_dataset* ds, int64_t begin, int64_t end,
                                      int seq_length, uint32_t seed, int64_t num_samples, mt_error* err);
MT_DEF void mt_gpt_dataset_free(mt_gpt_dataset* g);
MT_DEF void mt_gpt_dataset_get_info(const mt_gpt_dataset* g, mt_gpt_dataset_info* info);
MT_DEF int64_t mt_gpt_dataset_num_samples(const mt_gpt_dataset* g);
MT_DEF int64_t mt_gpt_dataset_shuffle_index(const mt_gpt_dataset* g, int64_t i);
MT_DEF void mt_gpt_dataset_sample_index(const mt_gpt_dataset* g, int64_t row, int64_t* doc_position, int64_t* offset);
/* Sample idx (after the shuffle): seq_length + 1 tokens across document boundaries. */
MT_DEF mt_status mt_gpt_dataset_get(const mt_gpt_dataset* g, int64_t idx, int32_t* tokens, mt_error* err);
/* Writes <dir>/<name_prefix>{document_index,sample_index,shuffle_index}.npy (name_prefix may be
 * NULL), in Megatron's dtypes and numpy.save's exact bytes. */
MT_DEF mt_status mt_gpt_dataset_save_indices(const mt_gpt_dataset* g, const char* dir, const char* name_prefix,
                                             mt_error* err);

/* helpers.cpp build_blending_indices: for each sample s, the dataset d with the largest
 * weights[d]*max(s,1) - count[d] (lowest d on ties) supplies its next sample. No RNG. */
MT_DEF void mt_build_blending_indices(const double* weights, int num_datasets, int64_t size, int16_t* dataset_index,
                                      int64_t* dataset_sample_index);
/* helpers.cpp build_exhaustive_blending_indices: exactly sizes[d] samples from each dataset
 * (size = sum(sizes)), used for an unweighted blend whose split size is None. */
MT_DEF void mt_build_exhaustive_blending_indices(const int64_t* sizes, int num_datasets, int16_t* dataset_index,
                                                 int64_t* dataset_sample_index);

#define MT_MID_LEVEL_DATASET_SURPLUS 0.005 /* --mid-level-dataset-surplus default */

/* The train/valid/test datasets of a --data-path, as BlendedMegatronDatasetBuilder builds them:
 *   - one prefix and no weights: each split is that prefix's GPTDataset asked for num_samples[i];
 *   - weights (w1 p1 w2 p2 ..., also a single "1.0 p"): w = normalize(weights); dataset k's split i
 *     is asked for ceil(ceil(num_samples[i]*w[k]) * 1.005) samples; the blend has
 *     sum_k ceil(num_samples[i]*w[k]) samples, blended with normalize(w);
 *   - several prefixes and no weights: each dataset's split is one epoch (num_samples None); the
 *     blend has min(num_samples[i], sum of their lengths) samples weighted by those lengths
 *     (exhaustive blending when num_samples[i] < 0).
 * Each dataset and split has its own RandomState(seed). num_samples[i] < 0 means None. A split the
 * --split string leaves empty has 0 samples. A blend that asks a dataset for more samples than it
 * built is an error, as in Megatron. */
typedef struct mt_gpt_data mt_gpt_data;
MT_DEF mt_status mt_gpt_data_open(mt_gpt_data** out, int num_prefixes, const char* const* prefixes,
                                  const double* weights, const char* split, int seq_length, uint32_t seed,
                                  const int64_t num_samples[3], mt_error* err);
MT_DEF int64_t mt_gpt_data_num_samples(const mt_gpt_data* d, int split); /* 0 for an empty split */
MT_DEF mt_status mt_gpt_data_get(const mt_gpt_data* d, int split, int64_t index, int32_t* tokens /* [seq_length+1] */,
                                 mt_error* err);
MT_DEF void mt_gpt_data_close(mt_gpt_data* d);
MT_DEF int mt_gpt_data_num_datasets(const mt_gpt_data* d);
MT_DEF const mt_indexed_dataset* mt_gpt_data_indexed(const mt_gpt_data* d, int k);
MT_DEF int mt_gpt_data_is_blended(const mt_gpt_data* d);
MT_DEF const mt_split_matrix* mt_gpt_data_split_matrix(const mt_gpt_data* d);
/* Dataset k's GPTDataset for a split; NULL when the split is empty. */
MT_DEF const mt_gpt_dataset* mt_gpt_data_dataset(const mt_gpt_data* d, int split, int k);
/* A blended split's dataset_index (int16) and dataset_sample_index (int64), each
 * mt_gpt_data_num_samples long; NULL when not blended. */
MT_DEF const int16_t* mt_gpt_data_blend_dataset_index(const mt_gpt_data* d, int split);
MT_DEF const int64_t* mt_gpt_data_blend_sample_index(const mt_gpt_data* d, int split);

/* --data-path's arguments (utils.get_blend_from_list): an even number of entries whose every
 * other one (w1 p1 w2 p2 ...) is a number is a weighted blend; otherwise every entry is a prefix
 * (weights are then the datasets' lengths, or none for a single prefix). prefixes[] points into
 * args; prefixes and weights need room for n entries; *weighted says which form it was. A mix
 * (some weight positions numbers, some not) is refused rather than guessed. */
MT_DEF mt_status mt_data_path_parse(int n, const char* const* args, const char** prefixes, double* weights,
                                    int* num_prefixes, int* weighted, mt_error* err);

/* Megatron's MegatronPretrainingSampler (data_samplers.py) is sequential: it walks the global
 * sample indices from consumed_samples on in chunks of micro_batch_size * dp_size consecutive
 * indices, and data-parallel rank r takes [r*mbs, (r+1)*mbs) of each chunk; an incomplete last
 * chunk is dropped. consumed_samples grows by mbs*dp per micro-batch (by global_batch_size per
 * iteration), so micro-batch j of iteration it starts at it*gbs + j*mbs*dp. This returns the global
 * index of sample k (0 <= k < mbs) of rank dp_rank's next micro-batch. */
MT_DEF int64_t mt_sampler_index(int64_t consumed_samples, int64_t micro_batch_size, int dp_rank, int64_t k);

/* ---------------------------------------------------------------------------------------------- */
/* 4. .npy writer (Megatron's index cache format)                                                  */
/* ---------------------------------------------------------------------------------------------- */

/* Writes a C-order array in NumPy format 1.0 with numpy.save's exact header; dtype is a NumPy
 * descr: "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "|i1", "|u1", "<f4", "<f8". Written to a
 * temporary name and renamed. */
MT_DEF mt_status mt_npy_write(const char* path, const char* dtype, int ndim, const int64_t* shape, const void* data,
                              mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* 5. Training configuration, learning-rate schedule, FLOP formula                                 */
/*    Field names follow Megatron's flags (--hidden-size -> hidden_size). mt_config_defaults()     */
/*    gives Megatron's defaults; mt_config_finalize() derives what Megatron derives (padded vocab, */
/*    ffn size, kv channels, warmup and decay lengths) and rejects inconsistent configurations.    */
/* ---------------------------------------------------------------------------------------------- */

typedef enum { MT_FP32 = 0, MT_BF16 = 1, MT_FP16 = 2 } mt_precision;
typedef enum { MT_NORM_LAYERNORM = 0, MT_NORM_RMSNORM = 1 } mt_normalization;
/* none: no position information at all (NoPE; Megatron's --position-embedding-type none) */
typedef enum { MT_POSITION_LEARNED = 0, MT_POSITION_ROPE = 1, MT_POSITION_NONE = 2 } mt_position_embedding;

/* The identifier every rank of a job needs to join one NCCL communicator (ncclUniqueId's 128
 * bytes): rank 0 makes it (mt_comm_id_create, in megatron.cu) and the launcher broadcasts it. */
typedef struct { char internal[128]; } mt_comm_id;

typedef enum {
    MT_LR_CONSTANT = 0,
    MT_LR_LINEAR,
    MT_LR_COSINE,
    MT_LR_INVERSE_SQUARE_ROOT,
    MT_LR_WSD
} mt_lr_decay_style;

typedef enum { MT_WSD_EXPONENTIAL = 0, MT_WSD_LINEAR, MT_WSD_COSINE, MT_WSD_MINUS_SQRT } mt_wsd_decay_style;

/* FP8 (Megatron's --fp8-* flags, Transformer Engine's recipes). e4m3: every FP8 operand E4M3 (max
 * 448); hybrid: E4M3 forward (activations, weights), E5M2 (max 57344) for the gradients. */
typedef enum { MT_FP8_NONE = 0, MT_FP8_E4M3, MT_FP8_HYBRID } mt_fp8_format;
/* delayed: the scale from an amax history (updated after every step); tensorwise: from the tensor's
 * own amax at cast time; blockwise: 1x128 (activations, gradients) and 128x128 (weights) blocks */
typedef enum { MT_FP8_DELAYED = 0, MT_FP8_TENSORWISE, MT_FP8_BLOCKWISE } mt_fp8_recipe;
/* --cp-comm-type: how attention's context-parallel ranks exchange keys and values (Megatron's names):
 * p2p (a ring of K/V blocks), a2a (Ulysses: an all-to-all over heads), all_gather (K and V gathered whole) */
typedef enum { MT_CP_P2P = 0, MT_CP_A2A, MT_CP_ALL_GATHER } mt_cp_comm_type;
typedef enum { MT_FP8_AMAX_MOST_RECENT = 0, MT_FP8_AMAX_MAX } mt_fp8_amax_algo;
#define MT_FP8_E4M3_MAX 448.0f
#define MT_FP8_E5M2_MAX 57344.0f

/* Activation recompute, Megatron's --recompute-granularity / --recompute-method /
 * --recompute-num-layers / --recompute-modules: what each layer keeps for its backward, the rest
 * recomputed by replaying the forward's own kernels on the kept inputs (bit for bit the forward's).
 * The memory plan counts it and the trainer's activation slots are carved from that count
 * (mt_activation_layout_compute; where a layer's regions sit: mt_recompute_position). */
typedef enum { MT_RECOMPUTE_NONE = 0, MT_RECOMPUTE_SELECTIVE, MT_RECOMPUTE_FULL } mt_recompute_granularity;
typedef enum { MT_RECOMPUTE_UNIFORM = 0, MT_RECOMPUTE_BLOCK } mt_recompute_method;
/* selective's modules: the attention probabilities (exact path; flash attention keeps none anyway),
 * the second norm's output, the MLP's activation output, or the whole MLP's inner activations (fc1
 * and activation outputs); an MoE layer's: the experts' activation output (moe_act), or its experts'
 * and shared expert's activations, recomputed from the kept routing (moe; --moe-layer-recompute) */
enum { MT_RECOMPUTE_CORE_ATTN = 1, MT_RECOMPUTE_LAYERNORM = 2, MT_RECOMPUTE_ACT = 4, MT_RECOMPUTE_MLP = 8,
       MT_RECOMPUTE_MOE_ACT = 16, MT_RECOMPUTE_MOE = 32 };
typedef struct {
    mt_recompute_granularity granularity;
    mt_recompute_method method;   /* full: uniform keeps the input of every group of num_layers layers
                                     and recomputes a group at a time; block recomputes the first
                                     num_layers layers of each model chunk and keeps the rest */
    int num_layers;               /* full: --recompute-num-layers (0: uniform 1, block all) */
    int modules;                  /* selective: MT_RECOMPUTE_* bits (0: core_attn, Megatron's default) */
} mt_recompute;

#define MT_MAX_BATCH_SIZE_STEPS 64 /* entries of --step-batch-size-schedule */
#define MT_MAX_MOE_PATTERN 1024    /* entries of a --moe-layer-freq list (one per layer) */
/* --moe-router-load-balancing-type: the aux losses, bits (none: 0); their coefficients in this order */
enum { MT_MOE_AUX_LOSS = 1, MT_MOE_SEQ_AUX_LOSS = 2, MT_MOE_GLOBAL_AUX_LOSS = 4 };
/* What the router's kernels take (megatron.cu section 14; mt_config_check_supported refuses more): a token's
 * E scores in shared memory, its top k in a warp's lanes. */
#define MT_MOE_MAX_EXPERTS 1024
#define MT_MOE_MAX_TOPK 32

typedef struct {
    /* model */
    int num_layers;                   /* --num-layers */
    int hidden_size;                  /* --hidden-size */
    int ffn_hidden_size;              /* --ffn-hidden-size (0: 4*hidden_size) */
    int num_attention_heads;          /* --num-attention-heads */
    int num_query_groups;             /* --num-query-groups (0: = heads, i.e. no GQA) */
    int kv_channels;                  /* --kv-channels (0: hidden_size / heads) */
    int seq_length;                   /* --seq-length */
    int max_position_embeddings;      /* --max-position-embeddings (0: seq_length) */
    int64_t vocab_size;               /* the tokenizer's vocabulary */
    int make_vocab_size_divisible_by; /* --make-vocab-size-divisible-by (128) */
    int64_t padded_vocab_size;        /* derived: ceil(vocab / (divisible_by * tp)) * divisible_by * tp, or
                                       * the resumed checkpoint's (mt_padded_vocab_size_resumed) */
    int64_t resumed_padded_vocab_size;/* the padded vocabulary of the checkpoint this run loads (0: none) */
    double init_method_std;           /* --init-method-std (0.02) */
    double norm_epsilon;              /* --norm-epsilon (1e-5) */
    /* the model flavour: GPT-2 by default; Llama is RMSNorm + SwiGLU + RoPE + GQA + untied output,
     * no biases. Each switch is independent, as in Megatron. */
    mt_normalization normalization;   /* --normalization LayerNorm|RMSNorm */
    int swiglu;                       /* --swiglu: fc1 is [2f, h] = [gate; up], act = silu(gate) * up */
    int squared_relu;                 /* --squared-relu: act = relu(x)^2 instead of GELU (not with --swiglu) */
    int qk_layernorm;                 /* --qk-layernorm: after the QKV split each query and key head [kv_channels]
                                         goes through a norm of the model's kind (weights shared by the heads),
                                         before RoPE (Megatron-Core's q_layernorm / k_layernorm) */
    mt_position_embedding position_embedding_type; /* --position-embedding-type learned_absolute|rope|none */
    /* mixture of experts (Megatron-Core's MoE): the MLP of the layers --moe-layer-freq marks is a router,
     * top-k experts and optionally a shared expert (dev/moe_semantics.md). Without --num-experts every
     * other field is ignored (mt_config_finalize refuses the MoE flags without it). */
    int num_experts;                        /* --num-experts (0: no MoE, a dense model) */
    int moe_layer_freq;                     /* --moe-layer-freq N (1): layer l is MoE when l % N == 0 ... */
    /* ... or a pattern: --moe-layer-freq "([0]*3+[1]*29)" / "[1,0,1]": moe_layer_pattern_len > 0 entries of
     * 0/1, one per layer (then moe_layer_freq is ignored) */
    unsigned char moe_layer_pattern[MT_MAX_MOE_PATTERN];
    int moe_layer_pattern_len;
    int moe_ffn_hidden_size;                /* --moe-ffn-hidden-size (0: --ffn-hidden-size; finalize derives it) */
    int moe_router_topk;                    /* --moe-router-topk (2) */
    int moe_router_score_sigmoid;           /* --moe-router-score-function sigmoid (default softmax = 0) */
    int moe_router_pre_softmax;             /* --moe-router-pre-softmax */
    double moe_router_topk_scaling_factor;  /* --moe-router-topk-scaling-factor (0: none) */
    int moe_router_num_groups, moe_router_group_topk; /* --moe-router-num-groups / -group-topk (0: none) */
    int moe_load_balancing;                 /* --moe-router-load-balancing-type: MT_MOE_* bits (none: 0);
                                               default aux_loss */
    double moe_aux_loss_coeff[3];           /* --moe-aux-loss-coeff, one per type in the bits' order (0: off) */
    double moe_z_loss_coeff;                /* --moe-z-loss-coeff (0: none) */
    int moe_router_enable_expert_bias;      /* --moe-router-enable-expert-bias (aux-loss-free balancing) */
    double moe_router_bias_update_rate;     /* --moe-router-bias-update-rate (1e-3) */
    int moe_router_dtype_fp32;              /* --moe-router-dtype fp32 (default: the activations' dtype) */
    double moe_expert_capacity_factor;      /* --moe-expert-capacity-factor (0: dropless) */
    int moe_token_drop_position;            /* --moe-token-drop-policy position (default probs = 0) */
    int moe_pad_expert_input_to_capacity;   /* --moe-pad-expert-input-to-capacity */
    int moe_shared_expert_intermediate_size;/* --moe-shared-expert-intermediate-size (0: none) */
    int moe_shared_expert_gate;             /* --moe-shared-expert-gate: sigmoid gate on the shared output */
    int moe_grouped_gemm;                   /* --moe-grouped-gemm (same math; accepted) */
    int moe_token_dispatcher_alltoall;      /* --moe-token-dispatcher-type alltoall (default allgather = 0) */
    int expert_model_parallel_size;         /* --expert-model-parallel-size (1) */
    int expert_tensor_parallel_size;        /* --expert-tensor-parallel-size (0: = TP) */
    int moe_per_layer_logging;              /* --moe-per-layer-logging */
    int apply_layernorm_1p;           /* --apply-layernorm-1p: norm weights hold w - 1 (y = (1 + w) * norm) */
    double rotary_base;               /* --rotary-base (10000) */
    double rotary_percent;            /* --rotary-percent (1.0): the first rotary_percent * d channels rotate */
    int use_rope_scaling;             /* --use-rope-scaling: Llama-3.1's frequency scaling */
    double rope_scaling_factor;       /* --rope-scaling-factor (8); low/high frequency factors 1 and 4,
                                         original context 8192, as Megatron */
    int untie_embeddings_and_output_weights; /* --untie-embeddings-and-output-weights */
    int add_bias_linear;              /* 1 unless --disable-bias-linear */
    double hidden_dropout;            /* --hidden-dropout (0.1): embeddings and the two residual branches */
    double attention_dropout;         /* --attention-dropout (0.1): the attention probabilities */
    mt_precision precision;           /* --bf16 / --fp16, default fp32 */
    /* FP8: the four linears of each transformer layer (QKV, proj, fc1, fc2) run their forward,
     * input-gradient and weight-gradient GEMMs in FP8 on Hopper; everything else stays bf16 */
    mt_fp8_format fp8_format;         /* --fp8-format e4m3|hybrid (default: no FP8) */
    mt_fp8_recipe fp8_recipe;         /* --fp8-recipe delayed|tensorwise|blockwise (delayed) */
    int fp8_margin;                   /* --fp8-margin (0): scale = fp8_max / amax / 2^margin */
    int fp8_amax_history_len;         /* --fp8-amax-history-len (1) */
    mt_fp8_amax_algo fp8_amax_compute_algo; /* --fp8-amax-compute-algo max|most_recent (most_recent) */
    int fp8_wgrad;                    /* 1 unless --no-fp8-wgrad (then weight gradients in bf16) */
    int first_last_layers_bf16;       /* --first-last-layers-bf16: the layers below stay bf16 */
    int num_layers_at_start_in_bf16;  /* --num-layers-at-start-in-bf16 (1) */
    int num_layers_at_end_in_bf16;    /* --num-layers-at-end-in-bf16 (1) */
    int fp8_param_gather;             /* --fp8-param-gather: all-gather parameters in FP8 */
    /* fp16 dynamic loss scaler (Megatron's DynamicGradScaler) */
    double loss_scale;                /* --loss-scale: > 0 means a constant scale */
    double initial_loss_scale;        /* --initial-loss-scale (2^32) */
    double min_loss_scale;            /* --min-loss-scale (1) */
    int loss_scale_window;            /* --loss-scale-window (1000) */
    int hysteresis;                   /* --hysteresis (2) */
    /* optimizer and schedule */
    double lr;                        /* --lr */
    double min_lr;                    /* --min-lr (0) */
    double decoupled_lr;              /* --decoupled-lr (< 0: none): the word embeddings' and output layer's
                                         peak rate, on the same schedule (Megatron's decoupled learning rate) */
    double decoupled_min_lr;          /* --decoupled-min-lr (< 0: --min-lr) */
    double lr_warmup_init;            /* --lr-warmup-init (0) */
    mt_lr_decay_style lr_decay_style; /* --lr-decay-style (linear) */
    int64_t lr_warmup_iters;          /* --lr-warmup-iters (0) */
    double lr_warmup_fraction;        /* --lr-warmup-fraction (< 0: unset) */
    int64_t lr_decay_iters;           /* --lr-decay-iters (0: train_iters) */
    int64_t lr_wsd_decay_iters;       /* --lr-wsd-decay-iters (WSD's annealing tail) */
    /* sample-based training (--train-samples): the schedule's lengths are given in samples */
    int64_t lr_warmup_samples;        /* --lr-warmup-samples (0) */
    int64_t lr_decay_samples;         /* --lr-decay-samples (0: train_samples) */
    int64_t lr_wsd_decay_samples;     /* --lr-wsd-decay-samples (WSD's annealing tail in samples) */
    mt_wsd_decay_style lr_wsd_decay_style; /* --lr-wsd-decay-style (exponential) */
    double adam_beta1, adam_beta2, adam_eps; /* 0.9, 0.999, 1e-8 */
    double weight_decay;              /* --weight-decay (0.01) */
    double clip_grad;                 /* --clip-grad (1.0; 0 disables) */
    int check_for_nan_in_loss_and_grad; /* 1 unless --no-check-for-nan-in-loss-and-grad: a NaN/Inf loss, or
                                         gradient norm (outside fp16's loss scaler), stops train_step with
                                         MT_ERR_NAN before the optimizer applies it */
    /* batch and length of training */
    int micro_batch_size;             /* --micro-batch-size */
    int global_batch_size;            /* --global-batch-size (0: micro * data-parallel size) */
    int64_t train_iters;              /* --train-iters (with --train-samples: derived, as Megatron) */
    int64_t train_samples;            /* --train-samples: train on this many samples (0: --train-iters) */
    /* a global batch that grows with the samples consumed (mt_global_batch_size_at); at most one */
    int64_t rampup_batch_size[3];     /* --rampup-batch-size <start> <increment> <samples> (start 0: none) */
    int num_batch_size_steps;         /* --step-batch-size-schedule: its entries (0: none) */
    int64_t batch_size_step_samples[MT_MAX_BATCH_SIZE_STEPS]; /* from this many consumed samples on, */
    int batch_size_step_size[MT_MAX_BATCH_SIZE_STEPS];        /* the global batch has this many */
    /* the loss */
    int eod_mask_loss;                /* --eod-mask-loss: positions whose input token is eod_token do not count */
    int64_t eod_token;                /* the tokenizer's end-of-document id (for --eod-mask-loss and the resets) */
    int reset_position_ids;           /* --reset-position-ids: positions restart at 0 after each eod_token input */
    int reset_attention_mask;         /* --reset-attention-mask: a position attends only within its document */
    int calculate_per_token_loss;     /* --calculate-per-token-loss: the gradient of the global batch's loss
                                         sum / its counted tokens, instead of the mean of micro-batch means */
    uint64_t seed;                    /* --seed (1234) */
    /* what each train step reports besides the loss and the gradient norm (work done only when asked) */
    int log_params_norm;              /* --log-params-norm: the L2 norm of the fp32 master weights after the step */
    int log_num_zeros_in_grad;        /* --log-num-zeros-in-grad: the gradient elements that are exactly 0 */
    /* parallel layout (1 everywhere on one GPU) */
    int tensor_model_parallel_size;   /* --tensor-model-parallel-size: each layer split over TP GPUs */
    int sequence_parallel;            /* --sequence-parallel: norms and residuals hold BT/TP rows (TP > 1) */
    int pipeline_model_parallel_size; /* --pipeline-model-parallel-size: the layers split over PP stages */
    int virtual_pipeline_size;        /* --num-virtual-stages-per-pipeline-rank (1: non-interleaved 1F1B);
                                         --num-layers-per-virtual-pipeline-stage n gives L / (PP n) */
    int num_layers_per_virtual_pipeline_stage; /* that flag (0: unset), turned into virtual_pipeline_size */
    int microbatch_group_size_per_vp_stage; /* --microbatch-group-size-per-virtual-pipeline-stage (0: PP) */
    int decoder_first_pipeline_num_layers;  /* --decoder-first-pipeline-num-layers (-1: even split) */
    int decoder_last_pipeline_num_layers;   /* --decoder-last-pipeline-num-layers (-1: even split) */
    int account_for_embedding_in_pipeline_split; /* the embedding counts as a layer of the first stage */
    int account_for_loss_in_pipeline_split;      /* the output layer and loss count as a layer of the last */
    int context_parallel_size;        /* --context-parallel-size (1): each sequence cut into 2 CP chunks, rank r of
                                         the context-parallel group keeping chunks r and 2 CP - 1 - r */
    mt_cp_comm_type cp_comm_type;     /* --cp-comm-type (p2p) */
    int data_parallel_size;           /* derived: world / (tp * cp * pp) */
    /* data-parallel gradient reduction and optimizer (Megatron's DistributedDataParallelConfig) */
    int use_distributed_optimizer;    /* --use-distributed-optimizer: fp32 master + Adam sharded over DP */
    int overlap_grad_reduce;          /* --overlap-grad-reduce: reduce each bucket during the backward */
    int overlap_param_gather;         /* --overlap-param-gather: all-gather overlapped with the next forward */
    int grad_reduce_in_bf16;          /* --grad-reduce-in-bf16: the data-parallel reduction carries bf16 (half the
                                         bytes); gradients still accumulate in the fp32 buffer (mt_grad_reduce_scratch) */
    int64_t ddp_bucket_size;          /* --ddp-bucket-size in elements (0: max(40M, 1M * dp)) */
    /* optimizer offload (Megatron's HybridDeviceOptimizer): the fp32 master weights and Adam moments
     * of the last `fraction` of this rank's optimizer shard live in pinned host memory and are
     * updated by a multi-threaded CPU AdamW (mt_adamw_cpu) */
    int optimizer_cpu_offload;        /* --optimizer-cpu-offload */
    double optimizer_offload_fraction;/* --optimizer-offload-fraction (1.0), in [0, 1] */
    mt_recompute recompute;           /* --recompute-*: none by default */
    double distributed_timeout_minutes; /* --distributed-timeout-minutes (10): a collective or transfer
                                           that makes no progress this long is reported (multi-GPU jobs
                                           with a handler: mt_trainer_on_collective_timeout) */
    /* launch: filled by the launcher (train_gpt.c does it from MPI) */
    int world_size, rank;
    int local_rank;                   /* this process's GPU on its node */
    mt_comm_id comm_id;               /* NCCL id made by rank 0 with mt_comm_id_create, sent to every rank */
} mt_config;

MT_DEF void mt_config_defaults(mt_config* cfg);
/* Derives padded vocab, ffn, kv channels, max positions, global batch; checks consistency, and that
 * this build has what the config combines (mt_config_check_supported). */
MT_DEF mt_status mt_config_finalize(mt_config* cfg, mt_error* err);
/* Every "is this combination built here" rule, in one place: FP8 outside bf16, the shapes FP8 GEMMs
 * take, --fp8-param-gather with the blockwise recipe or optimizer offload, an uneven pipeline split
 * with virtual stages, a virtual-stage micro-batch group above PP; mixture of experts beyond phase 1
 * (MoE with TP or ETP above 1, PP together with EP above 1, FP8, linear biases with EP above 1,
 * --calculate-per-token-loss).
 * MT_OK, or MT_ERR_CONFIG with one line naming the combination and what to do instead. The config's
 * derived sizes must be there (mt_config_finalize calls it once they are; mt_trainer_create and
 * --plan-layouts, for each layout it plans, call it too), so the planner never approves a layout the
 * trainer refuses. Megatron's own refusals (inconsistent flags) stay in mt_config_finalize. */
MT_DEF mt_status mt_config_check_supported(const mt_config* cfg, mt_error* err);
MT_DEF int64_t mt_padded_vocab_size(int64_t vocab_size, int divisible_by, int tensor_parallel_size);
/* The padded vocabulary of a run that resumes a checkpoint padded to `saved` (0: none) at another
 * layout: `saved` itself when it covers vocab_size and divides by the new TP, so the model (padded
 * rows included, whose logits take part in the softmax) is the one that was saved and the loss curve
 * continues; else Megatron's padding at this TP (new rows start at 0: the loss moves). The trainer's
 * --load (through mt_config.resumed_padded_vocab_size) and checkpoint_tool's reshard use it. */
MT_DEF int64_t mt_padded_vocab_size_resumed(int64_t vocab_size, int divisible_by, int tensor_parallel_size,
                                            int64_t saved);
/* The launch: how many processes the launcher says it started, from its environment (lookup: a
 * getenv-like function, user its context; NULL lookup: getenv). mpirun's OMPI_COMM_WORLD_SIZE,
 * MPICH/Hydra's and srun --mpi=pmi2's PMI_SIZE, torchrun's WORLD_SIZE, srun's
 * SLURM_STEP_NUM_TASKS (the tasks of this srun step); the largest whole number above 1 among them,
 * else 1. SLURM_NTASKS alone does not count: in a batch script it is the allocation's, and the script
 * is one process (srun sets both inside a step). *source (if not NULL) names the variable. */
typedef const char* (*mt_env_lookup)(const char* name, void* user);
MT_DEF int mt_launcher_world_size(mt_env_lookup lookup, void* user, const char** source);
/* A process that sees `world` ranks (1 when built without MPI) refuses to start when the launcher
 * says it started more: each would train alone on GPU 0 and write the same --save directory.
 * MT_ERR_CONFIG with one line saying why and what to do (built_with_mpi picks the advice). */
MT_DEF mt_status mt_launcher_check(int world, int built_with_mpi, mt_env_lookup lookup, void* user, mt_error* err);
/* Overflow-safe size arithmetic: 1 when a * b (a + b) does not fit int64_t (then *out is untouched),
 * else 0 with the result in *out. mt_config_finalize checks every size product it derives with these. */
static inline int mt_mul_overflows_i64(int64_t a, int64_t b, int64_t* out) {
    if (a > 0 ? (b > 0 ? a > INT64_MAX / b : b < INT64_MIN / a)
              : (b > 0 ? a < INT64_MIN / b : (a != 0 && b < INT64_MAX / a)))
        return 1;
    *out = a * b;
    return 0;
}
static inline int mt_add_overflows_i64(int64_t a, int64_t b, int64_t* out) {
    if ((b > 0 && a > INT64_MAX - b) || (b < 0 && a < INT64_MIN - b)) return 1;
    *out = a + b;
    return 0;
}
/* Number of micro-batches one rank runs per iteration: global / (micro * dp). */
MT_DEF int mt_num_micro_batches(const mt_config* cfg);
/* The global batch of the iteration that starts after consumed_samples, and its micro-batches per
 * rank: global_batch_size, or the ramp's / step schedule's size at that point (Megatron's
 * num_microbatches_calculator). mt_config_finalize has checked that every size the run can reach
 * divides by micro-batch x data-parallel size. */
MT_DEF int mt_global_batch_size_at(const mt_config* cfg, int64_t consumed_samples);
MT_DEF int mt_num_micro_batches_at(const mt_config* cfg, int64_t consumed_samples);
/* --step-batch-size-schedule "THRESHOLD:BATCH ...": thresholds in tokens (suffixes K, M, B, T as
 * powers of 1000, decimals allowed: 2.4B), turned into samples by // seq_length as Megatron does;
 * entries separated by spaces or commas, sorted by threshold; the first must be 0, thresholds
 * strictly increasing, batch sizes positive. Fills cfg's num_batch_size_steps and tables. */
MT_DEF mt_status mt_batch_size_schedule_parse(const char* text, int seq_length, mt_config* cfg, mt_error* err);

/* --moe-layer-freq: an integer N (layer l is MoE when l % N == 0), or Megatron's Python list expression
 * of one 0/1 per layer: a list literal "[1,0,1]", sums of lists "[0]*3+[1]*29" (a list times a count,
 * or a count times a list), parenthesised groups, repeated: "([1]*3+[0])*2". Sets moe_layer_freq, or
 * moe_layer_pattern and its length (at most MT_MAX_MOE_PATTERN entries); the length against
 * --num-layers is mt_config_finalize's check. MT_ERR_ARG with one line on anything else. */
MT_DEF mt_status mt_moe_layer_freq_parse(const char* text, mt_config* cfg, mt_error* err);

/* Megatron's OptimizerParamScheduler, counted in samples: `num_steps` grows by the global batch
 * size after each optimizer step, and the step taken at num_steps uses mt_learning_rate(cfg, num_steps). */
MT_DEF double mt_learning_rate(const mt_config* cfg, int64_t num_steps);
/* The rate of the word embeddings and the output layer (Megatron's is_embedding_or_output_parameter):
 * the same schedule from --decoupled-lr down to --decoupled-min-lr (else --min-lr); without
 * --decoupled-lr, mt_learning_rate's. */
MT_DEF double mt_learning_rate_decoupled(const mt_config* cfg, int64_t num_steps);
/* 1 for the tensors --decoupled-lr applies to (the word embeddings and the output layer) */
MT_DEF int mt_param_lr_decoupled(int tensor);

/* Megatron's num_floating_point_operations for one global batch (training.py), and the parameter count. */
MT_DEF double mt_flops_per_iteration(const mt_config* cfg, int64_t global_batch_size);
MT_DEF int64_t mt_num_parameters(const mt_config* cfg);

/* Mixture of experts. mt_moe_layer: 1 when layer l (0-based) is an MoE layer (num_experts > 0 and
 * --moe-layer-freq's int N with l % N == 0, or its pattern's entry 1); mt_moe_num_layers counts them. */
MT_DEF int mt_moe_layer(const mt_config* cfg, int layer);
MT_DEF int mt_moe_num_layers(const mt_config* cfg);
/* The expert width fe (--moe-ffn-hidden-size, else --ffn-hidden-size). */
MT_DEF int64_t mt_moe_ffn(const mt_config* cfg);
/* Tokens one expert may take in a micro-batch of N tokens: 0 when dropless (no capacity factor), else
 * ceil((N k / E) * factor), N k / E in double and the factor rounded to float first (as Python's
 * ceil((N * k / E) * f32(factor)) in dev/ref_moe.py capacity_of, which is Megatron's). */
MT_DEF int64_t mt_moe_capacity(const mt_config* cfg, int64_t tokens);
/* The permuted rows' bound of a micro-batch of N tokens: N k dropless; with a capacity C: N k when
 * C >= N (nothing dropped), E C when padded to capacity, else min(N k, E C). */
MT_DEF int64_t mt_moe_max_rows(const mt_config* cfg, int64_t tokens);
/* Expert parallelism (EP > 1): the bound of the rows an EP rank's E / EP local experts receive from its EP
 * group, each rank routing N tokens: every rank's rows for those experts, EP x min(N k, E/EP x C) (C = N
 * when dropless; padded to capacity: exactly EP x E/EP x min(C, N)). The worst case of an all-to-all
 * dispatch, which the memory plan reserves: a dropless run may send all of a group's rows to one rank
 * (a capacity factor bounds it). mt_moe_max_rows at EP = 1. */
MT_DEF int64_t mt_moe_expert_rows(const mt_config* cfg, int64_t tokens);
/* The trainer's MoE state (megatron.cu; the memory plan's workspace counts it), for L MoE layers of E
 * experts: four allocations, each rounded up to 256 bytes: the expert bias [L, E] fp32, a step's tokens
 * per expert [L, E], the global aux loss's running sums [L, E] and the running average [E], the logged
 * losses [L, 4] fp32, and the experts' grouped GEMMs' device pointer table (6 GEMMs x 3 matrices x E); then
 * the cuBLAS workspaces of the experts' side streams (MT_MOE_GEMM_STREAMS x MT_CUBLAS_WORKSPACE_BYTES: each side
 * stream's handle has its own, as large as the compute stream's, megatron.cu section 17). */
#define MT__MOE_ALIGN256(x) ((((size_t)(x)) + 255) & ~(size_t)255)
#define MT_MOE_GEMM_POINTERS(E) ((size_t)6 * 3 * (size_t)(E)) /* the experts' grouped GEMMs' pointer table */
#define MT_MOE_GEMM_STREAMS 4 /* side streams the experts' GEMMs may spread over (MT_MOE_GEMM=streams) */
#define MT_MOE_STATE_BYTES(L, E)                                                                      \
    ((L) > 0 ? 2 * MT__MOE_ALIGN256((size_t)(L) * (size_t)(E) * 4) +                                   \
                   MT__MOE_ALIGN256(((size_t)(L) + 1) * (size_t)(E) * 4) + MT__MOE_ALIGN256((size_t)(L) * 4 * 4) + \
                   MT__MOE_ALIGN256(MT_MOE_GEMM_POINTERS(E) * sizeof(void*)) +                          \
                   (size_t)MT_MOE_GEMM_STREAMS * MT_CUBLAS_WORKSPACE_BYTES                              \
             : (size_t)0)

/* FP8: whether transformer layer l runs its linears in FP8 (FP8 on, and l outside the bf16 layers
 * of --first-last-layers-bf16). */
MT_DEF int mt_fp8_layer(const mt_config* cfg, int layer);
/* Delayed scaling (Transformer Engine's DelayedScaling): the scale of one tensor after a step, from
 * its amax history [len] (max over it, or the most recent entry `newest`), the format's max and the
 * margin: fp8_max / amax / 2^margin; the previous scale when that amax is 0 or not finite. The
 * GPU's update (megatron.cu) computes exactly this. */
MT_DEF float mt_fp8_delayed_scale(const float* history, int len, int newest, mt_fp8_amax_algo algo, float fp8_max,
                                  int margin, float previous_scale);

/* ---------------------------------------------------------------------------------------------- */
/* 6. Parameter tensors and tensor-parallel shards                                                 */
/*    Where every parameter element lives: each tensor's place in the canonical order              */
/*    (checkpoints, test vectors) and the slice of it a tensor-parallel rank holds.                */
/* ---------------------------------------------------------------------------------------------- */

/* The model's parameter tensors in canonical order (the order of checkpoints and test vectors).
 * A tensor the flavour does not have has numel 0 and takes no space: position embeddings with RoPE,
 * the norm biases with RMSNorm, the linear biases with --disable-bias-linear, the query and key
 * norms without --qk-layernorm, the output weight while it is tied to the word embeddings (so a
 * model without a switch has the same files as before the switch existed). f1 = 2f with SwiGLU
 * (gate rows, then up rows), else f. The per-layer tensors are MT_P_LN1_WEIGHT .. MT_P_LAST_LAYER_TENSOR
 * (mt_param_per_layer); each is stacked over the layers that have it: the dense MLP's (fc1, fc2) over
 * the dense layers, the MoE tensors (router .. shared gate, dev/ref_moe.py's canonical order) over the
 * MoE layers (mt_moe_layer), every other one over all layers. A dense model has no MoE tensors (numel
 * 0), so its files and layouts are those of before MoE existed; this build (phase 1) runs MoE models
 * whose every layer is MoE (mt_config_check_supported), where the dense MLP's tensors have numel 0.
 * MoE shapes: E experts, fe = mt_moe_ffn, f1e = 2 fe with SwiGLU (each expert's gate rows, then its up
 * rows), fs = --moe-shared-expert-intermediate-size, fs1 = 2 fs with SwiGLU. */
enum {
    MT_P_WORD_EMBEDDINGS = 0, /* [Vp, h] */
    MT_P_POSITION_EMBEDDINGS, /* [P, h]  (learned_absolute only) */
    MT_P_LN1_WEIGHT,          /* [L, h] */
    MT_P_LN1_BIAS,            /* [L, h]  (LayerNorm only) */
    MT_P_QKV_WEIGHT,          /* [L, (heads + 2 * groups) * kv, h], Megatron's grouped layout */
    MT_P_QKV_BIAS,            /* [L, (heads + 2 * groups) * kv] */
    MT_P_Q_LAYERNORM_WEIGHT,  /* [L, kv]  (--qk-layernorm only): the queries' norm, shared by every head */
    MT_P_Q_LAYERNORM_BIAS,    /* [L, kv]  (--qk-layernorm with LayerNorm) */
    MT_P_K_LAYERNORM_WEIGHT,  /* [L, kv]  (--qk-layernorm only): the keys' norm */
    MT_P_K_LAYERNORM_BIAS,    /* [L, kv]  (--qk-layernorm with LayerNorm) */
    MT_P_PROJ_WEIGHT,         /* [L, h, heads * kv] */
    MT_P_PROJ_BIAS,           /* [L, h] */
    MT_P_LN2_WEIGHT,          /* [L, h] */
    MT_P_LN2_BIAS,            /* [L, h]  (LayerNorm only) */
    MT_P_FC1_WEIGHT,          /* [L, f1, h] */
    MT_P_FC1_BIAS,            /* [L, f1] */
    MT_P_FC2_WEIGHT,          /* [L, h, f] */
    MT_P_FC2_BIAS,            /* [L, h] */
    MT_P_ROUTER_WEIGHT,       /* [L, E, h]      whole on every TP rank */
    MT_P_ROUTER_BIAS,         /* [L, E]         (--add-bias-linear only) */
    MT_P_EXPERT_FC1_WEIGHT,   /* [L, E, f1e, h] each expert's rows cut over TP like fc1's (ETP = TP) */
    MT_P_EXPERT_FC1_BIAS,     /* [L, E, f1e]    (--add-bias-linear only) */
    MT_P_EXPERT_FC2_WEIGHT,   /* [L, E, h, fe]  each expert's input columns cut over TP like fc2's */
    MT_P_EXPERT_FC2_BIAS,     /* [L, E, h]      (--add-bias-linear only) whole */
    MT_P_SHARED_FC1_WEIGHT,   /* [L, fs1, h]    (shared expert) as fc1 */
    MT_P_SHARED_FC2_WEIGHT,   /* [L, h, fs]     (shared expert) as fc2 */
    MT_P_SHARED_GATE_WEIGHT,  /* [L, h]         (--moe-shared-expert-gate) whole */
    MT_P_FINAL_LN_WEIGHT,     /* [h] */
    MT_P_FINAL_LN_BIAS,       /* [h]     (LayerNorm only) */
    MT_P_OUTPUT_WEIGHT,       /* [Vp, h] (--untie-embeddings-and-output-weights only) */
    MT_NUM_PARAM_TENSORS,
    MT_P_LAST_LAYER_TENSOR = MT_P_SHARED_GATE_WEIGHT /* the per-layer tensors: MT_P_LN1_WEIGHT .. this */
};
/* 1 for the per-layer tensors (stacked over layers), 0 for the embeddings, final norm, output layer. */
static inline int mt_param_per_layer(int tensor) { return tensor >= MT_P_LN1_WEIGHT && tensor <= MT_P_LAST_LAYER_TENSOR; }
/* 1 for the MoE layers' tensors (router .. shared gate), which only MoE layers have. */
static inline int mt_param_moe(int tensor) { return tensor >= MT_P_ROUTER_WEIGHT && tensor <= MT_P_SHARED_GATE_WEIGHT; }
/* The random stream a tensor's initial values are drawn from: its index in the order of before the MoE
 * tensors existed (so a dense model's initial weights are those it always had), the MoE tensors after
 * all of those. */
static inline int mt_param_init_stream(int tensor) {
    const int moe = MT_P_SHARED_GATE_WEIGHT - MT_P_ROUTER_WEIGHT + 1;
    return tensor < MT_P_ROUTER_WEIGHT ? tensor : tensor > MT_P_SHARED_GATE_WEIGHT ? tensor - moe
                                                                                    : tensor - MT_P_ROUTER_WEIGHT + MT_NUM_PARAM_TENSORS - moe;
}
/* Whether layer `layer` has per-layer tensor `tensor`: the MoE tensors in MoE layers (mt_moe_layer), the
 * dense MLP's (fc1, fc2 and their biases) in the other layers, every other per-layer tensor in all. */
MT_DEF int mt_param_layer_has(const mt_config* cfg, int tensor, int layer);
typedef struct {
    const char* name;
    int64_t numel;
    int64_t offset;        /* in elements, into the one flat parameter buffer */
    int weight_decay;      /* 1 for matrices and embeddings, 0 for biases and norms (Megatron) */
    int init;              /* 0 zeros, 1 ones, 2 normal(std), 3 normal(std / sqrt(2 L)) */
    /* Tensor parallelism: each layer's slice, viewed as [split_outer, split_rows, split_inner] of the
     * full model, has its rows cut into TP equal parts, rank r holding part r (tp_split = 0: every
     * rank holds all of it). Column-parallel weights and biases (QKV, fc1) and the vocab-parallel
     * embeddings and output layer are cut by output rows; row-parallel weights (proj, fc2) by input
     * columns (outer = out, rows = in, inner = 1); fc1 with SwiGLU is [2, f, h] so each rank holds
     * its gate rows and its up rows; norms, row-parallel biases and position embeddings are whole. */
    int tp_split;
    int64_t split_outer, split_rows, split_inner;
    /* Expert parallelism: the experts' tensors (expert_fc1/fc2 weights and biases) have their outer
     * dimension (experts outermost) cut into EP equal parts, expert-parallel rank e holding part e: its
     * E / EP local experts (ep_split = 0: every EP rank holds all of it). */
    int ep_split;
} mt_param_info;
/* The full model: fills info[MT_NUM_PARAM_TENSORS]; returns the total element count. */
MT_DEF int64_t mt_param_layout(const mt_config* cfg, mt_param_info* info);
/* One model-parallel rank's shard (every rank's is the same shape): a tensor-parallel rank's rows and,
 * with expert parallelism, an expert-parallel rank's experts; numel and offset count this rank's
 * elements, in the same canonical order. Equals mt_param_layout at TP = EP = 1. Shard s (the argument
 * `shard_rank` below) is TP rank s % TP of EP rank s / TP. */
MT_DEF int64_t mt_param_layout_shard(const mt_config* cfg, mt_param_info* info);
/* Copies between a full-model canonical array and shard shard_rank's shard-layout array (from the
 * full one when to_shard, else into it); shard_rank = tp_rank + TP * ep_rank (the TP rank at EP = 1). */
MT_DEF void mt_tp_shard_copy(const mt_config* cfg, int shard_rank, float* full, float* shard, int to_shard);
/* The rows of `full` (an mt_param_layout entry) that TP rank tp_rank holds: [*row0, *row0 + *rows)
 * of full->split_rows (all of them when the tensor is not split). */
MT_DEF void mt_tp_rows(const mt_param_info* full, int tp, int tp_rank, int64_t* rows, int64_t* row0);
/* The outer indices of `full` that EP rank ep_rank holds: [*outer0, *outer0 + *outer) of full->split_outer
 * (all of them when the tensor is not cut over EP). */
MT_DEF void mt_ep_outer(const mt_param_info* full, int ep, int ep_rank, int64_t* outer, int64_t* outer0);
/* Index, within one layer's slice of the full tensor, of element i of a rank's slice: the slice
 * [outer, rows, inner] holds rows [row0, row0 + rows_shard) of rows_full. */
#ifdef __CUDACC__
#define MT_HOST_DEVICE __host__ __device__
#else
#define MT_HOST_DEVICE
#endif
static inline MT_HOST_DEVICE int64_t mt_tp_full_index(int64_t i, int64_t rows_shard, int64_t inner, int64_t rows_full,
                                                      int64_t row0) {
    int64_t per_outer = rows_shard * inner, o = i / per_outer, rem = i - o * per_outer;
    return (o * rows_full + row0) * inner + rem;
}
/* The same for a slice that also starts at outer index outer0 (an expert-parallel rank's experts). */
static inline MT_HOST_DEVICE int64_t mt_shard_full_index(int64_t i, int64_t rows_shard, int64_t inner, int64_t rows_full,
                                                         int64_t row0, int64_t outer0) {
    return outer0 * rows_full * inner + mt_tp_full_index(i, rows_shard, inner, rows_full, row0);
}

/* ---------------------------------------------------------------------------------------------- */
/* 7. Rank layout and pipeline stages (the layer split)                                            */
/*    A rank's coordinates in Megatron's order, the layer split over pipeline ranks and their      */
/*    model chunks (virtual stages), and which tensors a pipeline rank holds.                      */
/* ---------------------------------------------------------------------------------------------- */

/* Megatron's rank layout, order tp-cp-ep-dp-pp: rank = tp + TP * (cp + CP * (dp + DP * pp)). Groups: tp
 * contiguous, cp stride TP, dp stride TP * CP, pp stride TP * CP * DP. The ranks of one (tp, pp) that
 * differ in cp or dp form the gradient-reduction group (Megatron's data-parallel group with context
 * parallelism: gradients are summed and the distributed optimizer sharded over its DP x CP ranks,
 * numbered dpcp = cp + CP * dp); the data loader's rank is dp alone (every CP rank of a replica reads the
 * same micro-batches). The expert layers fold the data-parallel ranks into EP x EDP (MoE parallel folding
 * with ETP = TP = 1, CP = 1): the expert-parallel rank is ep = dp % EP (consecutive DP ranks form an EP
 * group) and the expert-data-parallel rank edp = dp / EP (the ranks holding the same experts, stride EP
 * within DP). cp and dpcp come last (a {tp, dp, pp} initialiser means cp = 0). */
typedef struct { int tp, dp, pp, ep, edp, cp, dpcp; } mt_rank_coords;
MT_DEF mt_rank_coords mt_rank_coordinates(const mt_config* cfg, int rank);
MT_DEF int mt_rank_of(const mt_config* cfg, mt_rank_coords coords);
/* The gradient-reduction group's size, DP x CP (the distributed optimizer's shards, the DDP buffer's
 * padding); DP without context parallelism. */
MT_DEF int mt_grad_dp_size(const mt_config* cfg);
/* Context parallelism's chunks (CP = cfg's context_parallel_size, S its seq_length, C = S / (2 CP)):
 * context-parallel rank r keeps chunks r and 2 CP - 1 - r of every sequence, its local row i (of 2C)
 * being sequence position mt_cp_position(cfg, r, i). CP = 1: i. */
MT_DEF int mt_cp_position(const mt_config* cfg, int cp_rank, int i);

/* The layer split (Megatron's get_num_layers_to_build): virtual stage v = chunk * PP + rank holds the
 * consecutive layers [first, first + count). Evenly by default; --decoder-first/last-pipeline-num-layers
 * give the first and last stage their own counts (VP = 1 here) and the rest is split evenly over the
 * middle stages; --account-for-embedding/loss-in-pipeline-split count the embedding and the loss as
 * one layer each of the first and last virtual stage, which then build one real layer less. */
#define MT_PP_MAX_CHUNKS 64
typedef struct {
    int num_chunks;                      /* VP */
    int first_layer[MT_PP_MAX_CHUNKS];   /* per chunk: its first layer and how many */
    int num_layers[MT_PP_MAX_CHUNKS];
    int embedding;                       /* holds virtual stage 0: the embeddings */
    int head;                            /* holds the last virtual stage: final norm, output layer, loss */
} mt_pp_stage;
/* Checks the split of cfg (finalized sizes) and fills pipeline rank pp_rank's part (out may be NULL). */
MT_DEF mt_status mt_pp_stage_of(const mt_config* cfg, int pp_rank, mt_pp_stage* out, mt_error* err);
/* Whether a pipeline rank holds parameter `tensor` (MT_P_*) of `layer` (ignored outside the layers):
 * its layers' tensors; position embeddings on the first stage; the word embeddings on the first and,
 * tied to the output layer, on the last; final norm and output weight on the last. */
MT_DEF int mt_pp_holds(const mt_pp_stage* stage, int tensor, int layer);
/* Copies between a canonical array of one TP shard (mt_param_layout_shard's order) and a pipeline
 * rank's part of it (its tensors in the same order, as mt_buffer_layout's `canonical` counts them):
 * into `part` when to_part, else back into `full` (whose other elements are left alone). */
MT_DEF void mt_pp_stage_copy(const mt_config* cfg, const mt_pp_stage* stage, float* full, float* part, int to_part);
/* Puts the part of the model that pipeline stage `stage` holds of TP rank tp_rank's shard (in
 * mt_buffer_layout's canonical order, as mt_pp_stage_copy makes it) into the full model's canonical
 * array, leaving the other elements of `full` alone. scratch: mt_param_layout_shard(cfg) floats. */
MT_DEF void mt_pp_tp_part_to_full(const mt_config* cfg, const mt_pp_stage* stage, int tp_rank, const float* part,
                                  float* full, float* scratch);

/* ---------------------------------------------------------------------------------------------- */
/* 8. DDP buffer layout: buckets and distributed-optimizer shards                                  */
/*    The one flat parameter/gradient buffer of a rank as Megatron's DDP lays it out: each         */
/*    tensor's offset and bucket, each data-parallel rank's shard of a bucket, and the parameter   */
/*    storage.                                                                                     */
/* ---------------------------------------------------------------------------------------------- */

/* The parameter/gradient buffer of Megatron's DDP (param_and_grad_buffer.py). Each (tensor, layer)
 * slice is one parameter; they are laid out in reverse model order (backprop order: final norm,
 * layer L-1 .. layer 0, position and word embeddings) and cut into buckets that close once they
 * hold ddp_bucket_size elements (only with --overlap-grad-reduce; otherwise one bucket). With the
 * distributed optimizer every parameter starts at a multiple of 64 elements and every bucket ends at
 * a multiple of lcm(dp, 128); each bucket is then cut into dp equal shards, DP rank r owning shard r.
 * (Megatron gives the tied embedding its own bucket only when PP > 1; with PP = 1 it does not.) */
typedef struct {
    int tensor;          /* MT_P_* */
    int layer;           /* 0 for tensors outside the layers */
    int64_t numel;
    int64_t canonical;   /* element offset in the canonical order of mt_param_layout_shard (this TP rank) */
    int64_t offset;      /* element offset in the buffer */
    int bucket;
    int fp8;             /* --fp8-param-gather: kept and all-gathered as FP8 bytes (mt_fp8_param_stored) */
    int64_t storage;     /* byte offset in the model-type parameter storage (mt_buffer_storage_byte) */
} mt_buffer_param;
typedef struct {
    int64_t start, end;  /* [start, end) in buffer elements, padding included */
    int64_t numel_unpadded;
    int ready_layer;     /* gradients final once backward has done this layer (L: final norm, -1: embeddings) */
    int ep;              /* > 1: a bucket of expert parameters (EP > 1), reduced and sharded over the
                            expert-data-parallel group (DP / ep ranks) instead of DP; else 0 */
} mt_buffer_bucket;
typedef struct {
    int num_params, num_buckets, num_layers;
    mt_buffer_param* params;    /* buffer order */
    mt_buffer_bucket* buckets;  /* buffer order (= the order their gradients become final) */
    int* index;                 /* [MT_NUM_PARAM_TENSORS * num_layers]: params[] position of (tensor, layer) */
    int64_t size;               /* elements, padding included */
    /* with pipeline parallelism the buffer holds this pipeline rank's tensors only (mt_pp_holds), and
     * `canonical` counts in the canonical order restricted to them (the whole model at PP = 1) */
    mt_pp_stage stage;
    int64_t canonical_size;     /* elements of this rank's tensors (its TP shard), no padding */
    /* the parameter storage (model type): every element `elem` bytes, except with --fp8-param-gather
     * the weights of the FP8 linears, one FP8 byte each; bytes in buffer order, padding included */
    int elem;                   /* bytes of a model-type element: 4 (fp32) or 2 */
    int64_t storage_bytes;
} mt_buffer_layout;
MT_DEF mt_status mt_buffer_layout_build(mt_buffer_layout* layout, const mt_config* cfg, mt_error* err);
MT_DEF void mt_buffer_layout_free(mt_buffer_layout* layout);
/* Buffer offset of (tensor, layer); layer is ignored for tensors outside the layers; -1 for a tensor
 * the flavour does not have. */
MT_DEF int64_t mt_buffer_offset(const mt_buffer_layout* layout, int tensor, int layer);
/* Whether parameter `tensor` of `layer` is stored and all-gathered in FP8 (--fp8-param-gather): the
 * weights of QKV, the attention projection, fc1 and fc2 of every layer that runs in FP8. */
MT_DEF int mt_fp8_param_stored(const mt_config* cfg, int tensor, int layer);
/* Byte offset in the parameter storage of buffer element `element` (in [0, size]): elem bytes per
 * element below it, one per FP8-stored element, plus the alignment padding before each parameter
 * (mt_buffer_param.storage; the padding before a parameter belongs to it). Monotonic, so a DP shard
 * [begin, end) is the bytes [of(begin), of(end)). Needs the storage of the parameters below it. */
MT_DEF int64_t mt_buffer_storage_byte(const mt_buffer_layout* layout, int64_t element);
/* DP rank r's shard of bucket b: [begin, end) in buffer elements (the whole bucket when dp == 1). An
 * expert bucket (bucket->ep > 1) is sharded over the expert-data-parallel group: given the DP size and
 * rank, its shard is EDP rank dp_rank / ep's of dp / ep parts. */
MT_DEF void mt_bucket_shard(const mt_buffer_bucket* bucket, int dp, int dp_rank, int64_t* begin, int64_t* end);

/* ---------------------------------------------------------------------------------------------- */
/* 9. Pipeline schedules                                                                           */
/*    The forward and backward steps of each pipeline rank in order, with their transfers, as      */
/*    data (1F1B, interleaved 1F1B), and the activation slots a schedule holds at once.            */
/* ---------------------------------------------------------------------------------------------- */

/* Pipeline schedules (Megatron's pipeline_parallel/schedules.py), as data: the ordered list of
 * forward and backward steps one pipeline rank runs in one training step, and the point-to-point
 * transfers each step needs. M micro-batches, PP pipeline ranks, VP model chunks per rank (virtual
 * pipeline stages; chunk c on rank r is virtual stage c * PP + r). VP = 1: non-interleaved 1F1B;
 * VP > 1: interleaved 1F1B, whose micro-batches walk the chunks in groups of group_size
 * (--microbatch-group-size-per-virtual-pipeline-stage, default PP).
 * Each rank's list: warm-up forwards, then steady forward/backward pairs (forward first), then the
 * cool-down backwards; PP = 1 is F0 B0 F1 B1 ... */
enum { MT_PP_FORWARD = 0, MT_PP_BACKWARD = 1 };
typedef struct {
    int8_t kind;         /* MT_PP_FORWARD, MT_PP_BACKWARD */
    int32_t micro_batch; /* 0 .. M-1 */
    int32_t chunk;       /* model chunk (virtual stage) on this rank, 0 .. VP-1 */
    /* Transfers, as pipeline ranks (-1: none). Before a forward: receive its input activation from
     * recv_rank (the rank of virtual stage v - 1), except at virtual stage 0; after it: send the
     * output activation to send_rank (virtual stage v + 1), except at the last virtual stage.
     * Before a backward: receive the output gradient from recv_rank (virtual stage v + 1), except at
     * the last virtual stage; after it: send the input gradient to send_rank (virtual stage v - 1),
     * except at virtual stage 0. Never this rank itself: PP = 1 has one stage and no transfers. */
    int32_t recv_rank;
    int32_t send_rank;
} mt_pp_op;
/* Checks (PP, VP, M, group_size) the way Megatron does: PP, VP, M >= 1; interleaving (VP > 1)
 * needs PP > 1 and PP <= group_size <= M, and the last, partial group (M % group_size) must be 0 or
 * hold at least PP micro-batches. group_size <= 0 means PP; it is ignored when VP = 1. */
MT_DEF mt_status mt_pp_schedule_check(int pp, int vp, int num_micro_batches, int group_size, mt_error* err);
/* Warm-up forwards of rank `rank` (of a setting mt_pp_schedule_check accepts): min(PP - rank - 1, M)
 * with VP = 1; with VP > 1, 2 (PP - rank - 1) + (VP - 1) group_size, capped at M * VP (then every
 * forward is warm-up). (Megatron's extra warm-up forward of --overlap-moe-expert-parallel-comm is
 * not modelled.) */
MT_DEF int mt_pp_num_warmup(int pp, int vp, int num_micro_batches, int group_size, int rank);
/* Fills ops[2 * M * VP] with rank `rank`'s steps in order (M * VP forwards and as many backwards);
 * *num_warmup (if not NULL) gets mt_pp_num_warmup. The k-th forward runs entry k of the table that
 * walks groups of group_size micro-batches (the last group: what is left) over chunks 0 .. VP-1,
 * each chunk taking the whole group; the k-th backward runs the same entry with the chunk mirrored
 * (VP - 1 - chunk). */
MT_DEF mt_status mt_pp_schedule(int pp, int vp, int num_micro_batches, int group_size, int rank, mt_pp_op* ops,
                                int* num_warmup, mt_error* err);

/* Activation slots pipeline rank `rank` needs for one training step of M micro-batches: the most
 * (chunk, micro-batch) pairs whose forward has run and whose backward has not, over its schedule
 * (mt_pp_schedule): 1 at PP = 1, min(PP - rank, M) for 1F1B, counted from the schedule when
 * interleaved. mt_pp_slots_needed counts the same over any list of steps. */
MT_DEF int mt_pp_slots_needed(const mt_pp_op* ops, int num_ops);
MT_DEF mt_status mt_pp_activation_slots(int pp, int vp, int num_micro_batches, int group_size, int rank, int* slots,
                                        mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* 10. Memory plan of any layout: arenas, recompute, optimizer pieces, --plan-layouts              */
/*    What every GPU of a layout holds, from the config alone, before any GPU work: the            */
/*    activation and FP8 arenas the trainer carves, recompute's kept layers, the optimizer's       */
/*    pieces, and the layouts of a world size ranked by a cost model.                              */
/* ---------------------------------------------------------------------------------------------- */

/* The memory plan: every byte a GPU holds during training, computed on the host from the config
 * alone, before any GPU work (train_gpt --plan) and by mt_trainer_create, which allocates exactly
 * the plan's bytes and refuses a plan that does not fit the device's free memory. The device's
 * activation arena and FP8 arena are carved from the layouts below (mt_activation_layout,
 * mt_fp8_arena_layout), so the plan and the allocation are one computation. With pipeline
 * parallelism a pipeline rank holds its stage's tensors (mt_pp_stage_of's split, mt_buffer_layout_build's
 * buffer: the layers of its model chunks; the embeddings on the first stage, the final norm and
 * output layer on the last, with tied embeddings its own copy of the word embeddings) and one
 * activation slot per (chunk, micro-batch) pair its training schedule holds at once
 * (mt_pp_activation_slots). */

/* What the plan is asked about besides the config (the layout, VP, the micro-batch group size and
 * the recompute setting included, is the config's). */
typedef struct {
    int pp_rank;                  /* the pipeline rank planned; -1: the one that needs the most memory */
    int dp_rank;                  /* the data-parallel rank (its shard's AdamW chunk count; 0 by default) */
    int cp_rank;                  /* the context-parallel rank (with dp_rank, its place in the DP x CP shards; 0) */
} mt_plan_options;
MT_DEF void mt_plan_options_defaults(mt_plan_options* opts);

/* Constants the plan adds to the allocations for what the libraries hold; stated, not measured by
 * the plan (dev/memory_check.sh compares the sum with what the device reports). */
#define MT_PLAN_CONTEXT_BYTES ((size_t)512 << 20)  /* CUDA context and this program's kernels */
#define MT_PLAN_CUBLAS_BYTES ((size_t)64 << 20)    /* cuBLAS and cuBLASLt handles */
#define MT_PLAN_NCCL_BYTES ((size_t)640 << 20)     /* each NCCL communicator of more than one rank: the
                                                      world, TP, DP; with PP > 1 the pipeline's two (activations,
                                                      gradients) and, on the first and last stage, the
                                                      embedding group's. Measured on 2 and 4 H200s (NVLS off;
                                                      tests/test_memory.h plan_holds_after_training_each_rank):
                                                      NCCL connects each collective kind at its first use, ~288
                                                      MiB at a time, 465-490 MiB a communicator with DP or TP and
                                                      up to 607 with PP's transfers; it was 256, an estimate the
                                                      devices exceeded by up to 1.3 GiB a rank */
/* Sizes the trainer's scratch is built from (megatron.cu checks them against its own). */
#define MT_CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)
#define MT_COLSUM_MAX_CHUNKS 256
#define MT_NORM_BWD_BLOCKS 256
#define MT_OPT_CHUNK_ELEMENTS 32768
#define MT_OPT_CHUNK_BYTES 32                     /* sizeof(mt_opt_chunk) in megatron.cu */
#define MT_PUBLISH_CHUNK_BYTES 16                 /* --fp8-param-gather: sizeof(fp8_publish_chunk) in megatron.cu */
#define MT_GATHER_DOUBLES 4                       /* values a rank contributes to an all-gather over the world
                                                      (its two checkpoint files' CRC and size) */
/* the trainer's host-value collectives: 2 values all-reduced, then world x MT_GATHER_DOUBLES gathered */
#define MT_REDUCE_SCRATCH_BYTES(world) ((2 + (size_t)(world) * MT_GATHER_DOUBLES) * sizeof(double))
#define MT_OFFLOAD_PIECE_ELEMENTS ((int64_t)1 << 22) /* optimizer offload: elements per copy/update piece */
#define MT_OFFLOAD_SLOTS 4                        /* pinned gradient staging pieces in flight */

/* Where every byte of device memory goes, per GPU (bytes; "this GPU's" throughout). */
typedef struct {
    int pp_rank;                  /* the pipeline rank this plan is for */
    int num_layers;               /* transformer layers on this GPU (all its model chunks) */
    int in_flight;                /* activation slots: (chunk, micro-batch) pairs held at once */
    int num_micro_batches;        /* per step, per rank */
    int64_t num_parameters;       /* this GPU's: its tensor-parallel shard of its layers */
    int64_t buffer_elements;      /* the parameter/gradient buffers: parameters plus Megatron's padding */
    int64_t shard_elements;       /* what this rank's optimizer owns (buffer / dp with the distributed optimizer) */
    int64_t offload_elements;     /* of the shard, in host memory (--optimizer-cpu-offload) */
    int64_t optimizer_chunks;     /* AdamW's pieces on the GPU (the chunk table and partial sums) */
    /* device allocations, each what mt_trainer_create cudaMallocs for it */
    size_t parameter_bytes;       /* model-precision weights */
    size_t master_bytes;          /* fp32 master weights (0 in fp32 without sharding: the weights are the master) */
    size_t gradient_bytes;        /* fp32 gradient accumulation buffer */
    size_t optimizer_bytes;       /* Adam moments */
    size_t activation_bytes;      /* the activation arena: scratch + saved x in_flight */
    size_t activation_saved_bytes;/* one slot: the saved activations of one micro-batch in the largest chunk */
    size_t workspace_bytes;       /* cuBLAS workspace, column-sum scratch, AdamW chunk table and norm partials,
                                     RoPE tables; PP > 1: the buffer of an input gradient waiting to be sent */
    size_t fp8_bytes;             /* FP8: the weights' FP8 copies (both layouts), scaling state, cast scratch */
    size_t offload_bytes;         /* optimizer offload's device staging (the updated fp32 weights of a piece) */
    size_t total_bytes;           /* the sum of the above: what the trainer allocates */
    /* not allocated by the trainer */
    size_t overhead_bytes;        /* MT_PLAN_*: the CUDA context, cuBLAS, NCCL communicators */
    size_t device_bytes;          /* total + overhead: what the device should report in use */
    size_t host_pinned_bytes;     /* optimizer offload: master, m, v of the offloaded part, gradient staging */
    size_t state_bytes_measured;  /* trainer only: what the device reported the weights, master, gradients and Adam took */
} mt_memory_plan;

/* The plan of one GPU of the config's layout (world_size, TP, PP, VP, DP, SP, distributed optimizer,
 * precision, FP8, offload, micro-batch) for opts (NULL: defaults). cfg must have been finalized (its
 * layer split and schedule checked); fails on a pipeline rank outside [0, PP). */
MT_DEF mt_status mt_memory_plan_compute(const mt_config* cfg, const mt_plan_options* opts, mt_memory_plan* plan,
                                        mt_error* err);
/* --grad-reduce-in-bf16 (Megatron's; not built here: gradients accumulate and are reduced in fp32):
 * the bytes per GPU a bf16 gradient buffer would save in this plan, the fp32 buffer's bytes less a
 * bf16 one's (2 bytes per buffer element). */
MT_DEF size_t mt_memory_plan_bf16_grad_savings(const mt_memory_plan* plan);
/* --grad-reduce-in-bf16 as built here: each bucket's fp32 gradients are rounded to bf16 into a scratch,
 * reduced over their data-parallel group in bf16, and widened back (the owned shard, or all of it), so
 * the collective moves half the bytes while accumulation stays fp32. The scratch's elements (bf16):
 * the largest bucket when the flag is on and data parallelism reduces anything, else 0. */
MT_DEF int64_t mt_grad_reduce_scratch(const mt_config* cfg, const mt_buffer_layout* buffer);
/* Elements of an optimizer shard of `shard` elements that --optimizer-cpu-offload puts in host
 * memory: the last fraction x shard of it (all at 1.0; else rounded down to 16 elements). */
MT_DEF int64_t mt_offload_elements(const mt_config* cfg, int64_t shard);
/* The optimizer's work in pieces (megatron.cu's AdamW chunks): for each bucket of B in order, each
 * parameter's part of the bucket's DP shard (dp = 1: all of it) in pieces of at most
 * MT_OPT_CHUNK_ELEMENTS, numbered by their place in the shard, a piece cut where the GPU's part of the
 * shard ends (gpu_shard; optimizer offload). Writes them to out (NULL: only counts); returns the count. */
typedef struct {
    int64_t buffer, master, length;
    int tensor; /* MT_P_* */
} mt_optimizer_piece;
MT_DEF int64_t mt_optimizer_pieces(const mt_buffer_layout* B, int dp, int dp_rank, int64_t gpu_shard,
                                   mt_optimizer_piece* out);
/* Whether the config's attention runs on the flash kernels (bf16, head dim 64 or 128), else exact. */
MT_DEF int mt_flash_attention(const mt_config* cfg);
/* Whether the model reads each row's position from the micro-batch's documents region (MT_ACT_DOCS)
 * instead of its row number: --reset-position-ids, or context parallelism (a rank's rows are two chunks
 * of the sequence). */
MT_DEF int mt_explicit_positions(const mt_config* cfg);
/* Context parallelism's attention buffers on one rank (MT_ACT_CP, bytes; 0 at CP = 1), by --cp-comm-type
 * (B micro-batch, S sequence, C = S / (2 CP) chunk, Hkv and heads per TP rank, d head dim, T model type):
 * all_gather: K and V of the whole sequence, their gradients, and the transfer buffer, 6 [B, Hkv, S, d] T;
 * a2a: the QKV rows, their gradient, the attention output and its gradient of the rank's heads over the whole
 * sequence (as many elements as its own rows' ones) and one transfer buffer: 3 [B S/CP, qkv width] +
 * 2 [B S/CP, heads d] T; p2p: the ring's, mt_cp_ring_scratch_bytes. */
MT_DEF int64_t mt_cp_scratch_bytes(const mt_config* cfg);
/* The p2p ring's scratch (megatron.cu section 9.5, cp_scratch_layout), 256-byte aligned pieces: two K/V
 * blocks in bf16 (2 [B, Hkv, T, d] each), the fp32 accumulator [B, H, T, d] (the forward's O, the
 * backward's dQ), two travelling fp32 dK/dV sums (2 [B, Hkv, T, d] each), and the outputs of one step on
 * the Hopper kernels (section 13.4): O or dQ in bf16 [B, H, T, d], its LSE fp32 [B, H, T], dK/dV in bf16
 * (2 [B, Hkv, T, d]); for B samples, H query and Hkv K/V heads per TP rank, T = S / CP local rows and
 * head dim d. */
MT_DEF int64_t mt_cp_ring_scratch_bytes(int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t d);

/* Megatron's documents in a micro-batch (gpt_dataset.py _get_ltor_masks_and_position_ids, for
 * --reset-position-ids and --reset-attention-mask): a document ends with its end-of-document token
 * (the eod belongs to the document it ends), so after an eod input at position i the next document
 * starts at i + 1; each sequence starts a document at 0. inputs [B, S] -> doc_start [B, S]: the first
 * position of each position's document (a sequence position, so a context-parallel split can read its
 * chunks' values as they are: key j is visible to query i iff doc_start[i] <= j <= i); positions
 * [B, S] (NULL: not wanted): i - doc_start[i], the reset position ids. */
MT_DEF void mt_document_boundaries(const int32_t* inputs, int B, int S, int64_t eod, int32_t* doc_start,
                                   int32_t* positions);
/* The learned position embeddings' backward index with --reset-position-ids (megatron.cu section 4):
 * the rows r of positions [BT] (values in [0, S)) grouped by positions[r], rows ascending within a
 * group (a counting sort): group p is rows[offsets[p] .. offsets[p + 1]), offsets [S + 1], rows [BT]. */
MT_DEF void mt_position_index(const int32_t* positions, int BT, int S, int32_t* offsets, int32_t* rows);

/* The activation arena of one pipeline rank (megatron.cu section 17 names each region): regions in
 * this order, each at a 256-byte-aligned offset; a region of 0 bytes does not exist in this config.
 * First the scratch every micro-batch shares (MT_ACT_LN1 .. MT_ACT_MOE_STATS), then num_slots
 * slots one after another, each a copy of the saved regions (MT_ACT_RESIDUAL .. MT_ACT_LOGITS: what
 * one micro-batch's pass through one model chunk keeps for its backward, sized for the rank's
 * largest chunk; the final norm's output and the logits only on the rank that holds the head).
 * Mixture of experts (0 bytes without --num-experts), per MoE layer, for a micro-batch of N = B S
 * tokens (B sequences), E experts, Rmax = mt_moe_max_rows(cfg, N) permuted rows, fe = mt_moe_ffn,
 * f1e = 2 fe with SwiGLU (else fe), T = the model type (fp32 or 16-bit): scratch MT_ACT_MOE_XPERM ..
 * MT_ACT_MOE_STATS (see the enum), saved per layer MT_ACT_MOE_LOGITS .. MT_ACT_MOE_GATE, after the dense
 * layer regions (the per-layer regions stay together, before the head's). In an MoE layer MT_ACT_FC1 and
 * MT_ACT_ACT hold the shared expert's fc1 output [N, fs1] and activation [N, fs] (0 bytes without a
 * shared expert when every layer is MoE). With expert parallelism the experts' regions (MT_ACT_MOE_FC1,
 * _ACT, _DZ, _DACT) hold the rows the local experts receive, Rexp = mt_moe_expert_rows (Rmax at EP = 1),
 * and the MT_ACT_MOE_EP_* regions exist. */
#define MT_MOE_WORK_WORDS(N, E, B) (2 * (int64_t)(N) * (E) + 4 * (int64_t)(B) * (E) + 16 * (int64_t)(E) + 256)
enum {
    MT_ACT_LN1 = 0, MT_ACT_Q, MT_ACT_K, MT_ACT_V, MT_ACT_O, MT_ACT_DK, MT_ACT_DV, MT_ACT_DSCORES, MT_ACT_DSUM,
    MT_ACT_LOGITS_ROW, MT_ACT_BRANCH, MT_ACT_BRANCH2, MT_ACT_DRESIDUAL, MT_ACT_GATHERED, MT_ACT_GATHERED_GRAD,
    MT_ACT_ROWS, MT_ACT_CE_STATS, MT_ACT_INPUTS, MT_ACT_TARGETS, MT_ACT_LOSSES, MT_ACT_EMBED_INDEX,
    MT_ACT_QK_NORM, MT_ACT_QK_STATS, /* --qk-layernorm: the normalised QKV rows and their mean and 1/std */
    /* MoE scratch */
    MT_ACT_MOE_XPERM,    /* [Rmax, h] T      the layer input's rows permuted (forward), again in the backward */
    MT_ACT_MOE_Y,        /* [Rmax, h] T      the experts' output rows, then their gradient */
    MT_ACT_MOE_DZ,       /* [Rmax, f1e] T    d(expert fc1 output) */
    MT_ACT_MOE_DACT,     /* [Rmax, fe] T     d(expert activation) */
    MT_ACT_MOE_DLOGITS,  /* [N, E] fp32 */
    MT_ACT_MOE_DPROBS,   /* [N, E] fp32 */
    MT_ACT_MOE_X32,      /* [N, h] fp32      the router's input in fp32 (T not fp32 only), also its gradient */
    MT_ACT_MOE_W32,      /* [E, h] fp32      the router weight in fp32 (T not fp32 only) */
    MT_ACT_MOE_WORK,     /* int32 [MT_MOE_WORK_WORDS(N, E, B)] */
    MT_ACT_MOE_STATS,    /* (B + 1) E int32, then (B + 1) E + 64 fp32: one micro-batch's aux statistics */
    MT_ACT_MOE_EP_INDEX, /* int32 [2 Rexp]    EP > 1: the received rows' order by local expert and its inverse */
    MT_ACT_MOE_EP_DROW,  /* fp32 [2 Rexp + Rmax] EP > 1: the rows' probability gradients (expert side, sent, received) */
    MT_ACT_CP,           /* CP > 1: attention's context-parallel buffers (mt_cp_scratch_bytes) */
    MT_ACT_RESIDUAL, /* the first saved region */
    MT_ACT_LN1_MEAN, MT_ACT_LN1_RSTD, MT_ACT_QKV, MT_ACT_PROBS, MT_ACT_LSE, MT_ACT_ATTN_OUT, MT_ACT_RESIDUAL_MID,
    MT_ACT_LN2, MT_ACT_LN2_MEAN, MT_ACT_LN2_RSTD, MT_ACT_FC1, MT_ACT_ACT,
    /* MoE, saved per layer */
    MT_ACT_MOE_LOGITS,   /* [L, N, E] fp32   router logits */
    MT_ACT_MOE_PROBS,    /* [L, N, E] fp32   final probabilities */
    MT_ACT_MOE_ROW,      /* [L, N, E] int32  permuted row of (token, expert), -1 off the map */
    MT_ACT_MOE_TOKEN,    /* [L, Rmax] int32  token row of each permuted row */
    MT_ACT_MOE_ROW_PROB, /* [L, Rmax] fp32   each permuted row's probability */
    MT_ACT_MOE_COUNTS,   /* [L, 2E + 1] int32 rows per expert, then the row offsets (E + 1) */
    MT_ACT_MOE_AUXW,     /* [L, B, E] fp32   the aux losses' gradient weights (0 bytes without aux losses) */
    MT_ACT_MOE_FC1,      /* [L, Rmax, f1e] T the experts' fc1 output */
    MT_ACT_MOE_ACT,      /* [L, Rmax, fe] T  the experts' activation times the probability */
    MT_ACT_MOE_SHARED,   /* [L, N, h] T      the shared expert's output before its gate (with the gate only) */
    MT_ACT_MOE_GATE,     /* [L, N] fp32      the gate's sigmoid (with the gate only) */
    MT_ACT_MOE_EP_IN,    /* [L, Rexp, h] T   EP > 1: the local experts' input rows (received, in local expert order) */
    MT_ACT_MOE_EP_PROB,  /* [L, Rexp] fp32   EP > 1: their probabilities */
    MT_ACT_MOE_EP_COUNTS,/* [L, EP, E/EP] int32 EP > 1: rows received from each EP rank for each local expert */
    MT_ACT_DOCS,         /* int32 [2, BT]    the micro-batch's doc_start, then positions (mt_document_boundaries;
                                             0 bytes without --reset-position-ids / --reset-attention-mask) */
    MT_ACT_LNF, MT_ACT_LNF_MEAN, MT_ACT_LNF_RSTD, MT_ACT_LOGITS, MT_ACT_REGIONS
};
typedef struct {
    size_t offset[MT_ACT_REGIONS];  /* scratch: in the arena; saved: slot 0's (slot k's is k x saved_bytes on) */
    size_t bytes[MT_ACT_REGIONS];   /* the region (a saved one: in one slot) */
    int64_t kept_layers[MT_ACT_REGIONS]; /* per-layer regions: how many layers' worth a slot holds */
    int num_slots;
    size_t scratch_bytes;           /* the shared scratch */
    size_t saved_bytes;             /* one slot */
    size_t total;                   /* the arena: scratch_bytes + num_slots x saved_bytes */
} mt_activation_layout;
/* A pipeline rank whose largest model chunk has `layers` transformer layers (head: it holds the final
 * norm and output layer), with num_slots slots. */
MT_DEF void mt_activation_layout_compute(const mt_config* cfg, int layers, int head, int num_slots,
                                         const mt_recompute* recompute, mt_activation_layout* out);
/* Where layer i (0-based) of a model chunk of `count` layers keeps per-layer region `region` in a
 * slot under a recompute setting (NULL: none): its room among the region's kept_layers (counted for
 * the rank's largest chunk, so every chunk of the rank fits). For MT_ACT_RESIDUAL and the first
 * norm's statistics the room of layer i's input; i = count: the chunk's output. None: room i.
 * Selective: room 0 for every layer in a region its modules recompute. Full block (n = num_layers,
 * at most count): every layer's input kept; layers [0, n) share room 0, layer i >= n has room
 * i - n + 1. Full uniform (groups of n): every group's input, the inputs of a replayed group's later
 * layers, then the output; other regions room i % n. */
MT_DEF int64_t mt_recompute_position(const mt_recompute* recompute, int region, int64_t count, int64_t i);
/* Full recompute: 1 when the backward, arriving at layer i (going down), must first replay the
 * forward of layers [*first, i] from the kept input of layer *first (block: layer i alone, for
 * i < n - 1; uniform: i's group, when i ends a group that is not the chunk's last). The layers the
 * forward ran last (block's layer n - 1, uniform's last group) are still in their rooms. */
MT_DEF int mt_recompute_replay(const mt_recompute* recompute, int64_t count, int64_t i, int64_t* first);
/* The setting in words for the plan's line: "none", "selective (core_attn, mlp)", "full uniform 2". */
MT_DEF void mt_recompute_describe(const mt_recompute* recompute, char* out, size_t size);

/* The FP8 arena (one allocation) of `fp8_layers` FP8 layers: scaling arrays, the weights' FP8 copies
 * in both layouts, the cast scratch of one linear and, blockwise, the block scales. */
enum {
    MT_FP8A_SCALE = 0, MT_FP8A_SCALE_INV, MT_FP8A_AMAX, MT_FP8A_MAX, MT_FP8A_HISTORY, MT_FP8A_WEIGHTS, MT_FP8A_X8,
    MT_FP8A_X8T, MT_FP8A_G8, MT_FP8A_G8T, MT_FP8A_X_BLOCKS, MT_FP8A_XT_BLOCKS, MT_FP8A_G_BLOCKS, MT_FP8A_GT_BLOCKS,
    MT_FP8A_W_BLOCKS, MT_FP8A_REGIONS
};
#define MT_FP8_SCALE_INV_STRIDE 4 /* floats between per-tensor scale_invs (16 bytes: cuBLASLt's alignment) */
typedef struct {
    size_t offset[MT_FP8A_REGIONS];
    int num_tensors;                /* fp8_layers x 4 linears x 3 roles (input, weight, output gradient) */
    int history_len;
    int64_t weights_per_layer;      /* bytes of one layer's FP8 weights, W and W^T of the 4 linears (W^T only
                                       with --fp8-param-gather: W is the gathered parameter storage) */
    int64_t weight_blocks_per_layer;/* floats of one layer's 128x128 block scales (both layouts) */
    size_t total;
} mt_fp8_arena_layout;
MT_DEF void mt_fp8_arena_layout_compute(const mt_config* cfg, int fp8_layers, mt_fp8_arena_layout* out);
/* Floats of a blockwise scale_inv of a tensor [rows, cols]: 1x128 blocks (blocks_128x128 = 0) or
 * 128x128 blocks with cuBLASLt's padding (the column blocks rounded up to 4). */
MT_DEF int64_t mt_fp8_scale_inv_floats(int blocks_128x128, int rows, int cols);

/* Layouts of a world size for train_gpt --plan-layouts: every (TP, PP, VP) the model divides into
 * (those this build lacks included, marked refused with mt_config_check_supported's line)
 * (TP at most 8, a node's NVLink domain; VP up to 4 where the layer split and the interleaved
 * schedule accept it), DP the rest, the
 * config's global batch, micro-batch, SP and optimizer flags kept; each with its plan and the cost
 * model's relative step time (DESIGN.md): compute x (1 + (PP - 1) / (VP M)) + the TP and DP
 * communication at stated bandwidths. Sorted fastest first (tokens per second per GPU: layouts whose
 * global batch is micro-batch x DP run different batches); *count layouts written (at most max). */
typedef struct {
    int tp, pp, vp, dp;
    int global_batch_size;        /* the config's, or micro-batch x DP when it gives none */
    double step_seconds;          /* the cost model's estimate of one step */
    double tokens_per_second;     /* per GPU: global batch x seq / step / world (what the order follows) */
    mt_memory_plan plan;          /* the pipeline rank that needs the most memory */
    int refused;                  /* 1: this build does not have the combination (mt_config_check_supported) */
    char reason[512];             /* then its line; a refused layout never fits, whatever its plan says */
} mt_layout_candidate;
MT_DEF mt_status mt_plan_layouts(const mt_config* cfg, const mt_plan_options* opts, int world_size,
                                 mt_layout_candidate* out, int max, int* count, mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* 11. Thread pool                                                                                 */
/*    pthread workers that run one job at a time on every thread (the CPU AdamW's).                */
/* ---------------------------------------------------------------------------------------------- */

/* A pool of worker threads (pthreads) that runs one job at a time on every thread. */
typedef struct mt_thread_pool mt_thread_pool;
MT_DEF mt_status mt_thread_pool_create(mt_thread_pool** out, int threads, mt_error* err);
MT_DEF void mt_thread_pool_free(mt_thread_pool* pool);
MT_DEF int mt_thread_pool_size(const mt_thread_pool* pool);
/* Runs fn(arg, worker, workers) on every worker (the caller is worker 0) and returns when all are done. */
MT_DEF void mt_thread_pool_run(mt_thread_pool* pool, void (*fn)(void* arg, int worker, int workers), void* arg);

/* ---------------------------------------------------------------------------------------------- */
/* 12. CPU AdamW (optimizer offload)                                                               */
/*    The GPU AdamW on the host, bit for bit, for the part of the optimizer that                   */
/*    --optimizer-cpu-offload keeps in host memory, split over the thread pool.                    */
/* ---------------------------------------------------------------------------------------------- */

/* The GPU AdamW of megatron.cu section 11 on the host, operation for operation in the same order
 * with the same fused multiply-adds, so each element's m, v and master are bit-for-bit the GPU's
 * (IEEE fp32 division and square root on both; no flush to zero): per element, g = grad * grad_scale,
 *   m = fma(m, beta1, (1 - beta1) g)          v = fma(v, beta2, g ((1 - beta2) g))
 *   u = fma(p, wd, (m / bc1) / (sqrt(v / bc2) + eps))                   p = fma(-u, lr, p)
 * Vectorised 8 floats at a time with AVX2 + FMA where the CPU has them (checked at run time), else
 * the scalar loop (fmaf). */
typedef struct {
    float lr, beta1, beta2, bias_correction1, bias_correction2, eps, weight_decay;
    float grad_scale;   /* clipping and the fp16 loss scale's unscaling, folded */
    float lr_decoupled; /* the rate of a segment marked decoupled (--decoupled-lr; else lr) */
} mt_adamw_step;
/* n elements of one weight-decay class (decay: weight_decay applies, else 0). */
MT_DEF void mt_adamw_cpu(const mt_adamw_step* h, int decay, const float* grad, float* master, float* m, float* v,
                         int64_t n);
/* The same per element, one element at a time in plain C: the reference the tests hold mt_adamw_cpu to. */
MT_DEF void mt_adamw_cpu_scalar(const mt_adamw_step* h, int decay, const float* grad, float* master, float* m, float* v,
                                int64_t n);

/* A run of elements of one weight-decay class in arrays laid out alike (grad, master, m, v). */
typedef struct {
    int64_t offset, length;
    int decay;
    int decoupled; /* the word embeddings or the output layer: h->lr_decoupled */
} mt_adamw_segment;
/* mt_adamw_cpu over segments (increasing, disjoint), the elements split evenly over the pool's threads
 * at 16-element boundaries (pool NULL: this thread). */
MT_DEF void mt_adamw_cpu_parallel(mt_thread_pool* pool, const mt_adamw_step* h, const mt_adamw_segment* segments,
                                  int num_segments, const float* grad, float* master, float* m, float* v);

/* ---------------------------------------------------------------------------------------------- */
/* 13. Checkpoint files: header and checks, names, tracker, retention, commit, integrity           */
/*    What a checkpoint is on disk, and the rules every writer and reader of one applies: the      */
/*    header words and their checks, each rank's file names, the tracker, --save-retain-interval,  */
/*    a save's temporary directory and its commit, the manifest and the integrity rule.            */
/*    megatron.cu section 20 stages and writes the trainer's files through them, and the prepro/   */
/*    tools read and write through them.                                                           */
/* ---------------------------------------------------------------------------------------------- */

/* The checkpoint format. <dir>/iter_%07d/mp_rank_00/model_optim_rng.bin is a header of
 * MT_CK_HEADER_WORDS little-endian int64 words (indices below), then fp32 master weights, Adam m and
 * v, each in canonical order (only the master weights when MT_CK_SHARDED_DP > 0: then every DP rank
 * r also has distrib_optim_dp<r>.bin, the same header and its shard of master, m, v: for each bucket
 * of the DDP buffer (mt_buffer_layout_build) in order, r's part of it (mt_bucket_shard)). With tensor
 * parallelism every TP rank t writes mp_rank_<t>/ (two digits, Megatron's naming) holding its shard
 * in mt_param_layout_shard's order; with pipeline parallelism mp_rank_<t>_<p>/ (three digits for the
 * pipeline rank) holds that shard's tensors of pipeline rank p's stage, laid out as
 * mt_pp_stage_copy lays them out. With expert parallelism (EP > 1, Megatron's naming) every EP rank e has
 * mp_rank_<tp>_<e, three digits>/ (mp_rank_<tp>_<pp>_<e> with pipeline stages): its model file holds shard
 * tp + TP x e (mt_param_layout_shard: the expert tensors' E / EP experts of rank e, every other tensor whole),
 * written by DP rank e (the first of the DP ranks holding those experts); the distributed optimizer's shard
 * file of DP rank d is in EP rank d % EP's directory and holds d's part of each bucket of that rank's buffer:
 * of a dense bucket its DP shard, of an expert bucket its expert-data-parallel shard d / EP (mt_bucket_shard).
 * A file's DP rank word is its writer's, so DP_RANK % EP = EP_RANK in every file.
 * MT_CK_NUM_PARAMS is always the full model's count. A model file
 * ends with the FP8 delayed-scaling state when the run had one (MT_CK_FP8_*): state of one layout,
 * not carried to another; then, with --moe-router-enable-expert-bias (MT_CK_MOE_EXPERT_BIAS), the
 * routers' expert bias [MoE layers, experts] fp32, whole in every model file (model state without
 * gradient or Adam state: Megatron's persistent mlp.router.expert_bias buffers; one copy per file, the
 * same in each). The files' names, the rank words of their headers and the checks a reader
 * applies are the functions below (mt_ckpt_rank_files, mt_checkpoint_header_set_rank,
 * mt_checkpoint_header_check_rank); megatron.cu writes and loads checkpoints through them,
 * prepro/convert_hf writes and reads one (TP = 1), prepro/checkpoint_tool.h reads and reshards. */
#define MT_CKPT_MAGIC 0x4b43544d /* "MTCK" */
#define MT_CKPT_VERSION 1
enum {
    MT_CK_MAGIC = 0, MT_CK_VERSION, MT_CK_LAYERS, MT_CK_HIDDEN, MT_CK_HEADS, MT_CK_GROUPS, MT_CK_KV, MT_CK_FFN,
    MT_CK_VOCAB,         /* padded vocabulary */
    MT_CK_POSITIONS, MT_CK_NUM_PARAMS, MT_CK_PRECISION, MT_CK_ITERATION, MT_CK_CONSUMED, MT_CK_SCHED_STEPS,
    MT_CK_ADAM_STEP, MT_CK_SEED, MT_CK_GROWTH, MT_CK_HYSTERESIS,
    MT_CK_LOSS_SCALE_BITS, /* the double's bits */
    MT_CK_TP, MT_CK_PP,
    MT_CK_SHARDED_DP,    /* 0: m and v follow the master weights; d > 0: sharded over d DP ranks */
    MT_CK_DP_RANK,       /* shard files: the DP rank */
    MT_CK_SHARD_NUMEL,   /* shard files: elements per array */
    /* the flavour; 0 in every word is GPT-2 (so files from before these words load as GPT-2) */
    MT_CK_NORMALIZATION, /* mt_normalization */
    MT_CK_SWIGLU,
    MT_CK_POSITION_TYPE, /* mt_position_embedding */
    MT_CK_ROTARY_BASE_BITS, MT_CK_ROTARY_PERCENT_BITS, /* the doubles' bits (rope only) */
    MT_CK_ROPE_SCALING_FACTOR_BITS, /* 0: no Llama-3.1 scaling */
    MT_CK_UNTIED,
    MT_CK_NO_BIAS_LINEAR,
    MT_CK_NORM_EPS_BITS, /* informational (for export): --norm-epsilon's bits */
    MT_CK_TRUE_VOCAB,    /* informational (for export): the tokenizer's vocabulary, 0 if unknown */
    MT_CK_TP_RANK,       /* the tensor-parallel rank whose shard the file holds (mp_rank_<tp>) */
    /* FP8 (0 without): model files then end with the delayed-scaling state, for FP8_TENSORS tensors:
     * scale [n], scale_inv [n, 4] (16-byte slots: the first float of each), amax history
     * [n, FP8_HISTORY_LEN] (fp32); the ring's next slot in FP8_HISTORY_POS */
    MT_CK_FP8_TENSORS, MT_CK_FP8_HISTORY_LEN, MT_CK_FP8_HISTORY_POS,
    /* pipeline parallelism (0 in older files: one stage): the file of mp_rank_<tp>_<pp> holds
     * pipeline rank PP_RANK's tensors (megatron.h mt_pp_holds) in canonical order, VP chunks each */
    MT_CK_PP_RANK, MT_CK_VP, MT_CK_STAGE_NUMEL,
    MT_CK_LAYERNORM_1P,  /* --apply-layernorm-1p: the norm weights are stored as w - 1 (0 in older files) */
    /* the distributed optimizer's buckets (MT_CK_SHARDED_DP > 0), which cut its shard files: the
     * saving run's --overlap-grad-reduce + 1 (0: not recorded, an older file or no sharding) and
     * --ddp-bucket-size (0: Megatron's default) */
    MT_CK_DDP_OVERLAP, MT_CK_DDP_BUCKET_SIZE,
    MT_CK_MANIFESTED,    /* 1: committed with a manifest.txt, which a reader then requires (0: a file from
                          * before manifests, read with a warning) */
    MT_CK_SQUARED_RELU,  /* --squared-relu: the MLP's activation is relu(x)^2 (0 in older files) */
    MT_CK_QK_LAYERNORM,  /* --qk-layernorm: per-head norms of the queries and keys (0 in older files) */
    /* mixture of experts (0 in every word: a dense model, and every older file): --num-experts, the expert
     * width (mt_moe_ffn), --moe-shared-expert-intermediate-size, --moe-shared-expert-gate, how many layers
     * are MoE and which (mt_moe_layers_word) */
    MT_CK_NUM_EXPERTS, MT_CK_MOE_FFN, MT_CK_MOE_SHARED, MT_CK_MOE_SHARED_GATE, MT_CK_MOE_LAYERS, MT_CK_MOE_LAYER_FREQ,
    /* --moe-router-enable-expert-bias (0 in older files and without it): 1: every model file ends with the
     * routers' expert bias [MOE_LAYERS, NUM_EXPERTS] fp32 (mt_checkpoint_expert_bias_numel) */
    MT_CK_MOE_EXPERT_BIAS,
    /* expert parallelism (0 in both words at EP = 1, and in every older file): the expert-parallel size, and
     * the EP rank whose experts the file holds (mp_rank_<tp>_<ep>/: its E / EP experts of every expert tensor,
     * mt_param_layout_shard's order for shard tp + TP x ep; every other tensor whole, as at EP = 1) */
    MT_CK_EP, MT_CK_EP_RANK,
    MT_CK_HEADER_WORDS = 64
};
/* Which layers are MoE, as one number for the checkpoint header: 0 for a dense model; N in [1, layers]
 * when they are the layers l % N == 0 (--moe-layer-freq N, or a pattern that is the same layers; N the
 * smallest that gives them); else a hash of the pattern (FNV-1a over its entries) with the sign bit set.
 * O(1) for --moe-layer-freq N, O(pattern) for a pattern. */
MT_DEF int64_t mt_moe_layers_word(const mt_config* cfg);
/* Zeroes header[MT_CK_HEADER_WORDS] and fills the words that describe cfg's model: magic, version,
 * shape, parameter count, precision, seed, parallel sizes (progress words stay 0, and so does
 * MT_CK_MANIFESTED: a writer sets it to 1 when it commits the checkpoint with a manifest, which every
 * writer of this project does). */
MT_DEF void mt_checkpoint_header_init(int64_t* header, const mt_config* cfg);
/* The reverse: the model fields of cfg (shape and flavour) from a header; vocab_size is set to the
 * padded size (it pads to itself). Other fields are left as they are. Only for a header that
 * mt_checkpoint_header_check accepted. */
MT_DEF void mt_config_from_checkpoint_header(mt_config* cfg, const int64_t* header);
/* Every word of a header read from a file, checked before any is used as a size, a count or a
 * value: magic and version; the shape words in [1, 2^31) with a parameter count that fits (the
 * overflow checks of mt_config_finalize) and equals MT_CK_NUM_PARAMS; the flavour words in their
 * enums' ranges (switches, --apply-layernorm-1p included, 0 or 1) and the rope and norm doubles finite
 * and in range; the parallel sizes >= 1, the ranks below them, at most MT_PP_MAX_CHUNKS virtual
 * stages and the pipeline stage's words consistent;
 * a known precision; progress, scheduler and Adam counters >= 0; the loss-scaler counters within
 * int (the growth tracker >= 0; hysteresis counts down past 0, as Megatron's) and the loss scale
 * finite and > 0; the FP8 words in range; the manifest mark 0 or 1; the MoE words consistent (an MoE
 * model of at most MT_MAX_MOE_PATTERN layers, its tensors' sizes overflow-checked, the expert bias word
 * 0 or 1 and only with experts), the expert-parallel words (a size of 0 or one > 1 that divides the experts
 * and the optimizer's sharding, a rank below it, every file's DP rank one of its EP rank's). cfg (if not
 * NULL) gets the model
 * (mt_config_defaults, then mt_config_from_checkpoint_header). path names the file in messages. */
MT_DEF mt_status mt_checkpoint_header_check(const int64_t* header, const char* path, mt_config* cfg, mt_error* err);
/* The exact size in bytes of a checkpoint file with this (checked) header: the model file
 * (model_optim_rng.bin: master weights of its TP shard, then m and v unless sharded, then the FP8
 * state, then the expert bias) or, shard_file != 0, a distrib_optim_dp<r>.bin (master, m and v of
 * MT_CK_SHARD_NUMEL each). */
MT_DEF int64_t mt_checkpoint_file_bytes(const int64_t* header, int shard_file);
/* The routers' expert bias at the end of a model file with this (checked) header, the one size rule of
 * every writer and reader: MT_CK_MOE_LAYERS x MT_CK_NUM_EXPERTS fp32 values, MoE layer by MoE layer in
 * model order (0 without MT_CK_MOE_EXPERT_BIAS); *at (if not NULL) gets their offset in floats after the
 * header (after the arrays and the FP8 state). */
MT_DEF int64_t mt_checkpoint_expert_bias_numel(const int64_t* header, int64_t* at);
/* Reads the expert bias of model file fd (`path` in messages; header h checked, the file's size too) into
 * out [mt_checkpoint_expert_bias_numel] and checks every value is finite (one line names the first that
 * is not, by MoE layer and expert); a file that ends first is "cut short". */
MT_DEF mt_status mt_checkpoint_read_expert_bias(int fd, const char* path, const int64_t* h, float* out, mt_error* err);
/* The distributed optimizer's buckets, which cut its shard files: --overlap-grad-reduce and
 * --ddp-bucket-size (the header records the saving run's: MT_CK_DDP_*). */
typedef struct {
    int overlap_grad_reduce;
    int64_t ddp_bucket_size; /* 0: Megatron's default */
} mt_ckpt_ddp;
/* One rank's place in a checkpoint of its own layout: what its files are called, and what the rank
 * words of their headers hold (a writer sets them with mt_checkpoint_header_set_rank; a reader at the
 * same layout checks them with mt_checkpoint_header_check_rank). */
typedef struct {
    int tp_rank, pp_rank, dp_rank; /* its coordinates (mt_rank_coordinates) */
    int pp;                        /* pipeline stages (> 1: mp_rank_<tp>_<pp>/ and the stage's words) */
    int vp;                        /* model chunks of each pipeline rank */
    int64_t stage_numel;           /* one array of its model file: its stage's tensors of its TP shard */
    int dp;                        /* the data-parallel size */
    int sharded;                   /* the distributed optimizer shards master, m and v over the dp ranks */
    int64_t shard_numel;           /* one array of its shard file */
    mt_ckpt_ddp ddp;               /* the buckets that cut the shards */
    int ep;                        /* the expert-parallel size (0 or 1: none); its EP rank is dp_rank % ep */
} mt_ckpt_rank;
/* <iter_dir>/mp_rank_<tp>[_<pp>][_<ep>] (the _<pp> part when the layout has pp > 1 stages, the _<ep> part,
 * three digits, when it has ep > 1 expert-parallel ranks: Megatron's names) */
MT_DEF void mt_ckpt_rank_dir_ep(char* buf, size_t cap, const char* iter_dir, int pp, int ep, int tp_rank, int pp_rank,
                                int ep_rank);
/* The same at EP = 1: <iter_dir>/mp_rank_<tp>[_<pp>] */
MT_DEF void mt_ckpt_rank_dir(char* buf, size_t cap, const char* iter_dir, int pp, int tp_rank, int pp_rank);
/* A file of a rank's directory: <rank_dir>/model_optim_rng.bin (dp_shard < 0), else DP rank dp_shard's
 * shard file <rank_dir>/distrib_optim_dp<dp_shard, three digits>.bin. */
MT_DEF void mt_ckpt_file_path(char* buf, size_t cap, const char* rank_dir, int dp_shard);
/* The files rank r writes, in this order: its shard file (sharded), then the model file on DP rank 0
 * (the DP replicas of a TP x PP rank hold the same model file; with EP > 1 on DP ranks 0 .. EP-1, one per
 * EP rank, the first DP rank holding its experts), in its EP rank's directory; paths relative to the
 * iteration directory. Returns how many (0 to 2). */
typedef struct {
    char path[96];
    int shard; /* 1: the shard file (master, m, v of the DP shard), 0: the model file */
} mt_ckpt_file;
MT_DEF int mt_ckpt_rank_files(const mt_ckpt_rank* r, mt_ckpt_file files[2]);
/* The rank words of a header that mt_checkpoint_header_init filled: r's TP, PP and DP ranks, the
 * stage's words (VP, parameter count) when pp > 1, the sharding's (DP size, shard size, buckets) when
 * sharded, else 0, the expert-parallel size and rank when ep > 1, else 0. */
MT_DEF void mt_checkpoint_header_set_rank(int64_t* header, const mt_ckpt_rank* r);
/* Every header word that describes the model (shape, flavour) and its layout must be cfg's (one line
 * names the first that differs); with any_layout the parallel layout (TP, PP) and the vocabulary's
 * padding may differ (a load at another layout, which re-pads: then the true vocabulary, when the
 * header knows it, must be cfg's). */
MT_DEF mt_status mt_checkpoint_header_check_model(const int64_t* header, const char* path, const mt_config* cfg,
                                                  int any_layout, mt_error* err);
/* A file that rank r of cfg's layout reads at its own layout, `file_bytes` long (its size on disk):
 * every word in range (mt_checkpoint_header_check), the iteration the one asked for, the file's exact
 * size, the model and layout cfg's (mt_checkpoint_header_check_model), the TP rank and the pipeline
 * stage's words r's, optimizer state sharded over r's DP size if at all, and a shard file (shard_file)
 * r's DP rank's, of r's shard size. */
MT_DEF mt_status mt_checkpoint_header_check_rank(const int64_t* header, int64_t file_bytes, const char* path,
                                                 const mt_config* cfg, const mt_ckpt_rank* r, int64_t iteration,
                                                 int shard_file, mt_error* err);
/* Reads and checks a header of `path` (shard_file: a distrib_optim file): its words in range, the
 * file's exact size, and (ref not NULL) every model and layout word as ref's but for the rank words,
 * which must be (tp_rank, pp_rank, dp_rank). *fd_out (if not NULL) gets the file, open (else -1). */
MT_DEF mt_status mt_ckpt_read_header(const char* path, const int64_t* ref, int shard_file, int tp_rank, int pp_rank,
                                     int dp_rank, int64_t* h, int* fd_out, mt_error* err);
/* The tracker <dir>/latest_checkpointed_iteration.txt: Megatron's one decimal iteration (its
 * "release" is not supported). Reading refuses anything else with one line; writing goes through a
 * temporary file, fsync'ed and renamed (the previous tracker stays until the new one is complete). */
MT_DEF mt_status mt_checkpoint_read_tracker(const char* dir, int64_t* iteration, mt_error* err);
MT_DEF mt_status mt_checkpoint_write_tracker(const char* dir, int64_t iteration, mt_error* err);
/* <dir>/iter_%07lld of an iteration, into out: a save that replaces an iteration moves the old
 * directory to iter_%07lld.old before it renames the new one into place; when a crash came between
 * those two renames only the .old exists, and this returns it (the complete old checkpoint). */
MT_DEF void mt_checkpoint_iteration_dir(char* out, size_t cap, const char* dir, int64_t iteration);
/* mkdir -p: 0, or -1 with errno set. */
MT_DEF int mt_make_directories(const char* path);
/* --save-retain-interval (Megatron's checkpointing.py): once the save of iteration `saved` is
 * committed (the tracker names it), the checkpoint the tracker named before it (`previous`; -1: none)
 * is deleted unless it is iteration 0 or less, the one just saved, a multiple of retain_interval, or
 * the iteration of a save still being written (`pending`; -1: none). Run after run, what stays is
 * every multiple of the interval and the newest. Returns the iteration to delete, or -1 (also for an
 * interval < 1: no retention). */
MT_DEF int64_t mt_checkpoint_retain_victim(int64_t previous, int64_t saved, int64_t retain_interval, int64_t pending);
/* Applies it to dir: only when the tracker now names `saved` (a save that was not committed deletes
 * nothing), the victim's directory is renamed to a .tmp_iter_ name (which the next save removes, so a
 * crash leaves no half-deleted checkpoint in place) and removed; a symbolic link is left alone, as
 * Megatron does (where the platform has O_NOFOLLOW; elsewhere the link goes, never what it points to).
 * *deleted: the iteration deleted, or -1. Rank 0 only (the ranks share the file system). */
MT_DEF mt_status mt_checkpoint_retain_apply(const char* dir, int64_t previous, int64_t saved, int64_t retain_interval,
                                            int64_t pending, int64_t* deleted, mt_error* err);
/* A save's directories: the iteration's <dir>/iter_%07lld, and the temporary <dir>/.tmp_iter_%07lld
 * its files are written into until the commit renames it into place. */
MT_DEF void mt_checkpoint_save_dirs(const char* dir, int64_t iteration, char* final_dir, size_t final_cap,
                                    char* tmp_dir, size_t tmp_cap);
/* Before a save (rank 0): removes the temporary directories (.tmp_iter_*) of saves that never
 * finished, and settles every iter_N.old a save left: removed when iter_N is in place, else renamed
 * back. */
MT_DEF void mt_checkpoint_tidy(const char* dir);

/* The manifest: <iter dir>/manifest.txt lists every other regular file under the iteration
 * directory (subdirectories included), with its size and CRC-32C (mt_crc32c_extend), one file a line,
 * sorted by path (bytewise):
 *     megatron.c checkpoint manifest 1
 *     files <count>
 *     <crc32c, 8 lowercase hex digits> <size in bytes, decimal> <path relative to the iteration dir>
 * (a path may hold spaces; none holds a newline, starts with '/' or has an empty, "." or ".." part).
 * It is written last, to a temporary name, fsync'ed and renamed: a manifest in place is the mark of
 * a complete checkpoint. Checkpoints of this project from before the manifest have none. */
#define MT_CKPT_MANIFEST "manifest.txt"
/* Lists iter_dir's files into iter_dir/manifest.txt (reading every byte once). */
MT_DEF mt_status mt_checkpoint_manifest_write(const char* iter_dir, mt_error* err);
/* A file whose size and CRC-32C its writer computed from the bytes it wrote (path relative to the
 * iteration directory). */
typedef struct {
    char path[256];
    int64_t size;
    uint32_t crc;
} mt_checkpoint_file_crc;
/* The same manifest, taking the checksum of each listed file that `known` names with the size the
 * file has on disk from there instead of reading it (a trainer's save: its writers checksummed the
 * bytes as they wrote them, so the commit does not read the checkpoint back); other files are read. */
MT_DEF mt_status mt_checkpoint_manifest_write_known(const char* iter_dir, const mt_checkpoint_file_crc* known,
                                                    int num_known, mt_error* err);
/* Reads iter_dir/manifest.txt and checks every listed file is there, a regular file of that size and
 * checksum, and that no file is there that it does not list; one line names the first bad file
 * (MT_ERR_IO when the manifest itself is missing or unreadable, else MT_ERR_FORMAT). */
MT_DEF mt_status mt_checkpoint_manifest_verify(const char* iter_dir, mt_error* err);
/* Commits a save whose every file is complete in tmp_dir (mt_checkpoint_save_dirs) as `iteration` of
 * dir: the manifest (mt_checkpoint_manifest_write_known; a failure removes tmp_dir), an older copy of
 * the iteration moved aside to iter_N.old, tmp_dir renamed into place and the directory synced, the
 * .old removed (or put back when the new one did not arrive), then the tracker. */
MT_DEF mt_status mt_checkpoint_commit(const char* dir, int64_t iteration, const char* tmp_dir,
                                      const mt_checkpoint_file_crc* known, int num_known, mt_error* err);
/* The integrity rule, the one every reader of a checkpoint applies before it reads its data (the
 * trainer's --load, checkpoint_tool, convert_hf --export, eval_hellaswag, dev/hf_logits through
 * these functions; prepro/convert_mcore.py restates it in Python):
 *   - manifest.txt present: mt_checkpoint_manifest_verify; a failure refuses the checkpoint in one
 *     line naming the bad file;
 *   - absent: the first model file's header (mp_rank_00[_000]/model_optim_rng.bin, its words and
 *     size checked) decides: MT_CK_MANIFESTED 1 (it was committed with one) refuses it ("incomplete or
 *     tampered"); 0 (a checkpoint from before manifests) is accepted with a warning: read unchecked.
 * A missing iteration directory is refused (MT_ERR_IO). no_verify (a tool's --no-verify, train_gpt's
 * --no-verify-checkpoint) turns every refusal into a warning that says why, and MT_OK: the reader then
 * proceeds (and fails by itself on what it cannot read). Library code does not print: *warning (may be
 * NULL) gets the one line for the caller to print, "" when there is nothing to say. */
MT_DEF mt_status mt_checkpoint_check_integrity(const char* iter_dir, int no_verify, mt_error* warning, mt_error* err);
/* The iteration a reader reads, the rule above applied: `iteration` (< 0: the tracker's) when it
 * passes. With fell_back not NULL (the trainer's --load) a tracker's iteration that is refused gives
 * way to the newest older iter_* directory of dir whose manifest verifies (*fell_back = 1; *warning
 * says which was refused and why); with fell_back NULL (the tools: they read what they are asked or
 * nothing), and for an explicit iteration, the refusal is the result. */
MT_DEF mt_status mt_checkpoint_select(const char* dir, int64_t iteration, int no_verify, int64_t* chosen,
                                      int* fell_back, mt_error* warning, mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* 14. Checkpoints at any layout: the reader of any rank's part                                    */
/*    A checkpoint's layout from its first header, and any rank's part of another layout cut from  */
/*    the saved files slice by slice (the trainer's --load at another layout, checkpoint_tool.h).  */
/* ---------------------------------------------------------------------------------------------- */

/* A checkpoint read at any layout: its layout from the first model file's header (mp_rank_00 or
 * mp_rank_00_000), each file's header and exact size checked when first read, and any rank's part
 * of a model at another layout (TP, PP with virtual stages, EP, DP with or without the distributed
 * optimizer) cut from the saved files tensor by tensor: the loader of megatron.cu (a --load at
 * another layout) and prepro/checkpoint_tool.h use it. The distributed optimizer's buckets depend on
 * --overlap-grad-reduce and --ddp-bucket-size: the header records the saving run's
 * (MT_CK_DDP_*); for older files without them the caller passes them (mt_ckpt_ddp, NULL: one
 * bucket), and a shard size other than the header's is refused naming the flags. */
typedef struct {
    char iter_dir[4200];
    int64_t iteration;
    int64_t header[MT_CK_HEADER_WORDS]; /* the first model file's (mp_rank_00[_000]) */
    mt_config cfg;                      /* the model, at the files' TP, PP and VP */
    int tp, pp, vp, sharded_dp;         /* sharded_dp: 0, or the distributed optimizer's DP size */
    int ep;                             /* the expert-parallel size (1: none) */
} mt_ckpt;
enum { MT_CKPT_MASTER = 0, MT_CKPT_M, MT_CKPT_V, MT_CKPT_ARRAYS }; /* the three fp32 arrays of a checkpoint */
/* The buckets of ck's distributed-optimizer shards: the header's record, else `fallback` (NULL: one bucket). */
MT_DEF mt_ckpt_ddp mt_ckpt_saved_ddp(const mt_ckpt* ck, const mt_ckpt_ddp* fallback);
/* The model of header h at a layout, as rank (tp_rank, DP 0, pp_rank) of it sees it: dp > 0 with the
 * distributed optimizer's buckets (ddp); the expert-parallel size is h's (MT_CK_EP; without the
 * distributed optimizer the data-parallel size is then EP, the least it can be). The layer split is
 * checked (an even one: the header does not record --decoder-first/last-pipeline-num-layers). */
MT_DEF mt_status mt_ckpt_config(mt_config* c, const int64_t* h, int tp, int pp, int vp, int dp, const mt_ckpt_ddp* ddp,
                                int tp_rank, int pp_rank, mt_error* err);
/* Elements of one array of a model file of c's rank: its stage's tensors of its TP shard. */
MT_DEF mt_status mt_ckpt_rank_numel(const mt_config* c, int64_t* numel, mt_error* err);
/* Finds the iteration (< 0: the tracker's) and reads its first model file's header. */
MT_DEF mt_status mt_ckpt_open(mt_ckpt* ck, const char* dir, int64_t iteration, mt_error* err);
/* Reads n floats at element offset `at` of the arrays after the header of file fd. */
MT_DEF mt_status mt_ckpt_read_floats(int fd, const char* path, int64_t at, float* out, int64_t n, mt_error* err);
/* One array (MT_CKPT_*) of the part of the model that rank target->rank of the layout `target` (a
 * finalized config: TP, PP, VP, its rank) holds, in its mt_buffer_layout's canonical order (its
 * canonical_size elements into out), read slice by slice from checkpoint ck: for each of its
 * (tensor, layer) pieces, the rows its TP shard holds from each saved TP shard that has them (of an
 * expert tensor, the experts its EP rank holds from each saved EP rank's files that have them), from
 * the pipeline stage that saved the layer (the word embeddings from the first stage), and for the
 * Adam moments of a distributed-optimizer checkpoint from the DP shards that own them (of an expert
 * bucket, the expert-data-parallel shards of the DP ranks holding those experts). At most one
 * saved (tensor, layer) slice is held at a time. The target's model must be the checkpoint's but for
 * the vocabulary padding: rows the target pads beyond the saved ones are 0, saved rows beyond the
 * target's padding are dropped (as checkpoint_tool's reshard re-pads). */
MT_DEF mt_status mt_ckpt_read_part(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, const mt_config* target, int array,
                                   float* out, mt_error* err);
/* The routers' expert bias of checkpoint ck (MT_CK_MOE_EXPERT_BIAS: mt_checkpoint_expert_bias_numel of
 * ck->header floats, [MoE layers, experts]; layout-free, so any layout's run takes it whole) into out, from
 * the first model file (mt_checkpoint_read_expert_bias's checks); with every_file each other model file's
 * copy is read and checked too and must equal it bitwise (checkpoint_tool verify). A checkpoint without
 * one is refused (MT_ERR_CONFIG). */
MT_DEF mt_status mt_ckpt_read_expert_bias(const mt_ckpt* ck, int every_file, float* out, mt_error* err);
/* Before mt_config_finalize of a run that will load from dir: c->resumed_padded_vocab_size = the
 * padded vocabulary of dir's tracked checkpoint (left as it is when dir holds none, or a damaged one:
 * the load says so), so the finalized model keeps it where it can (mt_padded_vocab_size_resumed). */
MT_DEF void mt_config_resume_padding(mt_config* c, const char* dir);

/* ---------------------------------------------------------------------------------------------- */
/* 15. The trainer API (GPU; implemented in megatron.cu)                                           */
/* ---------------------------------------------------------------------------------------------- */

typedef struct mt_trainer mt_trainer;

typedef struct {
    double lm_loss;           /* mean loss over the global batch */
    double grad_norm;         /* global L2 norm before clipping (0 on a skipped step) */
    double learning_rate;     /* the rate this step used */
    double next_learning_rate;/* the rate after the scheduler step (what Megatron logs) */
    double next_decoupled_learning_rate; /* the same for the word embeddings and output layer (--decoupled-lr) */
    double loss_scale;        /* the scale this step used (1 unless fp16) */
    int skipped;              /* 1 if the step was skipped (fp16 overflow) */
    int nan;                  /* 1 if the loss was nan/inf */
    /* --log-params-norm: the L2 norm of the fp32 master weights after the step (a skipped step's: the
     * unchanged ones), every parameter once (a tensor every TP rank holds whole, or the last stage's
     * copy of tied word embeddings, counted once), as Megatron's calc_params_l2_norm; -1 when not
     * asked for or when the step was refused (MT_ERR_NAN) */
    double params_norm;
    /* --log-num-zeros-in-grad: the gradient elements that are exactly 0 after unscaling and clipping
     * (Megatron's count_zeros_fp32), every parameter once as above; -1 when not asked for or when the
     * step was skipped or refused */
    int64_t num_zeros_in_grad;
    /* mixture of experts: the step's logged load-balancing, sequence load-balancing, global load-balancing and
     * z losses (Megatron's load_balancing_loss, seq_load_balancing_loss, global_load_balancing_loss, z_loss:
     * each loss / its coefficient, averaged over the micro-batches, the DP ranks and the MoE layers); 0 for a
     * kind that is off and in a dense model */
    double moe_losses[4];
} mt_step_result;

typedef void (*mt_log_fn)(void* user, const char* line);

/* Makes the NCCL id of a multi-process job (rank 0 calls it; the launcher sends it to all ranks). */
mt_status mt_comm_id_create(mt_comm_id* id, mt_error* err);

/* Creates a trainer on the current CUDA device: plans all memory (mt_memory_plan_compute), refuses
 * with MT_ERR_OOM, before allocating anything, a plan that does not fit the device's free memory (the
 * message names the shortfall), allocates it once, initialises
 * the weights from cfg->seed as Megatron does (normal(std), output projections scaled by 1/sqrt(2L),
 * biases 0, norms 1). cfg must have been finalized. */
mt_status mt_trainer_create(mt_trainer** out, const mt_config* cfg, mt_error* err);
void mt_trainer_free(mt_trainer* t);
/* A multi-GPU job's watchdog (Megatron's --distributed-timeout-minutes; PyTorch's NCCL watchdog): a
 * background thread that every second asks NCCL for asynchronous errors on this rank's communicators
 * and checks that each stream that runs collectives or pipeline transfers makes progress. When NCCL
 * reports an error, or a stream has not moved for cfg.distributed_timeout_minutes (a rank died or
 * hangs), it calls handler once, on its own thread, with one line naming this rank, the stream or
 * communicator and the last NCCL operation issued; the handler must end the process (train_gpt's
 * prints the line and exits 1, and mpirun then ends the job): the collectives cannot complete. No
 * thread in a one-process job. Returns MT_ERR_CUDA when the thread or its events cannot be made. */
typedef void (*mt_collective_timeout_handler)(const char* message, void* user);
mt_status mt_trainer_on_collective_timeout(mt_trainer* t, mt_collective_timeout_handler handler, void* user,
                                           mt_error* err);
/* The plan this GPU's trainer was created from (mt_memory_plan_compute for its pipeline and data-parallel
 * rank), with state_bytes_measured filled. */
mt_memory_plan mt_trainer_memory_plan(const mt_trainer* t);
/* What the trainer allocated at creation, counted per allocation into the plan's categories (the
 * byte fields and total_bytes; the rest 0): equal to the plan's, which the tests check. */
mt_memory_plan mt_trainer_memory_allocated(const mt_trainer* t);

/* One training iteration over this rank's part of the global batch.
 * tokens: [num_micro_batches, micro_batch_size, seq_length + 1] (inputs are [..., :-1], labels [..., 1:]).
 * With cfg->check_for_nan_in_loss_and_grad (the default), a NaN or Inf loss, or gradient norm outside
 * fp16, returns MT_ERR_NAN on every rank with the weights, optimizer and scheduler as before the step. */
mt_status mt_trainer_train_step(mt_trainer* t, const int32_t* tokens, mt_step_result* out, mt_error* err);
/* The same with num_micro_batches micro-batches per rank (>= 1; a batch-size ramp's current count,
 * mt_num_micro_batches_at): tokens [num_micro_batches, micro_batch_size, seq_length + 1]. The
 * learning-rate schedule advances by the samples of that global batch. */
mt_status mt_trainer_train_step_n(mt_trainer* t, const int32_t* tokens, int num_micro_batches, mt_step_result* out,
                                  mt_error* err);
/* The positions the last train step or evaluation counted in its loss, over the data-parallel ranks
 * (every position unless --eod-mask-loss): a mean over several calls weighs each call by it. */
int64_t mt_trainer_last_loss_tokens(const mt_trainer* t);
/* Mixture of experts: the last training pass's (mt_trainer_train_step's or mt_trainer_compute_gradients')
 * statistics of each MoE layer i (model order): losses [Lm, 4] the logged load-balancing, sequence, global
 * and z losses (mt_step_result.moe_losses' per layer), tokens [Lm, E] tokens per expert of the final routing
 * maps summed over the micro-batches and DP ranks (with pipeline parallelism every rank has every stage's
 * layers: the pass sums them over the pipeline), expert_bias [Lm, E] the aux-loss-free bias now (after
 * the last step's update; 0 without --moe-router-enable-expert-bias). Any pointer may be NULL.
 * MT_ERR_CONFIG for a dense model. */
mt_status mt_trainer_moe_stats(mt_trainer* t, float* losses, int32_t* tokens, float* expert_bias, mt_error* err);
/* Forward + backward only: fills the fp32 gradients (mean loss over the batch) and returns the loss. */
mt_status mt_trainer_compute_gradients(mt_trainer* t, const int32_t* tokens, int num_micro_batches,
                                       double* loss, mt_error* err);
/* Mean loss over num_micro_batches micro-batches, no gradients. */
mt_status mt_trainer_evaluate(mt_trainer* t, const int32_t* tokens, int num_micro_batches, double* loss,
                              mt_error* err);
/* Per-token losses -log p(target) of one micro-batch, no gradients: tokens [micro_batch_size, seq_length + 1]
 * as for train_step, losses [micro_batch_size * seq_length] (fp32, over the padded vocabulary as the
 * training loss). With tensor parallelism every TP rank calls it with the same tokens. */
mt_status mt_trainer_token_losses(mt_trainer* t, const int32_t* tokens, float* losses, mt_error* err);
/* Logits of one micro-batch: tokens [micro_batch_size, seq_length], logits [micro, seq, padded vocab] (fp32).
 * With tensor parallelism every TP rank calls it and receives the whole vocabulary. */
mt_status mt_trainer_logits(mt_trainer* t, const int32_t* tokens, float* logits, mt_error* err);

/* Logits (fp32, padded vocabulary) that follow context[0 .. length-1], for generation; length <= seq_length. */
mt_status mt_trainer_next_token_logits(mt_trainer* t, const int32_t* context, int length, float* logits,
                                       mt_error* err);
/* Dense bf16/fp16 (or fp32) tensor-core peak of the current device in TFLOP/s, for MFU; 0 if unknown. */
double mt_device_peak_tflops(mt_precision precision);
/* The current device's name and its free/total memory as the driver reports them. */
mt_status mt_device_info(char* name, size_t name_size, size_t* free_bytes, size_t* total_bytes, mt_error* err);
/* Whether this machine can run CUDA at all, before any other CUDA call: *count visible GPUs, or
 * MT_ERR_CUDA with one line a newcomer can act on: no NVIDIA driver (or GPU) found, a driver older
 * than this build's CUDA runtime (both versions named), or a driver that sees no GPU
 * (CUDA_VISIBLE_DEVICES named when set). */
mt_status mt_device_check(int* count, mt_error* err);

/* Parameters and gradients of the full model in canonical order, fp32 (mt_num_parameters elements).
 * With tensor parallelism every rank calls them: get gathers the TP shards to full shape, set cuts
 * each rank's shard from the full array. With pipeline parallelism each rank sets and gets the
 * elements of its own stage's tensors (mt_pp_holds); get leaves the others alone, and with TP there
 * too gathers its stage's TP shards (set takes TP = 1 at PP > 1). With the distributed optimizer
 * get gathers the DP shards (the fp32 master weights; the reduced gradients, read right after
 * mt_trainer_compute_gradients). Collective: every rank of the TP group (with the distributed optimizer
 * also of the DP group) calls them. */
mt_status mt_trainer_set_parameters(mt_trainer* t, const float* params, mt_error* err);
mt_status mt_trainer_get_parameters(mt_trainer* t, float* params, mt_error* err);
mt_status mt_trainer_get_gradients(mt_trainer* t, float* grads, mt_error* err);

/* Checkpoints in Megatron's layout: <dir>/iter_0000100/mp_rank_00/model_optim_rng.bin and
 * <dir>/latest_checkpointed_iteration.txt, written under temporary names and renamed, the
 * iteration's manifest.txt (section 13) last before the rename, the tracker after it.
 * The checkpoint holds weights, optimizer state, scheduler, loss scaler and data position. */
mt_status mt_trainer_save(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed_samples,
                          mt_error* err);
/* --async-save (Megatron's flag): the same checkpoint, the same bytes. The call stages this rank's
 * files in pinned host memory (the device-to-host copies, all the step loop waits for) and returns;
 * a writer thread writes and fsyncs them. mt_trainer_save_wait commits it once every rank's files
 * are complete: rank 0 writes the manifest, renames the directory into place and writes the tracker
 * (a save not committed is a temporary directory that no load accepts). Non-blocking (blocking = 0)
 * it returns at once, *committed_iteration = -1, while any rank is still writing; a writer's error
 * comes back from it on every rank (one line; the failing rank's own message). Collective: every
 * rank calls it at the same points (the trainer calls it each step, before the next save and at
 * the end). The next save, sync or async, first waits for one still in flight. */
mt_status mt_trainer_save_async(mt_trainer* t, const char* dir, int64_t iteration, int64_t consumed_samples,
                                mt_error* err);
mt_status mt_trainer_save_wait(mt_trainer* t, int blocking, int64_t* committed_iteration, mt_error* err);
/* Allocates the async save's pinned staging now (this rank's checkpoint bytes: about 12 bytes a
 * parameter), so the first mt_trainer_save_async pays only its copies; else the first save allocates
 * it. Not collective; refused while a save is pending. */
mt_status mt_trainer_reserve_async_save(mt_trainer* t, mt_error* err);
/* Loads the latest checkpoint under dir (or iteration `iteration` if >= 0); refuses one of another
 * model shape. The integrity rule comes first (mt_checkpoint_select, by rank 0): when the tracker's
 * iteration is refused and an older one verifies, that one is loaded (the caller sees it in
 * *iteration_out, below the tracker's, and mt_trainer_load_warning says why). Returns the iteration
 * and consumed samples it resumes from.
 * A checkpoint saved at another layout (TP, PP with virtual stages, DP with or without the
 * distributed optimizer) loads too: each rank reads its part slice by slice (mt_ckpt_read_part). */
mt_status mt_trainer_load(mt_trainer* t, const char* dir, int64_t iteration, int64_t* iteration_out,
                          int64_t* consumed_samples_out, mt_error* err);
/* The weights only (--no-load-optim, --finetune): Adam's moments and step, the schedule's position
 * and the loss scaler start afresh, as in a new trainer; iteration and consumed samples as above. */
mt_status mt_trainer_load_weights(mt_trainer* t, const char* dir, int64_t iteration, int64_t* iteration_out,
                                  int64_t* consumed_samples_out, mt_error* err);
/* --no-verify-checkpoint: the loads that follow read a checkpoint the integrity rule refuses
 * (mt_checkpoint_check_integrity: a manifest that fails, or none where the header says there was one)
 * with a warning instead (no_verify 1); 0, a new trainer's setting, refuses it. */
void mt_trainer_set_no_verify_checkpoint(mt_trainer* t, int no_verify);
/* What the last load's integrity check had to say, one line for the caller to print (rank 0; "" on
 * the other ranks and when there was nothing): a tracked iteration refused and an older one read
 * instead, a checkpoint from before manifests read unchecked, or one read despite a failure. */
const char* mt_trainer_load_warning(const mt_trainer* t);
/* The iteration that keys the next train step's dropout masks (with --hidden-dropout or
 * --attention-dropout; megatron.cu section 5): 0 in a new trainer, the checkpoint's iteration after a
 * load, +1 per train step. A caller that renumbers its iterations (--finetune starts at 0) sets it. */
mt_status mt_trainer_set_iteration(mt_trainer* t, int64_t iteration, mt_error* err);
/* Starts (1) or stops (0) the CUDA profiler's capture (nsys --capture-range=cudaProfilerApi). */
mt_status mt_device_profiler(int start, mt_error* err);

/* ---------------------------------------------------------------------------------------------- */
/* 15b. Generation: a KV-cache inference engine over a trainer's weights (megatron.cu)             */
/*    Requests (a prompt and its sampling settings) join and leave between steps (continuous      */
/*    batching). A step prefills the prompts added since the last step and decodes one token for  */
/*    every running request. The keys and values live in a pool of fixed-size blocks (so requests */
/*    of any length never fragment it); each request holds a list of blocks. Sampling runs on the */
/*    GPU from (seed, request's own token index) alone, so a request's text does not depend on    */
/*    which other requests share its steps (greedy = temperature 0).                             */
/* ---------------------------------------------------------------------------------------------- */

typedef struct mt_generator mt_generator;

typedef struct {
    int max_batch;       /* requests decoded together, >= 1 */
    int max_context;     /* tokens per request, prompt + generated, 1 .. the model's max positions */
    int block_tokens;    /* tokens per KV-cache block, a power of two in 16 .. 1024 (0: 64) */
    int64_t num_blocks;  /* blocks in the pool (0: max_batch * ceil(max_context / block_tokens)) */
    int max_step_tokens; /* rows one step runs: its prompts' tokens plus one per decoding request, at least
                            max_context + max_batch, at most 2^20 (0: the larger of that and 8192) */
} mt_generator_config;

typedef struct {
    float temperature;   /* 0: greedy (argmax, ties to the lowest token id); else > 0 */
    int top_k;           /* 0: off; else keep the k most likely tokens */
    float top_p;         /* 0 or 1: off; else keep the smallest set whose probability reaches top_p */
    uint64_t seed;       /* same seed, same prompt, same settings: the same tokens */
    int max_new_tokens;  /* >= 0 (0: only the prompt's log-probabilities) */
    const int32_t* stop_tokens; /* tokens that end the request (the stop token itself is returned) */
    int num_stop_tokens; /* 0 .. 16; copied at mt_generator_add */
    int prompt_logprobs; /* 1: also return log p(prompt[i] | prompt[0..i-1]) for i >= 1 */
} mt_sampling;

/* One new token of one request, as mt_generator_step returns it. */
typedef struct {
    int64_t id;          /* the request's id from mt_generator_add */
    int32_t token;       /* the token sampled */
    float logprob;       /* its log-probability under the model's distribution (before temperature,
                            top-k and top-p), fp32 over the real (unpadded) vocabulary */
    int finished;        /* 1: a stop token, max_new_tokens or max_context ended it; its blocks are free */
} mt_generated;

/* Creates the engine on the trainer's GPU, sharing its weights (the trainer must outlive it and must not
 * train while it exists). Allocates the block pool and its decode workspace once; MT_ERR_OOM (naming the
 * bytes) when they do not fit. MT_ERR_CONFIG for a layout it does not serve (PP > 1, and others it names). */
mt_status mt_generator_create(mt_generator** out, mt_trainer* t, const mt_generator_config* gc, mt_error* err);
void mt_generator_free(mt_generator* g);
/* Adds a request: prompt [prompt_len] (1 .. max_context - 1 tokens, each < the vocabulary). *id is its
 * handle (increasing from 0). MT_ERR_RANGE when no slot or not enough free blocks for the prompt are left
 * now (the caller retries after a step frees some); MT_ERR_ARG on a bad prompt or setting. */
mt_status mt_generator_add(mt_generator* g, const int32_t* prompt, int prompt_len, const mt_sampling* s,
                           int64_t* id, mt_error* err);
/* The prompt log-probabilities of request id (after the step that prefilled it, when asked for with
 * prompt_logprobs): out [prompt_len - 1]; MT_ERR_ARG when not asked for, not yet prefilled or unknown. */
mt_status mt_generator_prompt_logprobs(mt_generator* g, int64_t id, float* out, mt_error* err);
/* One step: prefill the requests added since the last step (their first token comes from it), decode one
 * token for each other running request. out [max_out] receives one entry per running request (max_out >=
 * the running count, at most max_batch); *n_out how many. A finished request is forgotten after the step
 * that returns its last token. */
mt_status mt_generator_step(mt_generator* g, mt_generated* out, int max_out, int* n_out, mt_error* err);
/* Ends request id now (a client went away); its blocks are free for the next add. MT_ERR_ARG if unknown. */
mt_status mt_generator_cancel(mt_generator* g, int64_t id, mt_error* err);
/* Requests running (added and not finished) now. */
int mt_generator_running(const mt_generator* g);
/* Blocks of the pool free now (a request takes, at mt_generator_add, the blocks of every position it can
 * ever cache: min(prompt_len + max_new_tokens, max_context) - 1 positions, at least its prompt's; they are
 * free again when it finishes or is cancelled). */
int64_t mt_generator_free_blocks(const mt_generator* g);
/* The current GPU's device-to-device copy bandwidth in bytes/s (bytes read plus written by a 1 GiB
 * cudaMemcpy, the best of 5): the memory-bandwidth bound of decoding (dev/bench/generate_bench.sh). */
mt_status mt_device_copy_bandwidth(double* bytes_per_second, mt_error* err);
/* The engine's decode GEMV (megatron.cu section 22's gemv_rows: the linears of steps of at most 8 rows)
 * against cuBLAS on the trainer's GPU (dev/generate_bench --gemv): y [n, M] = x [n, K] W^T in bf16, W [M, K]
 * row-major as the linears store theirs, random values. Each the median of 21 samples of 10 back-to-back
 * launches timed by CUDA events after 5 warm-up launches, the launches cycling over enough copies of W (at
 * least 256 MB together) that none finds its weights in L2. *gemv_s: seconds a launch (more than 8 rows:
 * chunks of 8, W read once a chunk); *cublas_s: the same product through cuBLAS (cublasGemmStridedBatchedEx,
 * as the engine's larger steps). n 1 .. 64, M and K 1 .. 65536, K a multiple of 8. On the trainer's stream. */
mt_status mt_decode_gemv_benchmark(mt_trainer* t, int n, int M, int K, double* gemv_s, double* cublas_s, mt_error* err);

/* Implementation notes (megatron.cu sections 22 and 23):
 *  - A step prefills pending requests in the order they were added while the step's rows (one per prompt
 *    token, one per decoding request) stay within max_step_tokens; a prompt that does not fit waits for the
 *    next step (it always fits beside the decoding requests). Its first token comes from that step.
 *  - A request with max_new_tokens 0 gets one entry from its prefill step: token -1, logprob 0, finished.
 *  - A finished request's prompt log-probabilities stay readable until the next mt_generator_step (a
 *    cancelled request's are forgotten at once).
 *  - fp32 and bf16/fp16 models; an FP8-trained model generates from its bf16 weights (no FP8 GEMMs).
 *    Served: TP = PP = 1, dense (no MoE), at most MT_GEN_MAX_QPG query heads per K/V group, head dim
 *    <= 256, no --fp8-param-gather (mt_generator_supported says why not).
 *  - The attention of a request and its sampling do not depend on the other requests of a step; the
 *    linears of steps of at most 8 rows run a GEMV whose every output is the same sum whatever the rows
 *    beside it (bitwise), larger steps go to cuBLAS over all rows together, which may pick another kernel
 *    for another row count: a request's logits can then differ in the last bits with the batch (its
 *    tokens only at a near-tie). MT_GEN_GEMV=0 in the environment sends every step to cuBLAS;
 *    MT_GEN_PDL=0 launches the decode kernels without programmatic dependent launch. */
#define MT_GEN_MAX_QPG 8
#define MT_GEN_MAX_STOP_TOKENS 16
#define MT_GEN_MAX_BATCH 4096
/* Host checks (no GPU), the ones mt_generator_create and mt_generator_add make: */
/* the model: MT_ERR_CONFIG naming what the engine does not serve */
MT_DEF mt_status mt_generator_supported(const mt_config* cfg, mt_error* err);
/* gc against the finalized model cfg; *resolved = gc with its defaults filled (block_tokens, num_blocks) */
MT_DEF mt_status mt_generator_config_check(const mt_generator_config* gc, const mt_config* cfg,
                                           mt_generator_config* resolved, mt_error* err);
/* one request: the prompt (1 .. max_context - 1 tokens in [0, vocab)) and its sampling settings
 * (temperature finite >= 0, top_k >= 0, top_p in [0, 1], max_new_tokens >= 0, 0 .. 16 stop tokens in
 * [0, vocab), prompt_logprobs 0 or 1): MT_ERR_ARG naming the bad one */
MT_DEF mt_status mt_generator_request_check(const int32_t* prompt, int prompt_len, const mt_sampling* s,
                                            int max_context, int64_t vocab, mt_error* err);
/* Blocks a request holds: those of min(prompt_len + max_new_tokens, max_context) - 1 positions, at least
 * prompt_len (its prefill caches every prompt token). */
MT_DEF int64_t mt_generator_request_blocks(int prompt_len, int max_new_tokens, int max_context, int block_tokens);

/* ---------------------------------------------------------------------------------------------- */
/* 16. TensorBoard event files                                                                     */
/*    What --tensorboard-dir writes, read by TensorBoard itself (and by `wandb sync               */
/*    --sync-tensorboard`). A file is a sequence of TFRecords: u64 length, u32 masked CRC-32C of   */
/*    those 8 bytes, the data, u32 masked CRC-32C of the data (little endian; the mask rotates the */
/*    CRC right by 15 bits and adds 0xa282ead8). Each record is an Event protobuf                  */
/*    (tensorflow/core/util/event.proto): wall_time (field 1, double), step (2, int64, left out    */
/*    when 0 as proto3 does), then file_version "brain.Event:2" (3) in the first record, or a      */
/*    Summary (5) of one Value: a scalar is tag (1) + simple_value (2, float); a text is tag + a   */
/*    DT_STRING tensor of shape [1] (8) + metadata naming the "text" plugin (9), as                */
/*    torch.utils.tensorboard's add_text writes it. Fields in field-number order, so a record's    */
/*    bytes equal protobuf's own serialization (tests/test_tensorboard.h holds vectors written by  */
/*    the tensorboard package). Encoded by hand (varints, fixed64/fixed32, length-delimited): no   */
/*    protobuf library. Host only, no threads: events wait in memory and are written by          */
/*    mt_tb_flush, or when queue_size of them are pending (Megatron's --tensorboard-queue-size).   */
/* ---------------------------------------------------------------------------------------------- */

typedef struct mt_tb_writer mt_tb_writer;

/* CRC-32C (Castagnoli, reflected polynomial 0x82f63b78) and TFRecord's masked form of it.
 * mt_crc32c_extend continues crc (the CRC of the bytes before, 0 for none) over n more bytes, so a
 * file's CRC can be computed in pieces (the checkpoint manifest); mt_tb_crc32c(d, n) is
 * mt_crc32c_extend(0, d, n). SSE4.2's crc32 instruction where the CPU has it (checked at run time),
 * else bit by bit. */
MT_DEF uint32_t mt_crc32c_extend(uint32_t crc, const void* data, size_t n);
MT_DEF uint32_t mt_tb_crc32c(const void* data, size_t n);
MT_DEF uint32_t mt_tb_masked_crc32c(const void* data, size_t n);

/* Creates dir (mkdir -p) and in it a new file events.out.tfevents.<unix time, 10 digits>.<host>.<pid>.<k>
 * (k: the first number that makes the name new) whose first record, written at once, is the
 * file_version event. queue_size >= 1: pending events that force a flush. */
MT_DEF mt_status mt_tb_open(mt_tb_writer** out, const char* dir, int queue_size, mt_error* err);
MT_DEF const char* mt_tb_path(const mt_tb_writer* w);
/* A scalar (stored as float32, as TensorBoard does) at step. */
MT_DEF mt_status mt_tb_scalar(mt_tb_writer* w, const char* tag, double value, int64_t step, mt_error* err);
/* Megatron's habit for training scalars: tag at step iteration and "<tag> vs samples" at step
 * consumed_samples. */
MT_DEF mt_status mt_tb_scalar_pair(mt_tb_writer* w, const char* tag, double value, int64_t iteration,
                                   int64_t consumed_samples, mt_error* err);
/* A text at step, under the tag "<tag>/text_summary" (add_text's naming). */
MT_DEF mt_status mt_tb_text(mt_tb_writer* w, const char* tag, const char* text, int64_t step, mt_error* err);
/* Writes the pending events to the file. */
MT_DEF mt_status mt_tb_flush(mt_tb_writer* w, mt_error* err);
/* Flushes, closes and frees (w may be NULL). The status is the flush's or the close's. */
MT_DEF mt_status mt_tb_close(mt_tb_writer* w, mt_error* err);

#ifdef __cplusplus
}
#endif

#endif /* MEGATRON_H */

/* ============================================================================================== */
/*                                       IMPLEMENTATION                                           */
/* ============================================================================================== */
/* Outside the declarations' guard, so that a file may include this header for the declarations
 * first and define MEGATRON_IMPLEMENTATION before a later include; the second guard keeps the
 * implementation to one copy per translation unit however often the header is included. */
#if defined(MEGATRON_IMPLEMENTATION) && !defined(MEGATRON_IMPLEMENTATION_DONE)
#define MEGATRON_IMPLEMENTATION_DONE

/* Every system header the implementation uses (the top comment's "Platform" says why each). */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* 1. Status and errors ------------------------------------------------------------------------- */

MT_DEF const char* mt_status_name(mt_status status) {
    switch (status) {
        case MT_OK: return "ok";
        case MT_ERR_IO: return "io error";
        case MT_ERR_FORMAT: return "format error";
        case MT_ERR_ARG: return "bad argument";
        case MT_ERR_CONFIG: return "bad configuration";
        case MT_ERR_OOM: return "out of memory";
        case MT_ERR_CUDA: return "cuda error";
        case MT_ERR_NCCL: return "nccl error";
        case MT_ERR_RANGE: return "out of range";
        case MT_ERR_NAN: return "not a finite number";
    }
    return "unknown error";
}

MT_DEF mt_status mt_fail(mt_error* err, mt_status status, const char* fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof(err->message), fmt, ap);
        va_end(ap);
    }
    return status;
}

/* 2. Indexed datasets (.bin/.idx, Megatron MMIDIDX v1): reader and writer ---------------------- */

/* The .idx arrays start at byte 34, so they are unaligned: every load goes through memcpy (one
 * instruction on x86 and ARM). The files are little-endian; so is every host we build for. */
static inline int32_t mt__load_i32(const unsigned char* p) { int32_t v; memcpy(&v, p, 4); return v; }
static inline int64_t mt__load_i64(const unsigned char* p) { int64_t v; memcpy(&v, p, 8); return v; }
static inline uint64_t mt__load_u64(const unsigned char* p) { uint64_t v; memcpy(&v, p, 8); return v; }

static char* mt__strdup(const char* s) {
    size_t n = strlen(s) + 1;
    char* d = (char*)malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* malloc'd "<a><b>" (b may be NULL). */
static char* mt__concat(const char* a, const char* b) {
    size_t na = strlen(a), nb = b ? strlen(b) : 0;
    char* d = (char*)malloc(na + nb + 1);
    if (!d) return NULL;
    memcpy(d, a, na);
    if (nb) memcpy(d + na, b, nb);
    d[na + nb] = 0;
    return d;
}

/* Writes all n bytes to fd. */
static int mt__write_all(int fd, const void* buf, size_t n) {
    const char* p = (const char*)buf;
    while (n > 0) {
        ssize_t k = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (k < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

/* Files ------------------------------------------------------------------------------------------ */

static const char* mt__file_kind(mode_t mode) {
    return S_ISDIR(mode) ? "a directory" : S_ISFIFO(mode) ? "a FIFO" : S_ISCHR(mode) ? "a character device"
         : S_ISBLK(mode) ? "a block device" : "a special file";
}

/* mt_open_regular_file, with the file's stat in *st */
static int mt__open_regular(const char* path, struct stat* st_out, mt_error* err) {
    struct stat before, st;
    if (stat(path, &before) != 0) {
        mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    if (!S_ISREG(before.st_mode)) {
        mt_fail(err, MT_ERR_IO, "%s is %s, not a regular file", path, mt__file_kind(before.st_mode));
        return -1;
    }
    /* O_NONBLOCK: should the path be swapped for a FIFO after the stat, the open still returns */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
        mt_fail(err, MT_ERR_IO, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    int flags = fcntl(fd, F_GETFL);
    if (fstat(fd, &st) != 0) st.st_mode = 0;
    if (!S_ISREG(st.st_mode) || flags < 0 || fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        mt_fail(err, MT_ERR_IO, "%s is %s, not a regular file", path, mt__file_kind(st.st_mode));
        close(fd);
        return -1;
    }
    *st_out = st;
    return fd;
}

MT_DEF int mt_open_regular_file(const char* path, mt_error* err) {
    struct stat st;
    return mt__open_regular(path, &st, err);
}

MT_DEF mt_status mt_read_file(const char* path, size_t max_bytes, char** data, size_t* size, mt_error* err) {
    *data = NULL;
    *size = 0;
    struct stat st;
    int fd = mt__open_regular(path, &st, err);
    if (fd < 0) return MT_ERR_IO;
    if ((uint64_t)st.st_size > (uint64_t)max_bytes) {
        close(fd);
        return mt_fail(err, MT_ERR_FORMAT, "%s: %lld bytes, more than the %zu such a file may hold", path,
                       (long long)st.st_size, max_bytes);
    }
    size_t cap = (size_t)st.st_size + 1, n = 0; /* the size may change while reading: read to the end */
    char* buf = (char*)malloc(cap);
    mt_status status = buf ? MT_OK : mt_fail(err, MT_ERR_OOM, "out of memory reading %s", path);
    while (status == MT_OK) {
        if (n > max_bytes) { status = mt_fail(err, MT_ERR_FORMAT, "%s: more than %zu bytes", path, max_bytes); break; }
        if (n + 1 == cap) {
            char* grown = (char*)realloc(buf, cap * 2);
            if (!grown) { status = mt_fail(err, MT_ERR_OOM, "out of memory reading %s", path); break; }
            buf = grown;
            cap *= 2;
        }
        ssize_t k = read(fd, buf + n, cap - 1 - n);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) status = mt_fail(err, MT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        if (k <= 0) break;
        n += (size_t)k;
    }
    close(fd);
    if (status != MT_OK) {
        free(buf);
        return status;
    }
    buf[n] = 0;
    *data = buf;
    *size = n;
    return MT_OK;
}

MT_DEF char* mt_temporary_path(const char* path) {
    char suffix[32];
    snprintf(suffix, sizeof(suffix), ".tmp.%ld", (long)getpid());
    return mt__concat(path, suffix);
}

/* The directory part of path ("." when it has none) in buf. */
static void mt__dirname(const char* path, char* buf, size_t cap) {
    const char* slash = strrchr(path, '/');
    if (!slash) snprintf(buf, cap, ".");
    else if (slash == path) snprintf(buf, cap, "/");
    else snprintf(buf, cap, "%.*s", (int)(slash - path), path);
}

MT_DEF int mt_sync_directory_of(const char* path) {
    char dir[4096];
    mt__dirname(path, dir, sizeof(dir));
    int fd = open(dir, O_RDONLY | O_NONBLOCK);
    if (fd < 0) return -1;
    int rc = fsync(fd);
    if (rc != 0 && (errno == EINVAL || errno == EBADF)) rc = 0; /* file systems that cannot sync a directory */
    close(fd);
    return rc;
}

MT_DEF mt_status mt_commit_file(const char* tmp, const char* path, mt_error* err) {
    if (rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        return mt_fail(err, MT_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(e));
    }
    if (mt_sync_directory_of(path) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot sync the directory of %s: %s", path, strerror(errno));
    return MT_OK;
}

MT_DEF mt_status mt_write_file(const char* path, int n, const void* const* chunks, const size_t* sizes, mt_error* err) {
    char* tmp = mt_temporary_path(path);
    if (!tmp) return mt_fail(err, MT_ERR_OOM, "out of memory writing %s", path);
    mt_remove_stale_temporaries(path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int failed = fd < 0;
    for (int i = 0; i < n && !failed; i++) failed = sizes[i] > 0 && mt__write_all(fd, chunks[i], sizes[i]) != 0;
    if (!failed && fsync(fd) != 0) failed = 1;
    int e = errno;
    if (fd >= 0 && close(fd) != 0 && !failed) { failed = 1; e = errno; }
    mt_status st = failed ? mt_fail(err, MT_ERR_IO, "cannot write %s: %s", tmp, strerror(e)) : mt_commit_file(tmp, path, err);
    if (failed) unlink(tmp);
    free(tmp);
    return st;
}

MT_DEF int mt_remove_tree(const char* path) {
    /* unlink removes a file or a symbolic link itself (never what a link points to); only a real
     * directory refuses it (EISDIR on Linux, EPERM elsewhere), and only then do we descend */
    if (unlink(path) == 0 || errno == ENOENT) return 0;
    if (errno != EISDIR && errno != EPERM) return -1;
    DIR* d = opendir(path);
    if (!d) return -1;
    int rc = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char* child = (char*)malloc(strlen(path) + strlen(e->d_name) + 2);
        if (!child) { rc = -1; break; }
        sprintf(child, "%s/%s", path, e->d_name);
        if (mt_remove_tree(child) != 0) rc = -1;
        free(child);
    }
    closedir(d);
    if (rmdir(path) != 0 && errno != ENOENT) rc = -1;
    return rc;
}

/* 1 when process pid is known to be gone: no /proc/<pid> while /proc/self exists (else 0: keep). */
static int mt__process_gone(long pid) {
    struct stat st;
    char proc[64];
    if (pid <= 0 || pid == (long)getpid() || stat("/proc/self", &st) != 0) return 0;
    snprintf(proc, sizeof(proc), "/proc/%ld", pid);
    return stat(proc, &st) != 0 && errno == ENOENT;
}

/* The pid of a directory entry named "<base>.tmp.<pid>", possibly followed by ".<more>" (a
 * temporary of a temporary, a moved-aside ".old"), with *rest at that tail; -1 for any other name. */
static long mt__temporary_pid(const char* name, const char* base, size_t nb, const char** rest) {
    if (strncmp(name, base, nb) != 0 || strncmp(name + nb, ".tmp.", 5) != 0) return -1;
    const char* digits = name + nb + 5;
    if (*digits < '0' || *digits > '9') return -1;
    char* end = NULL;
    long pid = strtol(digits, &end, 10);
    if (end == digits || (*end != 0 && *end != '.')) return -1;
    if (rest) *rest = end;
    return pid;
}

MT_DEF int mt_remove_stale_temporaries(const char* path) {
    char dir[4096];
    mt__dirname(path, dir, sizeof(dir));
    const char* slash = strrchr(path, '/');
    const char* base = slash ? slash + 1 : path;
    size_t nb = strlen(base);
    if (nb == 0) return 0;
    DIR* d = opendir(dir);
    if (!d) return 0;
    int removed = 0;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        const char* n = e->d_name;
        long pid = mt__temporary_pid(n, base, nb, NULL);
        if (pid < 0 || !mt__process_gone(pid)) continue;
        char* victim = (char*)malloc(strlen(dir) + strlen(n) + 2);
        if (!victim) break;
        sprintf(victim, "%s/%s", dir, n);
        if (mt_remove_tree(victim) == 0) removed++;
        free(victim);
    }
    closedir(d);
    return removed;
}

MT_DEF size_t mt_indexed_dtype_size(int dtype_code) {
    switch (dtype_code) {
        case MT_DTYPE_UINT8: case MT_DTYPE_INT8: return 1;
        case MT_DTYPE_INT16: case MT_DTYPE_UINT16: return 2;
        case MT_DTYPE_INT32: case MT_DTYPE_FLOAT32: return 4;
        case MT_DTYPE_INT64: case MT_DTYPE_FLOAT64: return 8;
    }
    return 0;
}

MT_DEF const char* mt_indexed_dtype_name(int dtype_code) {
    switch (dtype_code) {
        case MT_DTYPE_UINT8: return "uint8";
        case MT_DTYPE_INT8: return "int8";
        case MT_DTYPE_INT16: return "int16";
        case MT_DTYPE_INT32: return "int32";
        case MT_DTYPE_INT64: return "int64";
        case MT_DTYPE_FLOAT64: return "float64";
        case MT_DTYPE_FLOAT32: return "float32";
        case MT_DTYPE_UINT16: return "uint16";
    }
    return "unknown";
}

MT_DEF int mt_indexed_dtype_for_vocab(int64_t vocab_size) {
    return vocab_size < 65500 ? MT_DTYPE_UINT16 : MT_DTYPE_INT32;
}

static const unsigned char mt__idx_magic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
#define MT__IDX_HEADER_BYTES 34

struct mt_indexed_dataset {
    char* prefix;
    int dtype;
    size_t itemsize;
    int64_t num_sequences;  /* N */
    int64_t num_doc_entries; /* D = documents + 1 */
    int64_t num_tokens;
    unsigned char* idx_map;
    size_t idx_size;
    unsigned char* bin_map;
    size_t bin_size;
    const unsigned char* lengths;  /* int32[N] */
    const unsigned char* pointers; /* int64[N] */
    const unsigned char* docs;     /* int64[D] */
};

/* mmaps a whole regular file read-only; an empty file maps to NULL with size 0. *identity gets the
 * file's device and inode (to tell later whether the path still names it). */
static mt_status mt__map_file(const char* path, unsigned char** map, size_t* size, struct stat* identity,
                              mt_error* err) {
    *map = NULL;
    *size = 0;
    struct stat st;
    int fd = mt__open_regular(path, &st, err);
    if (fd < 0) return MT_ERR_IO;
    if (identity) *identity = st;
    if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        close(fd);
        return mt_fail(err, MT_ERR_IO, "%s: too large to map", path);
    }
    if (st.st_size > 0) {
        void* p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) {
            int e = errno;
            close(fd);
            return mt_fail(err, MT_ERR_IO, "cannot mmap %s: %s", path, strerror(e));
        }
        *map = (unsigned char*)p;
        *size = (size_t)st.st_size;
    }
    close(fd);
    return MT_OK;
}

MT_DEF void mt_indexed_dataset_close(mt_indexed_dataset* ds) {
    if (!ds) return;
    if (ds->idx_map) munmap(ds->idx_map, ds->idx_size);
    if (ds->bin_map) munmap(ds->bin_map, ds->bin_size);
    free(ds->prefix);
    free(ds);
}

static mt_status mt__validate_idx(mt_indexed_dataset* ds, const char* path, mt_error* err) {
    const unsigned char* p = ds->idx_map;
    size_t size = ds->idx_size;
    if (size < MT__IDX_HEADER_BYTES)
        return mt_fail(err, MT_ERR_FORMAT, "%s: truncated header (%zu bytes, a Megatron index needs at least %d)",
                       path, size, MT__IDX_HEADER_BYTES);
    if (memcmp(p, mt__idx_magic, 9) != 0)
        return mt_fail(err, MT_ERR_FORMAT, "%s: bad magic (not a Megatron MMIDIDX index file)", path);
    uint64_t version = mt__load_u64(p + 9);
    if (version != 1)
        return mt_fail(err, MT_ERR_FORMAT, "%s: unsupported index version %llu (expected 1)", path,
                       (unsigned long long)version);
    int code = p[17];
    ds->dtype = code;
    ds->itemsize = mt_indexed_dtype_size(code);
    if (ds->itemsize == 0) return mt_fail(err, MT_ERR_FORMAT, "%s: unknown dtype code %d", path, code);
    uint64_t n = mt__load_u64(p + 18), d = mt__load_u64(p + 26);
    /* Each sequence costs 12 bytes and each document entry 8, so anything larger than the file is wrong
     * (and this keeps the arithmetic below far from overflow). */
    if (n > size / 12 || d > size / 8 || MT__IDX_HEADER_BYTES + n * 12 + d * 8 > size)
        return mt_fail(err, MT_ERR_FORMAT,
                       "%s: truncated (%zu bytes, but the header declares %llu sequences and %llu document entries)",
                       path, size, (unsigned long long)n, (unsigned long long)d);
    uint64_t expected = MT__IDX_HEADER_BYTES + n * 12 + d * 8;
    if (size != expected && size != expected + n)
        return mt_fail(err, MT_ERR_FORMAT,
                       "%s: %zu bytes, but %llu sequences and %llu document entries need %llu (or %llu with modes)",
                       path, size, (unsigned long long)n, (unsigned long long)d, (unsigned long long)expected,
                       (unsigned long long)(expected + n));
    ds->num_sequences = (int64_t)n;
    ds->num_doc_entries = (int64_t)d;
    ds->lengths = p + MT__IDX_HEADER_BYTES;
    ds->pointers = ds->lengths + n * 4;
    ds->docs = ds->pointers + n * 8;

    if (d < 1) return mt_fail(err, MT_ERR_FORMAT, "%s: empty document index (it must start with 0)", path);
    if (mt__load_i64(ds->docs) != 0)
        return mt_fail(err, MT_ERR_FORMAT, "%s: document index starts with %lld, not 0", path,
                       (long long)mt__load_i64(ds->docs));
    int64_t prev = 0;
    for (uint64_t k = 1; k < d; k++) {
        int64_t v = mt__load_i64(ds->docs + k * 8);
        if (v < prev)
            return mt_fail(err, MT_ERR_FORMAT, "%s: document index entry %llu (%lld) is smaller than the previous (%lld)",
                           path, (unsigned long long)k, (long long)v, (long long)prev);
        prev = v;
    }
    if (prev != (int64_t)n)
        return mt_fail(err, MT_ERR_FORMAT, "%s: document index ends at %lld, but there are %llu sequences", path,
                       (long long)prev, (unsigned long long)n);

    int64_t ptr = 0, tokens = 0;
    for (uint64_t i = 0; i < n; i++) {
        int32_t len = mt__load_i32(ds->lengths + i * 4);
        int64_t got = mt__load_i64(ds->pointers + i * 8);
        if (len < 0)
            return mt_fail(err, MT_ERR_FORMAT, "%s: sequence %llu has negative length %d", path,
                           (unsigned long long)i, (int)len);
        if (got != ptr)
            return mt_fail(err, MT_ERR_FORMAT,
                           "%s: sequence %llu points to byte %lld, expected %lld (the sum of the previous lengths * %zu)",
                           path, (unsigned long long)i, (long long)got, (long long)ptr, ds->itemsize);
        if (ptr > INT64_MAX - (int64_t)len * (int64_t)ds->itemsize)
            return mt_fail(err, MT_ERR_FORMAT, "%s: the sequence lengths add up to more than 2^63 bytes", path);
        ptr += (int64_t)len * (int64_t)ds->itemsize;
        tokens += len;
    }
    ds->num_tokens = tokens;
    return MT_OK;
}

/* A dataset's old pair as a commit moves it aside (mt_indexed_writers_commit): the .idx at
 * "<prefix>.idx.tmp.<pid>.old", the .bin at "<prefix>.bin.tmp.<pid>.old" (once moved). Finds the
 * first such .idx in the directory (only_gone: of a process that is gone) and writes both names into
 * idx_old / bin_old; 0 when there is none. */
static int mt__moved_aside_pair(const char* prefix, int only_gone, char* idx_old, char* bin_old, size_t cap) {
    char dir[4096], base[1024];
    mt__dirname(prefix, dir, sizeof(dir));
    const char* slash = strrchr(prefix, '/');
    if ((size_t)snprintf(base, sizeof(base), "%s.idx", slash ? slash + 1 : prefix) >= sizeof(base)) return 0;
    DIR* d = opendir(dir);
    if (!d) return 0;
    struct dirent* e;
    int found = 0;
    while (!found && (e = readdir(d)) != NULL) {
        const char* rest = NULL;
        long pid = mt__temporary_pid(e->d_name, base, strlen(base), &rest);
        if (pid < 0 || strcmp(rest, ".old") != 0 || (only_gone && !mt__process_gone(pid))) continue;
        found = (size_t)snprintf(idx_old, cap, "%s.idx.tmp.%ld.old", prefix, pid) < cap &&
                (size_t)snprintf(bin_old, cap, "%s.bin.tmp.%ld.old", prefix, pid) < cap;
    }
    closedir(d);
    return found;
}

/* 1 when path names the file of identity id now. */
static int mt__same_file(const char* path, const struct stat* id) {
    struct stat now;
    return stat(path, &now) == 0 && now.st_dev == id->st_dev && now.st_ino == id->st_ino;
}

/* The old pair of a commit in progress, or of one a crash cut short (no .idx at its name): read from
 * where the commit moved it. The .idx from its moved-aside name; the .bin from its moved-aside name
 * if it is there (nothing else is ever renamed to it), else from <prefix>.bin, which is then the old
 * .bin only if, once mapped, the .bin was still not moved aside, the moved-aside .idx is still the one
 * read, the .bin's name still names the file mapped (a restore renames the old one back over it) and
 * no new .idx is in place: otherwise the commit moved on while we read, and the caller says so. */
static mt_status mt__open_moved_aside(mt_indexed_dataset* ds, const char* prefix, const char* idx_path,
                                      const char* bin_path, mt_error* err) {
    char idx_old[4200], bin_old[4200];
    struct stat idx_identity, bin_identity;
    if (!mt__moved_aside_pair(prefix, 0, idx_old, bin_old, sizeof(idx_old))) return MT_ERR_IO;
    mt_status st = mt__map_file(idx_old, &ds->idx_map, &ds->idx_size, &idx_identity, err);
    if (st == MT_OK) st = mt__validate_idx(ds, idx_old, err);
    if (st != MT_OK) return st;
    if (mt__map_file(bin_old, &ds->bin_map, &ds->bin_size, NULL, err) == MT_OK) return MT_OK;
    if ((st = mt__map_file(bin_path, &ds->bin_map, &ds->bin_size, &bin_identity, err)) != MT_OK) return st;
    struct stat probe;
    if (stat(bin_old, &probe) == 0 || !mt__same_file(idx_old, &idx_identity) || !mt__same_file(bin_path, &bin_identity) ||
        stat(idx_path, &probe) == 0)
        return mt_fail(err, MT_ERR_IO, "%s was replaced while it was being opened (a writer committing a new dataset): "
                       "open it again", idx_path);
    return MT_OK;
}

MT_DEF mt_status mt_indexed_dataset_open(mt_indexed_dataset** out, const char* prefix, mt_error* err) {
    *out = NULL;
    const uint16_t one = 1;
    if (*(const unsigned char*)&one != 1)
        return mt_fail(err, MT_ERR_CONFIG, "indexed datasets are little-endian; this host is big-endian");
    mt_indexed_dataset* ds = (mt_indexed_dataset*)calloc(1, sizeof(mt_indexed_dataset));
    char* idx_path = mt__concat(prefix, ".idx");
    char* bin_path = mt__concat(prefix, ".bin");
    mt_status st = MT_OK;
    if (!ds || !idx_path || !bin_path || !(ds->prefix = mt__strdup(prefix))) {
        st = mt_fail(err, MT_ERR_OOM, "out of memory opening %s", prefix);
        goto done;
    }
    struct stat idx_identity, now;
    if ((st = mt__map_file(idx_path, &ds->idx_map, &ds->idx_size, &idx_identity, err)) != MT_OK) {
        if (stat(idx_path, &now) != 0 && errno == ENOENT) { /* no .idx: a commit under way, or cut short */
            mt_error aside;
            mt_status moved = mt__open_moved_aside(ds, prefix, idx_path, bin_path, &aside);
            if (moved == MT_OK || ds->idx_map) { /* there was a moved-aside pair: it, or why it failed */
                st = moved;
                if (err && moved != MT_OK) *err = aside;
            }
        }
        if (st != MT_OK) goto done;
    } else {
        if ((st = mt__validate_idx(ds, idx_path, err)) != MT_OK) goto done;
        if ((st = mt__map_file(bin_path, &ds->bin_map, &ds->bin_size, NULL, err)) != MT_OK) goto done;
        /* A writer commits a pair by removing the old .idx before it touches the .bin: if the .idx path
         * still names the file we mapped (held open by the mapping, so its inode cannot be reused), no
         * commit began before the .bin was mapped, and the two belong together. */
        if (!mt__same_file(idx_path, &idx_identity)) {
            st = mt_fail(err, MT_ERR_IO, "%s was replaced while it was being opened (a writer committing a new "
                         "dataset): open it again", idx_path);
            goto done;
        }
    }
    if ((uint64_t)ds->bin_size != (uint64_t)ds->num_tokens * ds->itemsize) {
        st = mt_fail(err, MT_ERR_FORMAT, "%s: %zu bytes, but the index describes %lld tokens of %s (%llu bytes)",
                     bin_path, ds->bin_size, (long long)ds->num_tokens, mt_indexed_dtype_name(ds->dtype),
                     (unsigned long long)((uint64_t)ds->num_tokens * ds->itemsize));
        goto done;
    }
done:
    free(idx_path);
    free(bin_path);
    if (st != MT_OK) mt_indexed_dataset_close(ds);
    else *out = ds;
    return st;
}

MT_DEF const char* mt_indexed_dataset_prefix(const mt_indexed_dataset* ds) { return ds->prefix; }
MT_DEF int mt_indexed_dataset_dtype(const mt_indexed_dataset* ds) { return ds->dtype; }
MT_DEF int64_t mt_indexed_dataset_num_sequences(const mt_indexed_dataset* ds) { return ds->num_sequences; }
MT_DEF int64_t mt_indexed_dataset_num_documents(const mt_indexed_dataset* ds) { return ds->num_doc_entries - 1; }
MT_DEF int64_t mt_indexed_dataset_num_tokens(const mt_indexed_dataset* ds) { return ds->num_tokens; }

MT_DEF int64_t mt_indexed_dataset_sequence_length(const mt_indexed_dataset* ds, int64_t i) {
    if (i < 0 || i >= ds->num_sequences) return -1;
    return mt__load_i32(ds->lengths + i * 4);
}

MT_DEF int64_t mt_indexed_dataset_document_start(const mt_indexed_dataset* ds, int64_t k) {
    if (k < 0 || k >= ds->num_doc_entries) return -1;
    return mt__load_i64(ds->docs + k * 8);
}

MT_DEF mt_status mt_indexed_dataset_read(const mt_indexed_dataset* ds, int64_t seq, int64_t offset, int64_t count,
                                         int32_t* out, mt_error* err) {
    if (seq < 0 || seq >= ds->num_sequences)
        return mt_fail(err, MT_ERR_RANGE, "%s: sequence %lld out of range [0, %lld)", ds->prefix, (long long)seq,
                       (long long)ds->num_sequences);
    int64_t len = mt__load_i32(ds->lengths + seq * 4);
    if (offset < 0 || count < 0 || offset > len || count > len - offset)
        return mt_fail(err, MT_ERR_RANGE, "%s: tokens [%lld, %lld) out of range of sequence %lld (%lld tokens)",
                       ds->prefix, (long long)offset, (long long)(offset + count), (long long)seq, (long long)len);
    if (count == 0) return MT_OK;
    const unsigned char* p = ds->bin_map + mt__load_i64(ds->pointers + seq * 8) + offset * (int64_t)ds->itemsize;
    int64_t i;
    switch (ds->dtype) {
        case MT_DTYPE_UINT8: for (i = 0; i < count; i++) out[i] = p[i]; break;
        case MT_DTYPE_INT8: for (i = 0; i < count; i++) out[i] = (int8_t)p[i]; break;
        case MT_DTYPE_INT16:
            for (i = 0; i < count; i++) { int16_t v; memcpy(&v, p + 2 * i, 2); out[i] = v; }
            break;
        case MT_DTYPE_UINT16:
            for (i = 0; i < count; i++) { uint16_t v; memcpy(&v, p + 2 * i, 2); out[i] = v; }
            break;
        case MT_DTYPE_INT32:
            if (count > 0) memcpy(out, p, (size_t)count * 4);
            break;
        case MT_DTYPE_INT64:
            for (i = 0; i < count; i++) {
                int64_t v = mt__load_i64(p + 8 * i);
                if (v < INT32_MIN || v > INT32_MAX)
                    return mt_fail(err, MT_ERR_RANGE, "%s: token %lld of sequence %lld (%lld) does not fit int32",
                                   ds->prefix, (long long)(offset + i), (long long)seq, (long long)v);
                out[i] = (int32_t)v;
            }
            break;
        default:
            return mt_fail(err, MT_ERR_FORMAT, "%s: tokens of dtype %s cannot be read as token ids", ds->prefix,
                           mt_indexed_dtype_name(ds->dtype));
    }
    return MT_OK;
}

/* The writer keeps the lengths and document indices in memory (12 bytes per sequence, 8 per
 * document, as Megatron's builder does) and streams tokens through a buffer that starts at 64 KiB and
 * grows to 16 MiB as the tokens come (a small dataset does not map 16 MiB per writer: with ASan that
 * mapping was most of a small preprocess run's time). */
#define MT__WRITER_BUFFER_START ((size_t)64 << 10)
#define MT__WRITER_BUFFER_BYTES ((size_t)16 << 20)

struct mt_indexed_writer {
    char* prefix;
    char *bin, *idx;         /* the final names */
    char *bin_tmp, *idx_tmp; /* what is written: <final>.tmp.<pid> */
    char *bin_old, *idx_old; /* where a commit moves the old dataset aside: <final>.tmp.<pid>.old */
    int prepared;            /* both temporaries complete and on disk */
    int moved;               /* the commit's steps done (bits: old .idx, old .bin aside; new .bin, .idx in) */
    int fd;
    int dtype;
    size_t itemsize;
    unsigned char* buf;
    size_t buf_used, buf_cap;
    int32_t* lengths;
    int64_t num_sequences, lengths_cap;
    int64_t* docs;
    int64_t num_docs, docs_cap; /* entries, starting with the 0 */
    int64_t bin_bytes;
};

static void mt__writer_free(mt_indexed_writer* w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    free(w->prefix);
    free(w->bin);
    free(w->idx);
    free(w->bin_tmp);
    free(w->idx_tmp);
    free(w->bin_old);
    free(w->idx_old);
    free(w->buf);
    free(w->lengths);
    free(w->docs);
    free(w);
}

/* A commit that a crash cut short (its process is gone) left the old pair moved aside and no new
 * .idx in place: the old pair goes back to its names, the .bin first, before anything else may
 * remove it as a stale temporary, so the old dataset stays until a new complete pair replaces it.
 * (With a new .idx in place the commit was complete, and what was moved aside is stale.) */
static mt_status mt__restore_moved_aside(const char* prefix, const char* idx, const char* bin, mt_error* err) {
    char idx_old[4200], bin_old[4200];
    struct stat st;
    if (stat(idx, &st) == 0 || errno != ENOENT || !mt__moved_aside_pair(prefix, 1, idx_old, bin_old, sizeof(idx_old)))
        return MT_OK;
    if (rename(bin_old, bin) != 0 && errno != ENOENT) /* not there: the .bin was never moved aside */
        return mt_fail(err, MT_ERR_IO, "cannot restore %s (moved aside by a commit that did not finish) to %s: %s", bin_old,
                       bin, strerror(errno));
    if (rename(idx_old, idx) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot restore %s (moved aside by a commit that did not finish) to %s: %s", idx_old,
                       idx, strerror(errno));
    if (mt_sync_directory_of(idx) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot sync the directory of %s: %s", idx, strerror(errno));
    return MT_OK;
}

MT_DEF mt_status mt_indexed_writer_open(mt_indexed_writer** out, const char* prefix, int dtype_code, mt_error* err) {
    *out = NULL;
    if (dtype_code == MT_DTYPE_FLOAT32 || dtype_code == MT_DTYPE_FLOAT64 || mt_indexed_dtype_size(dtype_code) == 0)
        return mt_fail(err, MT_ERR_ARG, "cannot write %s: token dtype code %d is not an integer dtype", prefix,
                       dtype_code);
    mt_indexed_writer* w = (mt_indexed_writer*)calloc(1, sizeof(mt_indexed_writer));
    if (!w) return mt_fail(err, MT_ERR_OOM, "out of memory opening a writer for %s", prefix);
    w->fd = -1;
    w->dtype = dtype_code;
    w->itemsize = mt_indexed_dtype_size(dtype_code);
    w->prefix = mt__strdup(prefix);
    w->bin = mt__concat(prefix, ".bin");
    w->idx = mt__concat(prefix, ".idx");
    w->bin_tmp = w->bin ? mt_temporary_path(w->bin) : NULL;
    w->idx_tmp = w->idx ? mt_temporary_path(w->idx) : NULL;
    w->bin_old = w->bin_tmp ? mt__concat(w->bin_tmp, ".old") : NULL;
    w->idx_old = w->idx_tmp ? mt__concat(w->idx_tmp, ".old") : NULL;
    w->buf_cap = MT__WRITER_BUFFER_START;
    w->buf = (unsigned char*)malloc(w->buf_cap);
    w->docs_cap = w->lengths_cap = 1024;
    w->docs = (int64_t*)malloc((size_t)w->docs_cap * sizeof(int64_t));
    w->lengths = (int32_t*)malloc((size_t)w->lengths_cap * sizeof(int32_t));
    if (!w->prefix || !w->bin || !w->idx || !w->bin_tmp || !w->idx_tmp || !w->bin_old || !w->idx_old || !w->buf ||
        !w->docs || !w->lengths) {
        mt__writer_free(w);
        return mt_fail(err, MT_ERR_OOM, "out of memory opening a writer for %s", prefix);
    }
    w->docs[0] = 0;
    w->num_docs = 1;
    mt_status restored = mt__restore_moved_aside(prefix, w->idx, w->bin, err);
    if (restored != MT_OK) {
        mt__writer_free(w);
        return restored;
    }
    mt_remove_stale_temporaries(w->bin); /* what a killed run of any tool left for this prefix */
    mt_remove_stale_temporaries(w->idx);
    w->fd = open(w->bin_tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (w->fd < 0) {
        mt_status st = mt_fail(err, MT_ERR_IO, "cannot create %s: %s", w->bin_tmp, strerror(errno));
        mt__writer_free(w);
        return st;
    }
    *out = w;
    return MT_OK;
}

static mt_status mt__writer_flush(mt_indexed_writer* w, mt_error* err) {
    if (w->buf_used == 0) return MT_OK;
    if (mt__write_all(w->fd, w->buf, w->buf_used) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", w->bin_tmp, strerror(errno));
    w->buf_used = 0;
    return MT_OK;
}

static mt_status mt__writer_bytes(mt_indexed_writer* w, const void* data, size_t n, mt_error* err) {
    const unsigned char* p = (const unsigned char*)data;
    while (n > 0) {
        if (w->buf_used == w->buf_cap && w->buf_cap < MT__WRITER_BUFFER_BYTES) { /* grow (if memory allows) */
            unsigned char* bigger = (unsigned char*)realloc(w->buf, 4 * w->buf_cap);
            if (bigger) {
                w->buf = bigger;
                w->buf_cap *= 4;
            }
        }
        if (w->buf_used == w->buf_cap) {
            mt_status st = mt__writer_flush(w, err);
            if (st != MT_OK) return st;
        }
        size_t k = w->buf_cap - w->buf_used;
        if (k > n) k = n;
        memcpy(w->buf + w->buf_used, p, k);
        w->buf_used += k;
        p += k;
        n -= k;
    }
    w->bin_bytes += (int64_t)(p - (const unsigned char*)data);
    return MT_OK;
}

/* Grows a malloc'd (non-NULL) array to hold need elements; NULL (array untouched) when out of memory. */
static void* mt__grow(void* arr, int64_t* cap, int64_t need, size_t elem) {
    if (need <= *cap) return arr;
    int64_t c = *cap ? *cap : 1024;
    while (c < need) c *= 2;
    void* p = realloc(arr, (size_t)c * elem);
    if (p) *cap = c;
    return p;
}

static int mt__token_fits(int dtype, int32_t v) {
    switch (dtype) {
        case MT_DTYPE_UINT8: return v >= 0 && v <= 255;
        case MT_DTYPE_INT8: return v >= -128 && v <= 127;
        case MT_DTYPE_INT16: return v >= -32768 && v <= 32767;
        case MT_DTYPE_UINT16: return v >= 0 && v <= 65535;
    }
    return 1; /* int32, int64 */
}

MT_DEF mt_status mt_indexed_writer_add_document(mt_indexed_writer* w, const int32_t* tokens,
                                                const int64_t* sequence_lengths, int64_t num_sequences, mt_error* err) {
    if (w->prepared) return mt_fail(err, MT_ERR_ARG, "%s: the writer was already prepared", w->prefix);
    if (num_sequences < 0) return mt_fail(err, MT_ERR_ARG, "%s: negative sequence count %lld", w->prefix,
                                          (long long)num_sequences);
    int64_t total = 0;
    for (int64_t i = 0; i < num_sequences; i++) {
        if (sequence_lengths[i] < 0 || sequence_lengths[i] > INT32_MAX)
            return mt_fail(err, MT_ERR_ARG, "%s: sequence length %lld out of range [0, 2^31)", w->prefix,
                           (long long)sequence_lengths[i]);
        total += sequence_lengths[i];
    }
    for (int64_t i = 0; i < total; i++)
        if (!mt__token_fits(w->dtype, tokens[i]))
            return mt_fail(err, MT_ERR_RANGE, "%s: token id %d does not fit the dataset dtype %s", w->prefix,
                           (int)tokens[i], mt_indexed_dtype_name(w->dtype));
    void* p = mt__grow(w->lengths, &w->lengths_cap, w->num_sequences + num_sequences, sizeof(int32_t));
    if (p) w->lengths = (int32_t*)p;
    void* q = p ? mt__grow(w->docs, &w->docs_cap, w->num_docs + 1, sizeof(int64_t)) : NULL;
    if (q) w->docs = (int64_t*)q;
    if (!p || !q) return mt_fail(err, MT_ERR_OOM, "%s: out of memory growing the index", w->prefix);
    /* Convert in chunks to the dtype (little-endian host: the low bytes of each int32 / int64). */
    unsigned char tmp[4096];
    size_t per = sizeof(tmp) / w->itemsize;
    for (int64_t i = 0; i < total;) {
        size_t k = (size_t)(total - i) < per ? (size_t)(total - i) : per;
        for (size_t j = 0; j < k; j++) {
            int32_t v = tokens[i + (int64_t)j];
            if (w->itemsize == 8) { int64_t v8 = v; memcpy(tmp + 8 * j, &v8, 8); }
            else if (w->itemsize == 4) memcpy(tmp + 4 * j, &v, 4);
            else if (w->itemsize == 2) { uint16_t v2 = (uint16_t)v; memcpy(tmp + 2 * j, &v2, 2); }
            else tmp[j] = (unsigned char)v;
        }
        mt_status st = mt__writer_bytes(w, tmp, k * w->itemsize, err);
        if (st != MT_OK) return st;
        i += (int64_t)k;
    }
    for (int64_t i = 0; i < num_sequences; i++) w->lengths[w->num_sequences++] = (int32_t)sequence_lengths[i];
    w->docs[w->num_docs++] = w->num_sequences;
    return MT_OK;
}

MT_DEF mt_status mt_indexed_writer_add_index(mt_indexed_writer* w, const char* other_prefix, mt_error* err) {
    if (w->prepared) return mt_fail(err, MT_ERR_ARG, "%s: the writer was already prepared", w->prefix);
    mt_indexed_dataset* ds = NULL;
    mt_status st = mt_indexed_dataset_open(&ds, other_prefix, err);
    if (st != MT_OK) return st;
    if (ds->dtype != w->dtype) {
        st = mt_fail(err, MT_ERR_FORMAT, "cannot merge %s (dtype %s) into %s (dtype %s): the dtypes differ",
                     other_prefix, mt_indexed_dtype_name(ds->dtype), w->prefix, mt_indexed_dtype_name(w->dtype));
        mt_indexed_dataset_close(ds);
        return st;
    }
    int64_t n = ds->num_sequences, d = ds->num_doc_entries;
    void* p = mt__grow(w->lengths, &w->lengths_cap, w->num_sequences + n, sizeof(int32_t));
    if (p) w->lengths = (int32_t*)p;
    void* q = p ? mt__grow(w->docs, &w->docs_cap, w->num_docs + d - 1, sizeof(int64_t)) : NULL;
    if (q) w->docs = (int64_t*)q;
    if (!p || !q) {
        mt_indexed_dataset_close(ds);
        return mt_fail(err, MT_ERR_OOM, "%s: out of memory growing the index", w->prefix);
    }
    st = mt__writer_bytes(w, ds->bin_map, ds->bin_size, err);
    if (st == MT_OK) {
        int64_t offset = w->num_sequences;
        if (n > 0) memcpy(w->lengths + w->num_sequences, ds->lengths, (size_t)n * 4);
        w->num_sequences += n;
        for (int64_t k = 1; k < d; k++) w->docs[w->num_docs++] = offset + mt__load_i64(ds->docs + k * 8);
    }
    mt_indexed_dataset_close(ds);
    return st;
}

MT_DEF int64_t mt_indexed_writer_num_sequences(const mt_indexed_writer* w) { return w->num_sequences; }
MT_DEF int64_t mt_indexed_writer_num_documents(const mt_indexed_writer* w) { return w->num_docs - 1; }

MT_DEF void mt_indexed_writer_abort(mt_indexed_writer* w) {
    if (!w) return;
    if (w->fd >= 0) { close(w->fd); w->fd = -1; }
    unlink(w->bin_tmp);
    unlink(w->idx_tmp);
    mt__writer_free(w);
}

static mt_status mt__write_idx(mt_indexed_writer* w, mt_error* err) {
    int fd = open(w->idx_tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return mt_fail(err, MT_ERR_IO, "cannot create %s: %s", w->idx_tmp, strerror(errno));
    /* Reuse the token buffer: header, lengths, pointers (prefix sums), document indices. */
    unsigned char* b = w->buf;
    size_t used = 0, cap = w->buf_cap;
    int failed = 0;
#define MT__IDX_PUT(src, n)                                                                          \
    do {                                                                                             \
        if (used + (n) > cap) { failed |= mt__write_all(fd, b, used); used = 0; }                    \
        memcpy(b + used, (src), (n));                                                                \
        used += (n);                                                                                 \
    } while (0)
    uint64_t version = 1, n = (uint64_t)w->num_sequences, d = (uint64_t)w->num_docs;
    unsigned char code = (unsigned char)w->dtype;
    MT__IDX_PUT(mt__idx_magic, 9);
    MT__IDX_PUT(&version, 8);
    MT__IDX_PUT(&code, 1);
    MT__IDX_PUT(&n, 8);
    MT__IDX_PUT(&d, 8);
    for (int64_t i = 0; i < w->num_sequences; i++) MT__IDX_PUT(&w->lengths[i], 4);
    int64_t ptr = 0;
    for (int64_t i = 0; i < w->num_sequences; i++) {
        MT__IDX_PUT(&ptr, 8);
        ptr += (int64_t)w->lengths[i] * (int64_t)w->itemsize;
    }
    for (int64_t i = 0; i < w->num_docs; i++) MT__IDX_PUT(&w->docs[i], 8);
#undef MT__IDX_PUT
    failed |= mt__write_all(fd, b, used);
    int e = errno;
    if (!failed && fsync(fd) != 0) { failed = 1; e = errno; }
    if (close(fd) != 0 && !failed) { failed = 1; e = errno; }
    if (failed) return mt_fail(err, MT_ERR_IO, "cannot write %s: %s", w->idx_tmp, strerror(e));
    return MT_OK;
}

MT_DEF mt_status mt_indexed_writer_prepare(mt_indexed_writer* w, mt_error* err) {
    if (w->prepared) return MT_OK;
    mt_status st = mt__writer_flush(w, err);
    if (st == MT_OK) {
        int rc = fsync(w->fd), e = errno;
        if (close(w->fd) != 0 && rc == 0) { rc = -1; e = errno; }
        w->fd = -1;
        if (rc != 0) st = mt_fail(err, MT_ERR_IO, "cannot write %s: %s", w->bin_tmp, strerror(e));
    }
    if (st == MT_OK) st = mt__write_idx(w, err);
    w->prepared = st == MT_OK;
    return st;
}

/* The file operations of a commit, in order: every old .idx, then every old .bin moved aside (to
 * <name>.tmp.<pid>.old), every new .bin, then every new .idx renamed into place; at most max_ops of
 * them (the tests stop there to stand for a crash). Each writer records what it moved. */
static mt_status mt__writers_commit_ops(mt_indexed_writer** ws, int n, int max_ops, mt_error* err) {
    int ops = 0;
    for (int k = 0; k < n; k++)
        if (!ws[k]->prepared) return mt_fail(err, MT_ERR_ARG, "%s: committed before it was prepared", ws[k]->prefix);
    for (int phase = 0; phase < 4; phase++)
        for (int k = 0; k < n && ops < max_ops; k++, ops++) {
            mt_indexed_writer* w = ws[k];
            const char* from = phase == 0 ? w->idx : phase == 1 ? w->bin : phase == 2 ? w->bin_tmp : w->idx_tmp;
            const char* to = phase == 0 ? w->idx_old : phase == 1 ? w->bin_old : phase == 2 ? w->bin : w->idx;
            if (rename(from, to) == 0) w->moved |= 1 << phase;
            else if (phase >= 2 || errno != ENOENT) /* no old dataset: nothing to move aside */
                return mt_fail(err, MT_ERR_IO, "cannot rename %s to %s: %s", from, to, strerror(errno));
        }
    return MT_OK;
}

MT_DEF mt_status mt_indexed_writers_commit(mt_indexed_writer** ws, int n, mt_error* err) {
    mt_status st = mt__writers_commit_ops(ws, n, INT_MAX, err);
    for (int k = 0; k < n && st == MT_OK; k++)
        if (mt_sync_directory_of(ws[k]->idx) != 0)
            st = mt_fail(err, MT_ERR_IO, "cannot sync the directory of %s: %s", ws[k]->idx, strerror(errno));
    for (int k = n - 1; k >= 0; k--) {
        mt_indexed_writer* w = ws[k];
        if (st != MT_OK) { /* a set is all or nothing: what moved goes back, the old datasets are as they were */
            if (w->moved & 8) unlink(w->idx);
            if (w->moved & 4) unlink(w->bin);
            if (w->moved & 2) rename(w->bin_old, w->bin);
            if (w->moved & 1) rename(w->idx_old, w->idx);
            mt_indexed_writer_abort(w);
        } else {
            unlink(w->idx_old); /* the old dataset, now replaced */
            unlink(w->bin_old);
            mt__writer_free(w);
        }
        ws[k] = NULL;
    }
    return st;
}

MT_DEF mt_status mt_indexed_writer_finalize(mt_indexed_writer* w, mt_error* err) {
    mt_status st = mt_indexed_writer_prepare(w, err);
    if (st != MT_OK) {
        mt_indexed_writer_abort(w);
        return st;
    }
    return mt_indexed_writers_commit(&w, 1, err);
}

/* 3. GPT datasets: --split, document/sample/shuffle index, blending, bit-exact with Megatron --- */

MT_DEF const char* mt_split_name(int split) {
    switch (split) {
        case MT_SPLIT_TRAIN: return "train";
        case MT_SPLIT_VALID: return "valid";
        case MT_SPLIT_TEST: return "test";
    }
    return "unknown";
}

/* numpy's pairwise summation (umath loops, PW_BLOCKSIZE 128) for float64; np.sum(x) is
 * 0.0 + pairwise(x). Only the order of additions matters for bit-exactness. */
static double mt__pairwise_sum(const double* a, int64_t n) {
    if (n < 8) {
        double res = 0.;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    } else if (n <= 128) {
        double r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return mt__pairwise_sum(a, n2) + mt__pairwise_sum(a + n2, n - n2);
}

MT_DEF double mt_numpy_sum(const double* x, int64_t n) { return 0.0 + mt__pairwise_sum(x, n); }

MT_DEF void mt_normalize_weights(const double* w, int n, double* out) {
    double s = mt_numpy_sum(w, n);
    for (int i = 0; i < n; i++) out[i] = w[i] / s;
}

MT_DEF mt_status mt_split_parse(const char* split, mt_split_matrix* out, mt_error* err) {
    /* re.findall(r"[.0-9]+", split), each run parsed by Python's float(): the whole run must parse. */
    double v[3] = {0, 0, 0};
    int count = 0;
    const char* p = split;
    memset(out, 0, sizeof(*out));
    while (*p) {
        if (!((*p >= '0' && *p <= '9') || *p == '.')) { p++; continue; }
        const char* q = p;
        while ((*q >= '0' && *q <= '9') || *q == '.') q++;
        char run[64];
        size_t len = (size_t)(q - p);
        if (len >= sizeof(run)) return mt_fail(err, MT_ERR_ARG, "--split \"%s\": number too long", split);
        memcpy(run, p, len);
        run[len] = 0;
        char* end = NULL;
        double x = strtod(run, &end);
        if (end != run + len) return mt_fail(err, MT_ERR_ARG, "--split \"%s\": \"%s\" is not a number", split, run);
        if (count == 3)
            return mt_fail(err, MT_ERR_ARG, "--split \"%s\": more than 3 numbers (train, valid, test)", split);
        v[count++] = x;
        p = q;
    }
    double s = mt_numpy_sum(v, 3);
    if (!(s > 0)) return mt_fail(err, MT_ERR_ARG, "--split \"%s\": the weights sum to zero", split);
    double w[3], bookend[4];
    for (int i = 0; i < 3; i++) w[i] = v[i] / s;
    /* functools.reduce cumulative sum: [0, w0, w0+w1, w0+w1+w2] */
    bookend[0] = 0;
    for (int i = 0; i < 3; i++) bookend[i + 1] = bookend[i] + w[i];
    for (int i = 0; i < 3; i++) {
        out->begin[i] = bookend[i];
        out->end[i] = bookend[i + 1];
        out->present[i] = !(bookend[i + 1] <= bookend[i]);
    }
    return MT_OK;
}

MT_DEF void mt_split_range(const mt_split_matrix* m, int split, int64_t n, int64_t* begin, int64_t* end) {
    *begin = *end = 0;
    if (split < 0 || split > 2 || !m->present[split]) return;
    /* int(round(x)): Python rounds half to even, as nearbyint does in the default rounding mode. */
    *begin = (int64_t)nearbyint(m->begin[split] * (double)n);
    *end = (int64_t)nearbyint(m->end[split] * (double)n);
}

MT_DEF mt_status mt_gpt_num_samples(int64_t train_iters, int64_t eval_interval, int64_t eval_iters,
                                    int64_t global_batch_size, int64_t out[3], mt_error* err) {
    if (train_iters < 0 || eval_iters < 0 || global_batch_size < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--train-iters %lld, --eval-iters %lld and --global-batch-size %lld must be "
                       ">= 0", (long long)train_iters, (long long)eval_iters, (long long)global_batch_size);
    int64_t evals = (eval_interval > 0 ? train_iters / eval_interval : 0) + 1, valid;
    if (mt_mul_overflows_i64(train_iters, global_batch_size, &out[0]))
        return mt_fail(err, MT_ERR_CONFIG, "--train-iters %lld x --global-batch-size %lld samples overflows",
                       (long long)train_iters, (long long)global_batch_size);
    if (mt_mul_overflows_i64(evals, eval_iters, &valid) || mt_mul_overflows_i64(valid, global_batch_size, &out[1]))
        return mt_fail(err, MT_ERR_CONFIG, "--eval-iters %lld: the validation samples (%lld evaluations x --eval-iters "
                       "x --global-batch-size %lld) overflow", (long long)eval_iters, (long long)evals,
                       (long long)global_batch_size);
    out[2] = eval_iters * global_batch_size; /* <= out[1] */
    return MT_OK;
}

/* MT19937 as numpy's legacy RandomState: mt19937_seed, mt19937_gen, tempering. */
#define MT__MT_N 624
#define MT__MT_M 397

MT_DEF void mt_mt19937_seed(mt_mt19937* rng, uint32_t seed) {
    uint32_t s = seed;
    for (int i = 0; i < MT__MT_N; i++) {
        rng->key[i] = s;
        s = 1812433253u * (s ^ (s >> 30)) + (uint32_t)(i + 1);
    }
    rng->pos = MT__MT_N;
}

static void mt__mt19937_gen(mt_mt19937* rng) {
    uint32_t* k = rng->key;
    int i;
    uint32_t y;
    for (i = 0; i < MT__MT_N - MT__MT_M; i++) {
        y = (k[i] & 0x80000000u) | (k[i + 1] & 0x7fffffffu);
        k[i] = k[i + MT__MT_M] ^ (y >> 1) ^ ((0u - (y & 1u)) & 0x9908b0dfu);
    }
    for (; i < MT__MT_N - 1; i++) {
        y = (k[i] & 0x80000000u) | (k[i + 1] & 0x7fffffffu);
        k[i] = k[i + (MT__MT_M - MT__MT_N)] ^ (y >> 1) ^ ((0u - (y & 1u)) & 0x9908b0dfu);
    }
    y = (k[MT__MT_N - 1] & 0x80000000u) | (k[0] & 0x7fffffffu);
    k[MT__MT_N - 1] = k[MT__MT_M - 1] ^ (y >> 1) ^ ((0u - (y & 1u)) & 0x9908b0dfu);
    rng->pos = 0;
}

MT_DEF uint32_t mt_mt19937_next32(mt_mt19937* rng) {
    if (rng->pos == MT__MT_N) mt__mt19937_gen(rng);
    uint32_t y = rng->key[rng->pos++];
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= (y >> 18);
    return y;
}

MT_DEF uint64_t mt_mt19937_next64(mt_mt19937* rng) {
    uint64_t hi = mt_mt19937_next32(rng);
    return (hi << 32) | mt_mt19937_next32(rng);
}

MT_DEF uint64_t mt_mt19937_interval(mt_mt19937* rng, uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max, v;
    mask |= mask >> 1;
    mask |= mask >> 2;
    mask |= mask >> 4;
    mask |= mask >> 8;
    mask |= mask >> 16;
    mask |= mask >> 32;
    if (max <= 0xffffffffull) {
        while ((v = (mt_mt19937_next32(rng) & mask)) > max) {}
    } else {
        while ((v = (mt_mt19937_next64(rng) & mask)) > max) {}
    }
    return v;
}

#define MT__SHUFFLE_LOOP(T)                                                                \
    do {                                                                                   \
        T* x = (T*)data;                                                                   \
        for (int64_t i = n - 1; i >= 1; i--) {                                             \
            int64_t j = (int64_t)mt_mt19937_interval(rng, (uint64_t)i);                    \
            T t = x[i];                                                                    \
            x[i] = x[j];                                                                   \
            x[j] = t;                                                                      \
        }                                                                                  \
    } while (0)

MT_DEF void mt_shuffle(mt_mt19937* rng, void* data, int64_t n, size_t itemsize) {
    switch (itemsize) {
        case 1: MT__SHUFFLE_LOOP(uint8_t); break;
        case 2: MT__SHUFFLE_LOOP(uint16_t); break;
        case 4: MT__SHUFFLE_LOOP(uint32_t); break;
        case 8: MT__SHUFFLE_LOOP(uint64_t); break;
    }
}
#undef MT__SHUFFLE_LOOP

struct mt_gpt_dataset {
    const mt_indexed_dataset* ds;
    int seq_length;
    int64_t begin, end;
    int64_t tokens_per_epoch;
    int64_t num_samples_requested;
    int64_t num_epochs;
    int separate_final_epoch;
    int64_t num_samples_sans_final_epoch;
    int64_t num_samples;
    int64_t document_index_length;
    int32_t* document_index;
    int sample_itemsize;
    void* sample_index;
    int shuffle_itemsize;
    void* shuffle_index;
};

MT_DEF void mt_gpt_dataset_free(mt_gpt_dataset* g) {
    if (!g) return;
    free(g->document_index);
    free(g->sample_index);
    free(g->shuffle_index);
    free(g);
}

static inline int64_t mt__get_index(const void* base, int itemsize, int64_t i) {
    if (itemsize == 4) return ((const int32_t*)base)[i];
    return ((const int64_t*)base)[i];
}

static inline int64_t mt__get_shuffle(const void* base, int itemsize, int64_t i) {
    if (itemsize == 4) return ((const uint32_t*)base)[i];
    return ((const int64_t*)base)[i];
}

/* _build_document_index: the split's sequence ids tiled `epochs` times, epoch-major, shuffled whole. */
static void mt__tile_and_shuffle(int32_t* out, int64_t begin, int64_t end, int64_t epochs, mt_mt19937* rng) {
    int64_t m = end - begin, k = 0;
    for (int64_t e = 0; e < epochs; e++)
        for (int64_t s = begin; s < end; s++) out[k++] = (int32_t)s;
    mt_shuffle(rng, out, epochs * m, sizeof(int32_t));
}

/* Tokens in sequences [begin, end) (in range). */
static int64_t mt__range_tokens(const mt_indexed_dataset* ds, int64_t begin, int64_t end) {
    int64_t T = 0;
    for (int64_t s = begin; s < end; s++) T += mt__load_i32(ds->lengths + s * 4);
    return T;
}

MT_DEF mt_status mt_gpt_dataset_build(mt_gpt_dataset** out, const mt_indexed_dataset* ds, int64_t begin, int64_t end,
                                      int seq_length, uint32_t seed, int64_t num_samples, mt_error* err) {
    *out = NULL;
    const char* name = ds->prefix;
    if (ds->dtype == MT_DTYPE_FLOAT32 || ds->dtype == MT_DTYPE_FLOAT64) /* refused here, not at the first sample */
        return mt_fail(err, MT_ERR_FORMAT, "%s: tokens of dtype %s: a GPT dataset needs integer token ids", name,
                       mt_indexed_dtype_name(ds->dtype));
    if (seq_length < 2 || seq_length > (1 << 30))
        return mt_fail(err, MT_ERR_ARG, "sequence length %d out of range [2, 2^30]", seq_length);
    if (begin < 0 || end > ds->num_sequences || begin > end)
        return mt_fail(err, MT_ERR_RANGE, "%s: sequence range [%lld, %lld) out of range [0, %lld]", name,
                       (long long)begin, (long long)end, (long long)ds->num_sequences);
    if (ds->num_sequences > INT32_MAX)
        return mt_fail(err, MT_ERR_FORMAT, "%s: %lld sequences; Megatron's int32 document index holds at most 2^31-1",
                       name, (long long)ds->num_sequences);
    const int64_t S = seq_length;
    int64_t T = mt__range_tokens(ds, begin, end);
    if (T < 2)
        return mt_fail(err, MT_ERR_CONFIG,
                       "%s: sequences [%lld, %lld) hold %lld tokens; a GPT dataset split needs at least 2 (check --split)",
                       name, (long long)begin, (long long)end, (long long)T);

    mt_gpt_dataset* g = (mt_gpt_dataset*)calloc(1, sizeof(mt_gpt_dataset));
    if (!g) return mt_fail(err, MT_ERR_OOM, "out of memory building the %s sample index", name);
    g->ds = ds;
    g->seq_length = seq_length;
    g->begin = begin;
    g->end = end;
    g->tokens_per_epoch = T;
    g->num_samples_requested = num_samples < 0 ? -1 : num_samples;

    /* _get_num_epochs: the smallest E with E*T >= num_samples*S + 1 (add_extra_token). */
    int64_t E = 1;
    if (num_samples > 0) {
        if (num_samples > (INT64_MAX - 1) / S) {
            mt_gpt_dataset_free(g);
            return mt_fail(err, MT_ERR_ARG, "%lld samples of %d tokens overflow", (long long)num_samples, seq_length);
        }
        int64_t need = num_samples * S + 1;
        E = need / T + (need % T != 0);
        if (E < 1) E = 1;
    }
    if (E > INT32_MAX || E > INT64_MAX / T) {
        mt_gpt_dataset_free(g);
        return mt_fail(err, MT_ERR_CONFIG, "%s: %lld samples need %lld epochs of %lld tokens; too many", name,
                       (long long)num_samples, (long long)E, (long long)T);
    }
    g->num_epochs = E;
    int64_t sans = 0;
    if (E > 1) {
        sans = ((E - 1) * T - 1) / S;
        int64_t from_final = num_samples - sans;
        int64_t per_epoch = (T - 1) / S;
        if (from_final < 0 || from_final > per_epoch + 1) { /* Megatron asserts these */
            mt_gpt_dataset_free(g);
            return mt_fail(err, MT_ERR_CONFIG, "%s: inconsistent epoch arithmetic (%lld samples from the final epoch)",
                           name, (long long)from_final);
        }
        g->separate_final_epoch = from_final < (int64_t)(0.80 * (double)per_epoch);
    }

    /* Document index (int32): tile + RandomState.shuffle; the final epoch shuffled on its own if separate. */
    int64_t m = end - begin;
    if (E > INT64_MAX / (m > 0 ? m : 1) || (uint64_t)(E * m) > SIZE_MAX / sizeof(int32_t)) {
        mt_gpt_dataset_free(g);
        return mt_fail(err, MT_ERR_OOM, "%s: document index of %lld epochs too large", name, (long long)E);
    }
    g->document_index_length = E * m;
    g->document_index = (int32_t*)malloc((size_t)(E * m) * sizeof(int32_t) + 1);
    if (!g->document_index) {
        mt_gpt_dataset_free(g);
        return mt_fail(err, MT_ERR_OOM, "out of memory for the %s document index (%lld entries)", name,
                       (long long)(E * m));
    }
    mt_mt19937 rng;
    mt_mt19937_seed(&rng, seed);
    if (!g->separate_final_epoch) {
        mt__tile_and_shuffle(g->document_index, begin, end, E, &rng);
    } else {
        mt__tile_and_shuffle(g->document_index, begin, end, E - 1, &rng);
        mt__tile_and_shuffle(g->document_index + (E - 1) * m, begin, end, 1, &rng);
    }

    /* Sample index: helpers.cpp build_sample_idx (drop_last_partial_sequence = True,
     * add_extra_token_to_sequence = 1). int64 when max(len(document_index), max length) > INT32_MAX. */
    const int64_t n = (E * T - 1) / S;
    g->num_samples = n;
    g->num_samples_sans_final_epoch = g->separate_final_epoch ? sans : n;
    g->sample_itemsize = g->document_index_length > INT32_MAX ? 8 : 4;
    g->shuffle_itemsize = n >= (int64_t)UINT32_MAX - 1 ? 8 : 4;
    if ((uint64_t)n >= SIZE_MAX / 16) { /* the sample index's bytes, (n + 1) x 2 x 8 at most, must fit size_t */
        mt_gpt_dataset_free(g);
        return mt_fail(err, MT_ERR_OOM, "%s: a sample index of %lld samples is too large", name, (long long)n);
    }
    g->sample_index = malloc((size_t)(n + 1) * 2 * (size_t)g->sample_itemsize);
    g->shuffle_index = malloc((size_t)n * (size_t)g->shuffle_itemsize + 1);
    if (!g->sample_index || !g->shuffle_index) {
        mt_gpt_dataset_free(g);
        return mt_fail(err, MT_ERR_OOM, "out of memory for the %s sample index (%lld samples)", name, (long long)n);
    }
    {
        int32_t* s32 = (int32_t*)g->sample_index;
        int64_t* s64 = (int64_t*)g->sample_index;
        const int wide = g->sample_itemsize == 8;
        const int32_t* doc = g->document_index;
        const int64_t last = g->document_index_length - 1;
        int64_t d = 0, off = 0;
        if (wide) { s64[0] = 0; s64[1] = 0; } else { s32[0] = 0; s32[1] = 0; }
        for (int64_t k = 1; k <= n; k++) {
            int64_t remaining = S + 1;
            while (remaining != 0) {
                int64_t len = (int64_t)mt__load_i32(ds->lengths + (int64_t)doc[d] * 4) - off;
                remaining -= len;
                if (remaining <= 0) { /* the sample ends inside this document */
                    off += remaining + len - 1;
                    remaining = 0;
                } else {
                    if (d == last) { /* out of documents (only without drop_last) */
                        off = (int64_t)mt__load_i32(ds->lengths + (int64_t)doc[d] * 4) - 1;
                        break;
                    }
                    d++;
                    off = 0;
                }
            }
            if (wide) { s64[2 * k] = d; s64[2 * k + 1] = off; }
            else { s32[2 * k] = (int32_t)d; s32[2 * k + 1] = (int32_t)off; }
        }
    }

    /* Shuffle index: arange(n) shuffled, or arange(sans) and arange(sans, n) shuffled separately. */
    {
        const int64_t first = g->num_samples_sans_final_epoch;
        if (g->shuffle_itemsize == 4) {
            uint32_t* sh = (uint32_t*)g->shuffle_index;
            for (int64_t i = 0; i < n; i++) sh[i] = (uint32_t)i;
        } else {
            int64_t* sh = (int64_t*)g->shuffle_index;
            for (int64_t i = 0; i < n; i++) sh[i] = i;
        }
        unsigned char* base = (unsigned char*)g->shuffle_index;
        mt_shuffle(&rng, base, first, (size_t)g->shuffle_itemsize);
        if (first < n) mt_shuffle(&rng, base + first * g->shuffle_itemsize, n - first, (size_t)g->shuffle_itemsize);
    }
    *out = g;
    return MT_OK;
}

MT_DEF void mt_gpt_dataset_get_info(const mt_gpt_dataset* g, mt_gpt_dataset_info* info) {
    info->begin = g->begin;
    info->end = g->end;
    info->tokens_per_epoch = g->tokens_per_epoch;
    info->num_samples_requested = g->num_samples_requested;
    info->num_epochs = g->num_epochs;
    info->separate_final_epoch = g->separate_final_epoch;
    info->num_samples_sans_final_epoch = g->num_samples_sans_final_epoch;
    info->num_samples = g->num_samples;
    info->document_index_length = g->document_index_length;
    info->document_index = g->document_index;
    info->sample_index_itemsize = g->sample_itemsize;
    info->sample_index = g->sample_index;
    info->shuffle_index_itemsize = g->shuffle_itemsize;
    info->shuffle_index = g->shuffle_index;
}

MT_DEF int64_t mt_gpt_dataset_num_samples(const mt_gpt_dataset* g) { return g->num_samples; }

MT_DEF int64_t mt_gpt_dataset_shuffle_index(const mt_gpt_dataset* g, int64_t i) {
    return mt__get_shuffle(g->shuffle_index, g->shuffle_itemsize, i);
}

MT_DEF void mt_gpt_dataset_sample_index(const mt_gpt_dataset* g, int64_t row, int64_t* doc_position, int64_t* offset) {
    *doc_position = mt__get_index(g->sample_index, g->sample_itemsize, 2 * row);
    *offset = mt__get_index(g->sample_index, g->sample_itemsize, 2 * row + 1);
}

MT_DEF mt_status mt_gpt_dataset_get(const mt_gpt_dataset* g, int64_t idx, int32_t* tokens, mt_error* err) {
    if (idx < 0 || idx >= g->num_samples)
        return mt_fail(err, MT_ERR_RANGE, "%s: sample %lld out of range [0, %lld)", g->ds->prefix, (long long)idx,
                       (long long)g->num_samples);
    const int64_t want = (int64_t)g->seq_length + 1;
    int64_t i = mt_gpt_dataset_shuffle_index(g, idx), d0, o0, d1, o1, got = 0;
    mt_gpt_dataset_sample_index(g, i, &d0, &o0);
    mt_gpt_dataset_sample_index(g, i + 1, &d1, &o1);
    for (int64_t d = d0; d <= d1; d++) {
        int64_t seq = g->document_index[d];
        int64_t off = d == d0 ? o0 : 0;
        int64_t len = d < d1 ? mt__load_i32(g->ds->lengths + seq * 4) - off : o1 + 1 - off;
        if (len > want - got)
            return mt_fail(err, MT_ERR_FORMAT, "%s: sample %lld spans more than %lld tokens", g->ds->prefix,
                           (long long)idx, (long long)want);
        mt_status st = mt_indexed_dataset_read(g->ds, seq, off, len, tokens + got, err);
        if (st != MT_OK) return st;
        got += len;
    }
    for (; got < want; got++) tokens[got] = -1; /* Megatron's pad (only without drop_last) */
    return MT_OK;
}

MT_DEF mt_status mt_gpt_dataset_save_indices(const mt_gpt_dataset* g, const char* dir, const char* name_prefix,
                                             mt_error* err) {
    const char* names[3] = {"document_index.npy", "sample_index.npy", "shuffle_index.npy"};
    const char* dtypes[3] = {"<i4", g->sample_itemsize == 4 ? "<i4" : "<i8", g->shuffle_itemsize == 4 ? "<u4" : "<i8"};
    int64_t shapes[3][2] = {{g->document_index_length, 0}, {g->num_samples + 1, 2}, {g->num_samples, 0}};
    int ndims[3] = {1, 2, 1};
    const void* data[3] = {g->document_index, g->sample_index, g->shuffle_index};
    for (int i = 0; i < 3; i++) {
        size_t len = strlen(dir) + (name_prefix ? strlen(name_prefix) : 0) + strlen(names[i]) + 2;
        char* path = (char*)malloc(len);
        if (!path) return mt_fail(err, MT_ERR_OOM, "out of memory");
        snprintf(path, len, "%s/%s%s", dir, name_prefix ? name_prefix : "", names[i]);
        mt_status st = mt_npy_write(path, dtypes[i], ndims[i], shapes[i], data[i], err);
        free(path);
        if (st != MT_OK) return st;
    }
    return MT_OK;
}

MT_DEF void mt_build_blending_indices(const double* weights, int num_datasets, int64_t size, int16_t* dataset_index,
                                      int64_t* dataset_sample_index) {
    int64_t* current = (int64_t*)calloc((size_t)(num_datasets > 0 ? num_datasets : 1), sizeof(int64_t));
    if (!current) return;
    for (int64_t s = 0; s < size; s++) {
        double x = s > 1 ? (double)s : 1.0;
        int best = 0;
        double best_err = weights[0] * x - (double)current[0];
        for (int d = 1; d < num_datasets; d++) {
            double e = weights[d] * x - (double)current[d];
            if (e > best_err) {
                best_err = e;
                best = d;
            }
        }
        dataset_index[s] = (int16_t)best;
        dataset_sample_index[s] = current[best]++;
    }
    free(current);
}

MT_DEF void mt_build_exhaustive_blending_indices(const int64_t* sizes, int num_datasets, int16_t* dataset_index,
                                                 int64_t* dataset_sample_index) {
    int64_t total = 0;
    for (int d = 0; d < num_datasets; d++) total += sizes[d];
    int64_t* count = (int64_t*)calloc((size_t)(num_datasets > 0 ? num_datasets : 1), sizeof(int64_t));
    double* w = (double*)malloc((size_t)(num_datasets > 0 ? num_datasets : 1) * sizeof(double));
    unsigned char* spent = (unsigned char*)calloc((size_t)(num_datasets > 0 ? num_datasets : 1), 1);
    if (!count || !w || !spent) { free(count); free(w); free(spent); return; }
    int unspent = num_datasets; /* Megatron's std::set of unspent datasets, walked in ascending order */
    for (int d = 0; d < num_datasets; d++) w[d] = (double)sizes[d] / (double)total;
    for (int64_t s = 0; s < total && unspent > 0; s++) {
        double x = s > 1 ? (double)s : 1.0;
        int best = -1;
        double best_err = -1.7976931348623157e308; /* numeric_limits<double>::lowest() */
        for (int d = 0; d < num_datasets; d++) {
            if (spent[d]) continue;
            double e = w[d] * x - (double)count[d];
            if (e > best_err) {
                best_err = e;
                best = d;
            }
        }
        dataset_index[s] = (int16_t)best;
        dataset_sample_index[s] = count[best]++;
        if ((double)sizes[best] - (double)count[best] == 0) {
            spent[best] = 1;
            unspent--;
        }
    }
    free(count);
    free(w);
    free(spent);
}

MT_DEF int64_t mt_sampler_index(int64_t consumed_samples, int64_t micro_batch_size, int dp_rank, int64_t k) {
    return consumed_samples + (int64_t)dp_rank * micro_batch_size + k;
}

/* Python's float(): the whole string, surrounding whitespace allowed. */
static int mt__parse_float(const char* s, double* out) {
    char* end = NULL;
    while (*s == ' ' || *s == '\t') s++;
    if (!*s) return 0;
    *out = strtod(s, &end);
    if (end == s) return 0;
    while (*end == ' ' || *end == '\t' || *end == '\n') end++;
    return *end == 0;
}

MT_DEF mt_status mt_data_path_parse(int n, const char* const* args, const char** prefixes, double* weights,
                                    int* num_prefixes, int* weighted, mt_error* err) {
    *num_prefixes = 0;
    *weighted = 0;
    if (n < 1) return mt_fail(err, MT_ERR_ARG, "--data-path needs at least one dataset prefix");
    int numbers = 0;
    if (n % 2 == 0) {
        for (int i = 0; i < n; i += 2) {
            double w;
            numbers += mt__parse_float(args[i], &w);
        }
        if (numbers == n / 2) {
            for (int i = 0; i < n; i += 2) {
                mt__parse_float(args[i], &weights[i / 2]);
                prefixes[i / 2] = args[i + 1];
            }
            *num_prefixes = n / 2;
            *weighted = 1;
            return MT_OK;
        }
        if (numbers > 0)
            return mt_fail(err, MT_ERR_ARG,
                           "--data-path: give either weight-prefix pairs (w1 p1 w2 p2 ...) or only prefixes, not a mix");
    }
    for (int i = 0; i < n; i++) prefixes[i] = args[i];
    *num_prefixes = n;
    return MT_OK;
}

struct mt_gpt_data {
    int num_prefixes;
    int blended;
    int seq_length;
    mt_split_matrix split;
    mt_indexed_dataset** indexed;  /* [num_prefixes] */
    mt_gpt_dataset** mid[3];       /* [num_prefixes] per split; NULL entries for an empty split */
    int64_t size[3];
    int16_t* dataset_index[3];
    int64_t* dataset_sample_index[3];
};

MT_DEF void mt_gpt_data_close(mt_gpt_data* d) {
    if (!d) return;
    for (int s = 0; s < 3; s++) {
        if (d->mid[s])
            for (int k = 0; k < d->num_prefixes; k++) mt_gpt_dataset_free(d->mid[s][k]);
        free(d->mid[s]);
        free(d->dataset_index[s]);
        free(d->dataset_sample_index[s]);
    }
    if (d->indexed)
        for (int k = 0; k < d->num_prefixes; k++) mt_indexed_dataset_close(d->indexed[k]);
    free(d->indexed);
    free(d);
}

static mt_status mt__gpt_data_build(mt_gpt_data* d, const char* split, const double* weights, uint32_t seed,
                                    const int64_t num_samples[3], mt_error* err) {
    const int K = d->num_prefixes;
    double* w1 = (double*)calloc((size_t)K, sizeof(double));
    double* w2 = (double*)calloc((size_t)K, sizeof(double));
    int64_t* target = (int64_t*)malloc((size_t)K * sizeof(int64_t));
    mt_status st = MT_OK;
    if (!w1 || !w2 || !target) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); goto done; }
    if (weights) {
        for (int k = 0; k < K; k++)
            if (!(weights[k] > 0) || weights[k] > 1e300) {
                st = mt_fail(err, MT_ERR_ARG, "--data-path weight %g of %s must be a positive number", weights[k],
                             d->indexed[k]->prefix);
                goto done;
            }
        mt_normalize_weights(weights, K, w1); /* the builder normalizes ... */
        mt_normalize_weights(w1, K, w2);     /* ... and BlendedDataset again (bitwise as Megatron) */
    }
    for (int s = 0; s < 3; s++) {
        d->mid[s] = (mt_gpt_dataset**)calloc((size_t)K, sizeof(mt_gpt_dataset*));
        if (!d->mid[s]) { st = mt_fail(err, MT_ERR_OOM, "out of memory"); goto done; }
        if (!d->split.present[s]) continue;
        const int64_t t = num_samples[s];
        if (weights && t < 0) {
            st = mt_fail(err, MT_ERR_CONFIG, "the %s split needs a sample count to blend datasets with weights",
                         mt_split_name(s));
            goto done;
        }
        if (d->blended && t > ((int64_t)1 << 52)) { /* the blend computes in doubles, exact below 2^53 */
            st = mt_fail(err, MT_ERR_CONFIG, "the %s split asks for %lld samples: more than 2^52 cannot be blended",
                         mt_split_name(s), (long long)t);
            goto done;
        }
        for (int k = 0; k < K; k++) {
            int64_t request;
            if (!d->blended) request = t;
            else if (!weights) request = -1; /* one epoch */
            else {
                target[k] = (int64_t)ceil((double)t * w1[k]);
                request = (int64_t)ceil((double)target[k] * (1.0 + MT_MID_LEVEL_DATASET_SURPLUS));
            }
            int64_t b, e;
            mt_split_range(&d->split, s, d->indexed[k]->num_sequences, &b, &e);
            st = mt_gpt_dataset_build(&d->mid[s][k], d->indexed[k], b, e, d->seq_length, seed, request, err);
            if (st == MT_ERR_CONFIG && b <= e && mt__range_tokens(d->indexed[k], b, e) < 2) /* say which flag to change */
                st = mt_fail(err, st, "%s: the %s split of --split \"%s\" is sequences [%lld, %lld) of %lld, %lld tokens; a "
                             "split needs at least 2: change --split (a larger %s share, or 0 for no %s split)",
                             d->indexed[k]->prefix, mt_split_name(s), split, (long long)b, (long long)e,
                             (long long)d->indexed[k]->num_sequences, (long long)mt__range_tokens(d->indexed[k], b, e),
                             mt_split_name(s), mt_split_name(s));
            if (st != MT_OK) goto done;
        }
        if (!d->blended) {
            d->size[s] = d->mid[s][0]->num_samples;
            continue;
        }
        /* The top-level BlendedDataset. */
        int64_t size = 0;
        int exhaustive = 0;
        if (weights) {
            for (int k = 0; k < K; k++) size += target[k];
        } else {
            int64_t total = 0;
            for (int k = 0; k < K; k++) {
                w1[k] = (double)d->mid[s][k]->num_samples;
                total += d->mid[s][k]->num_samples;
                if (d->mid[s][k]->num_samples == 0) {
                    st = mt_fail(err, MT_ERR_CONFIG, "%s: the %s split has no samples to blend",
                                 d->indexed[k]->prefix, mt_split_name(s));
                    goto done;
                }
            }
            if (t >= 0) {
                size = t < total ? t : total;
                mt_normalize_weights(w1, K, w2);
            } else {
                size = total;
                exhaustive = 1;
            }
        }
        d->size[s] = size;
        d->dataset_index[s] = (int16_t*)malloc((size_t)size * sizeof(int16_t) + 1);
        d->dataset_sample_index[s] = (int64_t*)malloc((size_t)size * sizeof(int64_t) + 1);
        if (!d->dataset_index[s] || !d->dataset_sample_index[s]) {
            st = mt_fail(err, MT_ERR_OOM, "out of memory for the %s blend (%lld samples)", mt_split_name(s),
                         (long long)size);
            goto done;
        }
        if (exhaustive) {
            for (int k = 0; k < K; k++) target[k] = d->mid[s][k]->num_samples;
            mt_build_exhaustive_blending_indices(target, K, d->dataset_index[s], d->dataset_sample_index[s]);
        } else {
            mt_build_blending_indices(w2, K, size, d->dataset_index[s], d->dataset_sample_index[s]);
        }
        /* Megatron raises IndexError when the blend oversamples a dataset. */
        for (int k = 0; k < K; k++) target[k] = 0;
        for (int64_t i = 0; i < size; i++) target[d->dataset_index[s][i]]++;
        for (int k = 0; k < K; k++)
            if (target[k] > d->mid[s][k]->num_samples) {
                st = mt_fail(err, MT_ERR_CONFIG,
                             "the %s blend draws %lld samples from %s, which has only %lld (raise the mid-level surplus)",
                             mt_split_name(s), (long long)target[k], d->indexed[k]->prefix,
                             (long long)d->mid[s][k]->num_samples);
                goto done;
            }
    }
done:
    free(w1);
    free(w2);
    free(target);
    return st;
}

MT_DEF mt_status mt_gpt_data_open(mt_gpt_data** out, int num_prefixes, const char* const* prefixes,
                                  const double* weights, const char* split, int seq_length, uint32_t seed,
                                  const int64_t num_samples[3], mt_error* err) {
    *out = NULL;
    if (num_prefixes < 1) return mt_fail(err, MT_ERR_ARG, "no --data-path given");
    if (num_prefixes >= 32767) return mt_fail(err, MT_ERR_ARG, "too many datasets to blend (%d)", num_prefixes);
    mt_gpt_data* d = (mt_gpt_data*)calloc(1, sizeof(mt_gpt_data));
    if (!d) return mt_fail(err, MT_ERR_OOM, "out of memory");
    d->num_prefixes = num_prefixes;
    d->seq_length = seq_length;
    d->blended = num_prefixes > 1 || weights != NULL;
    if (!split) split = "969, 30, 1";
    mt_status st = mt_split_parse(split, &d->split, err);
    if (st == MT_OK) {
        d->indexed = (mt_indexed_dataset**)calloc((size_t)num_prefixes, sizeof(mt_indexed_dataset*));
        if (!d->indexed) st = mt_fail(err, MT_ERR_OOM, "out of memory");
    }
    for (int k = 0; st == MT_OK && k < num_prefixes; k++) st = mt_indexed_dataset_open(&d->indexed[k], prefixes[k], err);
    if (st == MT_OK) st = mt__gpt_data_build(d, split, weights, seed, num_samples, err);
    if (st != MT_OK) {
        mt_gpt_data_close(d);
        return st;
    }
    *out = d;
    return MT_OK;
}

MT_DEF int64_t mt_gpt_data_num_samples(const mt_gpt_data* d, int split) {
    if (split < 0 || split > 2) return 0;
    return d->size[split];
}

MT_DEF mt_status mt_gpt_data_get(const mt_gpt_data* d, int split, int64_t index, int32_t* tokens, mt_error* err) {
    if (split < 0 || split > 2) return mt_fail(err, MT_ERR_ARG, "no split %d", split);
    if (index < 0 || index >= d->size[split])
        return mt_fail(err, MT_ERR_RANGE, "%s sample %lld out of range [0, %lld)", mt_split_name(split),
                       (long long)index, (long long)d->size[split]);
    if (!d->blended) return mt_gpt_dataset_get(d->mid[split][0], index, tokens, err);
    return mt_gpt_dataset_get(d->mid[split][d->dataset_index[split][index]], d->dataset_sample_index[split][index],
                              tokens, err);
}

MT_DEF int mt_gpt_data_num_datasets(const mt_gpt_data* d) { return d->num_prefixes; }
MT_DEF const mt_indexed_dataset* mt_gpt_data_indexed(const mt_gpt_data* d, int k) { return d->indexed[k]; }
MT_DEF int mt_gpt_data_is_blended(const mt_gpt_data* d) { return d->blended; }
MT_DEF const mt_split_matrix* mt_gpt_data_split_matrix(const mt_gpt_data* d) { return &d->split; }

MT_DEF const mt_gpt_dataset* mt_gpt_data_dataset(const mt_gpt_data* d, int split, int k) {
    if (split < 0 || split > 2 || k < 0 || k >= d->num_prefixes) return NULL;
    return d->mid[split][k];
}

MT_DEF const int16_t* mt_gpt_data_blend_dataset_index(const mt_gpt_data* d, int split) {
    return split >= 0 && split <= 2 ? d->dataset_index[split] : NULL;
}

MT_DEF const int64_t* mt_gpt_data_blend_sample_index(const mt_gpt_data* d, int split) {
    return split >= 0 && split <= 2 ? d->dataset_sample_index[split] : NULL;
}

/* 4. .npy writer (Megatron's index cache format) ----------------------------------------------- */

MT_DEF mt_status mt_npy_write(const char* path, const char* dtype, int ndim, const int64_t* shape, const void* data,
                              mt_error* err) {
    static const char* const descrs[] = {"<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "|i1", "|u1", "<f4", "<f8"};
    static const size_t sizes[] = {2, 4, 8, 2, 4, 8, 1, 1, 4, 8};
    size_t itemsize = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++)
        if (strcmp(dtype, descrs[i]) == 0) itemsize = sizes[i];
    if (!itemsize) return mt_fail(err, MT_ERR_ARG, "%s: unsupported .npy dtype \"%s\"", path, dtype);
    if (ndim < 0 || ndim > 8) return mt_fail(err, MT_ERR_ARG, "%s: %d dimensions", path, ndim);
    /* numpy.lib.format 1.0 as numpy.save writes it: the dict repr, spaces for the first axis to grow
     * to 21 digits, then spaces and '\n' up to a multiple of 64 bytes including the 10-byte preamble. */
    char header[512], shape_str[256];
    int64_t count = 1;
    size_t n = 0;
    shape_str[0] = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return mt_fail(err, MT_ERR_ARG, "%s: negative dimension", path);
        if (mt_mul_overflows_i64(count, shape[i], &count) || (uint64_t)count > SIZE_MAX / itemsize)
            return mt_fail(err, MT_ERR_ARG, "%s: the array's size overflows", path);
        n += (size_t)snprintf(shape_str + n, sizeof(shape_str) - n, i == 0 ? "%lld" : ", %lld", (long long)shape[i]);
    }
    if (ndim == 1) n += (size_t)snprintf(shape_str + n, sizeof(shape_str) - n, ",");
    int len = snprintf(header, sizeof(header), "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", dtype,
                       shape_str);
    if (ndim > 0) {
        char first[32];
        int digits = snprintf(first, sizeof(first), "%lld", (long long)shape[0]);
        for (int i = digits; i < 21; i++) header[len++] = ' ';
    }
    int total = 10 + len + 1;
    int pad = 64 - total % 64; /* numpy pads 1..64 bytes, never 0 */
    for (int i = 0; i < pad; i++) header[len++] = ' ';
    header[len++] = '\n';
    unsigned char pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (unsigned char)(len & 0xff),
                             (unsigned char)(len >> 8)};

    const void* chunks[3] = {pre, header, data};
    const size_t lengths[3] = {10, (size_t)len, (size_t)count * itemsize};
    return mt_write_file(path, 3, chunks, lengths, err);
}

/* 5. Training configuration, learning-rate schedule, FLOP formula ------------------------------ */

MT_DEF void mt_config_defaults(mt_config* cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->make_vocab_size_divisible_by = 128;
    cfg->init_method_std = 0.02;
    cfg->norm_epsilon = 1e-5;
    cfg->rotary_base = 10000.0;
    cfg->rotary_percent = 1.0;
    cfg->rope_scaling_factor = 8.0;
    cfg->add_bias_linear = 1;
    cfg->precision = MT_FP32;
    cfg->initial_loss_scale = 4294967296.0; /* 2^32 */
    cfg->min_loss_scale = 1.0;
    cfg->loss_scale_window = 1000;
    cfg->hysteresis = 2;
    cfg->lr_decay_style = MT_LR_LINEAR;
    cfg->lr_warmup_fraction = -1.0;
    cfg->decoupled_lr = -1.0;
    cfg->decoupled_min_lr = -1.0;
    cfg->lr_wsd_decay_style = MT_WSD_EXPONENTIAL;
    cfg->adam_beta1 = 0.9;
    cfg->adam_beta2 = 0.999;
    cfg->adam_eps = 1e-8;
    cfg->weight_decay = 0.01;
    cfg->clip_grad = 1.0;
    cfg->check_for_nan_in_loss_and_grad = 1;
    cfg->micro_batch_size = 1;
    cfg->seed = 1234;
    cfg->hidden_dropout = 0.1; /* Megatron's */
    cfg->attention_dropout = 0.1;
    cfg->tensor_model_parallel_size = 1;
    cfg->pipeline_model_parallel_size = 1;
    cfg->context_parallel_size = 1;
    cfg->cp_comm_type = MT_CP_P2P;
    cfg->virtual_pipeline_size = 1;
    cfg->decoder_first_pipeline_num_layers = -1;
    cfg->decoder_last_pipeline_num_layers = -1;
    cfg->world_size = 1;
    cfg->local_rank = -1;
    cfg->fp8_format = MT_FP8_NONE;
    cfg->fp8_recipe = MT_FP8_DELAYED;
    cfg->fp8_amax_history_len = 1;
    cfg->fp8_amax_compute_algo = MT_FP8_AMAX_MOST_RECENT;
    cfg->fp8_wgrad = 1;
    cfg->num_layers_at_start_in_bf16 = 1;
    cfg->num_layers_at_end_in_bf16 = 1;
    cfg->optimizer_offload_fraction = 1.0;
    cfg->distributed_timeout_minutes = 10.0;
    /* mixture of experts: Megatron's defaults (no experts: a dense model) */
    cfg->moe_layer_freq = 1;
    cfg->moe_router_topk = 2;
    cfg->moe_load_balancing = MT_MOE_AUX_LOSS;
    cfg->moe_router_bias_update_rate = 1e-3;
    cfg->expert_model_parallel_size = 1;
}

MT_DEF int64_t mt_padded_vocab_size(int64_t vocab_size, int divisible_by, int tensor_parallel_size) {
    int64_t multiple = (int64_t)divisible_by * tensor_parallel_size;
    if (multiple <= 0) return vocab_size;
    return (vocab_size + multiple - 1) / multiple * multiple;
}

MT_DEF int64_t mt_padded_vocab_size_resumed(int64_t vocab_size, int divisible_by, int tensor_parallel_size,
                                            int64_t saved) {
    if (saved > 0 && saved >= vocab_size && tensor_parallel_size > 0 && saved % tensor_parallel_size == 0) return saved;
    return mt_padded_vocab_size(vocab_size, divisible_by, tensor_parallel_size);
}

/* The FP8 flags: ranges, the combinations Megatron refuses, and the shapes FP8 GEMMs can take
 * (every dimension of the four linears' GEMMs, per tensor-parallel rank, a multiple of 16; the
 * blockwise recipe's blocks need multiples of 128). */
/* The FP8 flags: ranges and the combinations Megatron refuses (what this build lacks for FP8:
 * mt_config_check_supported). */
static mt_status mt_fp8_config_check(const mt_config* c, mt_error* err) {
    if (c->fp8_format == MT_FP8_NONE) {
        if (c->fp8_param_gather) return mt_fail(err, MT_ERR_CONFIG, "--fp8-param-gather needs --fp8-format");
        return MT_OK;
    }
    if (c->fp8_format != MT_FP8_E4M3 && c->fp8_format != MT_FP8_HYBRID)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-format must be e4m3 or hybrid");
    if (c->fp8_recipe != MT_FP8_DELAYED && c->fp8_recipe != MT_FP8_TENSORWISE && c->fp8_recipe != MT_FP8_BLOCKWISE)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-recipe must be delayed, tensorwise or blockwise");
    if (c->fp8_margin < 0 || c->fp8_margin > 30)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-margin %d must be in [0, 30]", c->fp8_margin);
    if (c->fp8_amax_history_len < 1 || c->fp8_amax_history_len > 65536)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-amax-history-len %d must be in [1, 65536]", c->fp8_amax_history_len);
    if (c->fp8_amax_compute_algo != MT_FP8_AMAX_MAX && c->fp8_amax_compute_algo != MT_FP8_AMAX_MOST_RECENT)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-amax-compute-algo must be max or most_recent");
    if (c->first_last_layers_bf16) {
        if (c->fp8_recipe == MT_FP8_DELAYED)
            return mt_fail(err, MT_ERR_CONFIG,
                           "--first-last-layers-bf16 is not supported with --fp8-recipe delayed (as in Megatron)");
        if (c->num_layers_at_start_in_bf16 < 0 || c->num_layers_at_end_in_bf16 < 0 ||
            (int64_t)c->num_layers_at_start_in_bf16 + c->num_layers_at_end_in_bf16 > c->num_layers)
            return mt_fail(err, MT_ERR_CONFIG,
                           "--num-layers-at-start-in-bf16 %d and --num-layers-at-end-in-bf16 %d must be >= 0 and "
                           "together at most --num-layers %d", c->num_layers_at_start_in_bf16,
                           c->num_layers_at_end_in_bf16, c->num_layers);
    }
    if (c->fp8_param_gather && !c->use_distributed_optimizer)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-param-gather needs --use-distributed-optimizer");
    return MT_OK;
}

/* The one list of combinations this build does not have (declared with mt_config_finalize). Each
 * rule says what is missing and what to run instead; Megatron accepts every one of them. */
MT_DEF mt_status mt_config_check_supported(const mt_config* c, mt_error* err) {
    const int pp = c->pipeline_model_parallel_size, vp = c->virtual_pipeline_size > 0 ? c->virtual_pipeline_size : 1;
    /* pipeline parallelism */
    if (vp > 1 && (c->decoder_first_pipeline_num_layers >= 0 || c->decoder_last_pipeline_num_layers >= 0))
        return mt_fail(err, MT_ERR_CONFIG, "--decoder-first/last-pipeline-num-layers with virtual pipeline stages is "
                       "not built (use an even split)");
    if (vp > 1 && c->microbatch_group_size_per_vp_stage > pp)
        return mt_fail(err, MT_ERR_CONFIG, "--microbatch-group-size-per-virtual-pipeline-stage %d > PP %d is not built: "
                       "its schedule leaves activation sends waiting for receives posted several steps later, which "
                       "only NCCL's buffering lets finish (tests/test_pipeline.h); use the default group (PP)",
                       c->microbatch_group_size_per_vp_stage, pp);
    /* context parallelism (issue #36): p2p's ring on the bf16 flash kernels, all_gather on the exact path, a2a
     * on either */
    const int cp = c->context_parallel_size;
    if (cp > 1) {
        const int tp = c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1;
        if (c->num_experts > 0)
            return mt_fail(err, MT_ERR_CONFIG, "--context-parallel-size %d with mixture of experts (and expert "
                           "parallelism) is not built yet: use 1", cp);
        if (c->cp_comm_type == MT_CP_P2P && !mt_flash_attention(c))
            return mt_fail(err, MT_ERR_CONFIG, "--cp-comm-type p2p (the default) runs the ring on the bf16 flash attention "
                           "kernels (head dim 64 or 128); this model's attention is the exact path: give --cp-comm-type "
                           "all_gather or a2a");
        const int64_t chunk = c->seq_length / (2 * (int64_t)cp), tile = c->kv_channels == 64 ? 128 : 64;
        if (c->cp_comm_type == MT_CP_P2P && chunk % tile)
            return mt_fail(err, MT_ERR_CONFIG, "--cp-comm-type p2p: each of the 2 x CP = %d chunks of --seq-length %d has "
                           "%lld rows, not a multiple of the ring kernels' %lld-row tiles (head dim %d)", 2 * cp,
                           c->seq_length, (long long)chunk, (long long)tile, c->kv_channels);
        if (c->cp_comm_type == MT_CP_ALL_GATHER && mt_flash_attention(c))
            return mt_fail(err, MT_ERR_CONFIG, "--cp-comm-type all_gather runs on the exact attention path (fp32, fp16, "
                           "bf16 head dims other than 64 and 128); with bf16 flash attention (head dim %d) give "
                           "--cp-comm-type a2a", c->kv_channels);
        if (c->cp_comm_type == MT_CP_A2A &&
            ((c->num_attention_heads / tp) % cp || (c->num_query_groups / tp) % cp))
            return mt_fail(err, MT_ERR_CONFIG, "--cp-comm-type a2a needs the attention heads (%d) and query groups (%d) "
                           "of a tensor-parallel rank divisible by --context-parallel-size %d",
                           c->num_attention_heads / tp, c->num_query_groups / tp, cp);
    }
    /* mixture of experts, phase 1: one GPU and data parallelism (issue #34) */
    const int moe_layers = mt_moe_num_layers(c);
    if (moe_layers > 0) {
        const int etp = c->expert_tensor_parallel_size > 0 ? c->expert_tensor_parallel_size : c->tensor_model_parallel_size;
        const int ep = c->expert_model_parallel_size;
        if (ep > 1 && c->data_parallel_size % ep)
            return mt_fail(err, MT_ERR_CONFIG, "--expert-model-parallel-size %d must divide the data-parallel size %d (the "
                           "expert layers fold the data-parallel ranks into EP x expert-data-parallel)", ep,
                           c->data_parallel_size);
        if (ep > 1 && !c->moe_token_dispatcher_alltoall)
            return mt_fail(err, MT_ERR_CONFIG, "--moe-token-dispatcher-type allgather with expert parallelism is not built: "
                           "give --moe-token-dispatcher-type alltoall (the same routing and experts)");
        if (pp > 1 && ep > 1)
            return mt_fail(err, MT_ERR_CONFIG, "MoE with pipeline parallelism (--pipeline-model-parallel-size %d) and expert "
                           "parallelism (--expert-model-parallel-size %d) together is not built yet: use one of them", pp, ep);
        if (c->tensor_model_parallel_size > 1)
            return mt_fail(err, MT_ERR_CONFIG, "MoE with tensor parallelism (--tensor-model-parallel-size %d) is not built "
                           "yet: use 1 (data parallelism is)", c->tensor_model_parallel_size);
        if (etp != 1)
            return mt_fail(err, MT_ERR_CONFIG, "--expert-tensor-parallel-size %d: expert tensor parallelism is not built yet "
                           "(use 1)", etp);
        if (c->add_bias_linear && ep > 1)
            return mt_fail(err, MT_ERR_CONFIG, "MoE linear biases with expert parallelism (--expert-model-parallel-size "
                           "%d) are not built yet: give --disable-bias-linear, or use EP 1", ep);
        if (c->fp8_format != MT_FP8_NONE || c->fp8_param_gather)
            return mt_fail(err, MT_ERR_CONFIG, "MoE with FP8 is not built yet: drop --fp8-format (and --fp8-param-gather); "
                           "bf16 is");
        if (c->calculate_per_token_loss)
            return mt_fail(err, MT_ERR_CONFIG, "MoE with --calculate-per-token-loss is not built yet (Megatron scales the "
                           "auxiliary losses differently with it): drop the flag");
        if (c->num_experts > MT_MOE_MAX_EXPERTS || c->moe_router_topk > MT_MOE_MAX_TOPK)
            return mt_fail(err, MT_ERR_CONFIG, "MoE with %d experts and top-%d: the router's kernels take at most %d experts "
                           "and top-%d (megatron.cu section 14)", c->num_experts, c->moe_router_topk, MT_MOE_MAX_EXPERTS,
                           MT_MOE_MAX_TOPK);
    }
    if (c->fp8_format == MT_FP8_NONE) return MT_OK;
    /* FP8 */
    if (c->precision != MT_BF16)
        return mt_fail(err, MT_ERR_CONFIG, "FP8 training needs --bf16 (FP8 with %s is not supported)",
                       c->precision == MT_FP16 ? "--fp16" : "fp32");
    if (c->fp8_param_gather && c->fp8_recipe == MT_FP8_BLOCKWISE)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-param-gather with --fp8-recipe blockwise is not built (a DP shard "
                       "boundary may cut a 128x128 weight block, whose scale needs the whole block)");
    if (c->fp8_param_gather && c->optimizer_cpu_offload)
        return mt_fail(err, MT_ERR_CONFIG, "--fp8-param-gather with --optimizer-cpu-offload is not built (the offloaded "
                       "weights come back as bf16, not FP8)");
    /* the shapes FP8 GEMMs take: every dimension of the four linears' GEMMs, per tensor-parallel rank, a
     * multiple of 16; the blockwise recipe's blocks need multiples of 128 (products of int fields: int64) */
    int tp = c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1;
    int64_t ffn1 = c->swiglu ? 2 * (int64_t)c->ffn_hidden_size : c->ffn_hidden_size;
    struct { const char* what; int64_t n; } dims[] = {
        {"--hidden-size", c->hidden_size},
        {"the QKV width per tensor-parallel rank", ((int64_t)c->num_attention_heads + 2 * (int64_t)c->num_query_groups) *
                                                      c->kv_channels / tp},
        {"the attention width per tensor-parallel rank", (int64_t)c->num_attention_heads * c->kv_channels / tp},
        {"--ffn-hidden-size per tensor-parallel rank", c->ffn_hidden_size / tp},
        {"the first MLP linear's width per tensor-parallel rank", ffn1 / tp},
        {"the tokens of a micro-batch (--micro-batch-size x --seq-length)",
         (int64_t)c->micro_batch_size * c->seq_length},
    };
    int multiple = c->fp8_recipe == MT_FP8_BLOCKWISE ? 128 : 16;
    for (size_t i = 0; i < sizeof(dims) / sizeof(dims[0]); i++)
        if (dims[i].n % multiple)
            return mt_fail(err, MT_ERR_CONFIG, "FP8 GEMMs need %s (%lld) to be a multiple of %d", dims[i].what,
                           (long long)dims[i].n, multiple);
    return MT_OK;
}

MT_DEF int mt_moe_layer(const mt_config* c, int layer) {
    if (c->num_experts <= 0 || layer < 0 || layer >= c->num_layers) return 0;
    if (c->moe_layer_pattern_len > 0)
        return layer < c->moe_layer_pattern_len && layer < MT_MAX_MOE_PATTERN && c->moe_layer_pattern[layer] != 0;
    return c->moe_layer_freq > 0 && layer % c->moe_layer_freq == 0;
}

MT_DEF int mt_moe_num_layers(const mt_config* c) {
    if (c->num_experts <= 0 || c->num_layers <= 0) return 0;
    if (c->moe_layer_pattern_len <= 0) /* layers 0, N, 2N, ... below L */
        return c->moe_layer_freq > 0 ? (int)(((int64_t)c->num_layers + c->moe_layer_freq - 1) / c->moe_layer_freq) : 0;
    int n = 0;
    for (int l = 0; l < c->num_layers && l < c->moe_layer_pattern_len && l < MT_MAX_MOE_PATTERN; l++)
        n += c->moe_layer_pattern[l] != 0;
    return n;
}

MT_DEF int64_t mt_moe_ffn(const mt_config* c) {
    return c->moe_ffn_hidden_size > 0 ? c->moe_ffn_hidden_size : c->ffn_hidden_size;
}

MT_DEF int64_t mt_moe_capacity(const mt_config* c, int64_t tokens) {
    if (c->num_experts <= 0 || !(c->moe_expert_capacity_factor > 0)) return 0;
    const double per_expert = (double)tokens * (double)c->moe_router_topk / (double)c->num_experts;
    const double v = ceil(per_expert * (double)(float)c->moe_expert_capacity_factor);
    return v >= 9.2e18 ? INT64_MAX : (int64_t)v;
}

MT_DEF int64_t mt_moe_max_rows(const mt_config* c, int64_t tokens) {
    if (c->num_experts <= 0) return 0;
    int64_t pairs, cap_rows;
    if (mt_mul_overflows_i64(tokens, c->moe_router_topk, &pairs)) return INT64_MAX;
    const int64_t C = mt_moe_capacity(c, tokens);
    if (C <= 0) return pairs;
    /* padded: every expert exactly min(C, N) rows (C > N pads each to all N tokens; refused, still bounded) */
    if (c->moe_pad_expert_input_to_capacity)
        return mt_mul_overflows_i64(C < tokens ? C : tokens, c->num_experts, &cap_rows) ? INT64_MAX : cap_rows;
    if (C >= tokens) return pairs;
    if (mt_mul_overflows_i64(C, c->num_experts, &cap_rows)) return INT64_MAX;
    return pairs < cap_rows ? pairs : cap_rows;
}

MT_DEF int64_t mt_moe_expert_rows(const mt_config* c, int64_t tokens) {
    const int64_t ep = c->num_experts > 0 && c->expert_model_parallel_size > 1 ? c->expert_model_parallel_size : 1;
    if (ep == 1) return mt_moe_max_rows(c, tokens);
    const int64_t local = c->num_experts / ep, C = mt_moe_capacity(c, tokens);
    int64_t pairs, per_expert = C > 0 && C < tokens ? C : tokens, cap_rows, rows;
    if (mt_mul_overflows_i64(tokens, c->moe_router_topk, &pairs) || mt_mul_overflows_i64(local, per_expert, &cap_rows))
        return INT64_MAX;
    rows = c->moe_pad_expert_input_to_capacity && C > 0 ? cap_rows : pairs < cap_rows ? pairs : cap_rows;
    return mt_mul_overflows_i64(rows, ep, &rows) ? INT64_MAX : rows;
}

MT_DEF int mt_fp8_layer(const mt_config* c, int layer) {
    if (c->fp8_format == MT_FP8_NONE) return 0;
    if (!c->first_last_layers_bf16) return 1;
    return layer >= c->num_layers_at_start_in_bf16 && layer < c->num_layers - c->num_layers_at_end_in_bf16;
}

MT_DEF float mt_fp8_delayed_scale(const float* history, int len, int newest, mt_fp8_amax_algo algo, float fp8_max,
                                  int margin, float previous_scale) {
    float amax = history[newest];
    if (algo == MT_FP8_AMAX_MAX)
        for (int i = 0; i < len; i++) amax = history[i] > amax ? history[i] : amax;
    if (!(amax > 0.0f) || !isfinite(amax)) return previous_scale;
    float scale = fp8_max / amax / (float)(1 << margin);
    return isfinite(scale) ? scale : previous_scale;
}

/* The sizes the flags multiply into: widths, parameter count, activations, samples. Each product is
 * checked before it is formed (int64), and the message names the flags that make it. Bounds: every
 * width a kernel takes as an int fits int32; the parameter count times 64 bytes (fp32 weights,
 * gradients, master copy, Adam moments, with room) and every activation/sample/token count fit int64. */
#define MT__MUL(a, b, out, ...) \
    do { if (mt_mul_overflows_i64((a), (b), (out))) return mt_fail(err, MT_ERR_CONFIG, __VA_ARGS__); } while (0)
#define MT__ADD(a, b, out, ...) \
    do { if (mt_add_overflows_i64((a), (b), (out))) return mt_fail(err, MT_ERR_CONFIG, __VA_ARGS__); } while (0)
static mt_status mt_config_size_check(const mt_config* c, mt_error* err) {
    int64_t h = c->hidden_size, qkv, attn, ffn1, t, per_layer = 0, params, emb, tokens, x;
    const char* big = "the model's parameter count overflows (--num-layers %d, --hidden-size %d, "
                      "--ffn-hidden-size %d, padded vocabulary %lld)";
#define MT__BIG big, c->num_layers, c->hidden_size, c->ffn_hidden_size, (long long)c->padded_vocab_size
    MT__MUL((int64_t)c->num_attention_heads + 2 * (int64_t)c->num_query_groups, c->kv_channels, &qkv,
            "--num-attention-heads %d + 2 x --num-query-groups %d, times --kv-channels %d, overflows",
            c->num_attention_heads, c->num_query_groups, c->kv_channels);
    if (qkv > INT32_MAX)
        return mt_fail(err, MT_ERR_CONFIG, "the QKV width (--num-attention-heads %d + 2 x --num-query-groups %d) x "
                       "--kv-channels %d = %lld exceeds %d", c->num_attention_heads, c->num_query_groups,
                       c->kv_channels, (long long)qkv, INT32_MAX);
    attn = (int64_t)c->num_attention_heads * c->kv_channels; /* <= qkv */
    ffn1 = c->swiglu ? 2 * (int64_t)c->ffn_hidden_size : c->ffn_hidden_size;
    if (ffn1 > INT32_MAX)
        return mt_fail(err, MT_ERR_CONFIG, "--swiglu: 2 x --ffn-hidden-size %d exceeds %d", c->ffn_hidden_size,
                       INT32_MAX);
    /* one layer: QKV, projection, fc1, fc2 (weights and biases), two norms */
    int64_t mats[4][2] = {{qkv, h}, {h, attn}, {ffn1, h}, {h, c->ffn_hidden_size}};
    for (int i = 0; i < 4; i++) {
        MT__MUL(mats[i][0], mats[i][1], &t, MT__BIG);
        MT__ADD(per_layer, t + mats[i][0], &per_layer, MT__BIG);
    }
    MT__ADD(per_layer, 4 * h, &per_layer, MT__BIG);
    MT__MUL(per_layer, c->num_layers, &params, MT__BIG);
    /* mixture of experts: per MoE layer E experts (fc1, fc2 and their biases), the router, the shared expert */
    const int64_t moe_layers = mt_moe_num_layers(c), E = c->num_experts, fe = mt_moe_ffn(c);
    const int64_t f1e = c->swiglu ? 2 * fe : fe, fs = c->moe_shared_expert_intermediate_size, fs1 = c->swiglu ? 2 * fs : fs;
    if (moe_layers > 0) {
        const char* moe_big = "the MoE layers' parameter count overflows (--num-experts %d, expert width %lld, --hidden-size "
                              "%d, shared expert %d)";
#define MT__MOE_BIG moe_big, c->num_experts, (long long)fe, c->hidden_size, c->moe_shared_expert_intermediate_size
        if (f1e > INT32_MAX || fs1 > INT32_MAX) return mt_fail(err, MT_ERR_CONFIG, MT__MOE_BIG);
        int64_t expert, moe;
        MT__MUL(f1e + fe + 1, h, &expert, MT__MOE_BIG); /* fc1 [f1e, h], fc2 [h, fe], router row, biases below */
        MT__ADD(expert, f1e + h + 1, &expert, MT__MOE_BIG);
        MT__MUL(expert, E, &moe, MT__MOE_BIG);
        MT__MUL(fs1 + fs + 1, h, &t, MT__MOE_BIG);
        MT__ADD(moe, t, &moe, MT__MOE_BIG);
        MT__MUL(moe, moe_layers, &t, MT__MOE_BIG);
        MT__ADD(params, t, &params, MT__MOE_BIG);
#undef MT__MOE_BIG
    }
    MT__MUL(c->padded_vocab_size, h, &emb, "the padded vocabulary %lld (--vocab-size %lld) x --hidden-size %d "
            "overflows", (long long)c->padded_vocab_size, (long long)c->vocab_size, c->hidden_size);
    if (c->untie_embeddings_and_output_weights) MT__ADD(emb, emb, &emb, MT__BIG);
    MT__ADD(params, emb, &params, MT__BIG);
    if (c->position_embedding_type == MT_POSITION_LEARNED) {
        MT__MUL((int64_t)c->max_position_embeddings, h, &t, "--max-position-embeddings %d x --hidden-size %d "
                "overflows", c->max_position_embeddings, c->hidden_size);
        MT__ADD(params, t, &params, MT__BIG);
    }
    if (params > INT64_MAX / 64) return mt_fail(err, MT_ERR_CONFIG, MT__BIG);
#undef MT__BIG
    /* activations of one micro-batch: tokens x the widest row (vocabulary logits), attention scores */
    tokens = (int64_t)c->micro_batch_size * c->seq_length; /* both int32: fits */
    int64_t widest = c->padded_vocab_size;
    if (ffn1 > widest) widest = ffn1;
    if (qkv > widest) widest = qkv;
    MT__MUL(tokens, widest, &x, "--micro-batch-size %d x --seq-length %d x the widest activation row %lld "
            "(padded vocabulary, QKV or MLP width) overflows", c->micro_batch_size, c->seq_length, (long long)widest);
    if (moe_layers > 0) { /* the router's [N, E], the permuted rows [Rmax, max(h, f1e)] (Rmax <= N k) */
        int64_t rows;
        MT__MUL(tokens, E > c->moe_router_topk ? E : c->moe_router_topk, &rows, "--micro-batch-size %d x --seq-length %d x "
                "--num-experts %d overflows", c->micro_batch_size, c->seq_length, c->num_experts);
        MT__MUL(rows, f1e > h ? f1e : h, &x, "the permuted rows (--micro-batch-size %d x --seq-length %d x "
                "--moe-router-topk %d) x the expert width overflow", c->micro_batch_size, c->seq_length, c->moe_router_topk);
    }
    MT__MUL(tokens, (int64_t)c->num_attention_heads, &x,
            "--micro-batch-size %d x --seq-length %d x --num-attention-heads %d overflows", c->micro_batch_size,
            c->seq_length, c->num_attention_heads);
    MT__MUL(x, c->seq_length, &x, "the attention scores (--micro-batch-size %d x --num-attention-heads %d x "
            "--seq-length %d squared) overflow", c->micro_batch_size, c->num_attention_heads, c->seq_length);
    /* samples and tokens of the run, and the schedule's lengths in samples */
    int64_t gbs = c->global_batch_size, samples;
    MT__MUL(c->train_iters, gbs, &samples, "--train-iters %lld x --global-batch-size %d samples overflows",
            (long long)c->train_iters, c->global_batch_size);
    MT__MUL(samples, (int64_t)c->seq_length + 1, &x, "--train-iters %lld x --global-batch-size %d x "
            "--seq-length %d tokens overflows", (long long)c->train_iters, c->global_batch_size, c->seq_length);
    MT__MUL(c->lr_decay_iters, gbs, &x, "--lr-decay-iters %lld x --global-batch-size %d samples overflows",
            (long long)c->lr_decay_iters, c->global_batch_size);
    MT__MUL(c->lr_warmup_iters, gbs, &x, "--lr-warmup-iters %lld x --global-batch-size %d samples overflows",
            (long long)c->lr_warmup_iters, c->global_batch_size);
    MT__MUL(c->lr_wsd_decay_iters, gbs, &x, "--lr-wsd-decay-iters %lld x --global-batch-size %d samples "
            "overflows", (long long)c->lr_wsd_decay_iters, c->global_batch_size);
    MT__MUL(c->train_samples, (int64_t)c->seq_length + 1, &x, "--train-samples %lld x --seq-length %d tokens "
            "overflows", (long long)c->train_samples, c->seq_length);
    return MT_OK;
}
#undef MT__MUL
#undef MT__ADD

/* The batch-size ramp and the step schedule (Megatron's num_microbatches_calculator), as one
 * question: the global batch at consumed_samples, and the first count of consumed samples at which
 * it changes (INT64_MAX: never). The ramp (--rampup-batch-size start inc samples) adds inc every
 * samples / ((global - start) / inc) samples, reckoned in doubles as Python does, and reaches the
 * global batch once consumed_samples exceeds `samples`. */
static int mt__ramp_increments(const mt_config* c) {
    return (int)((c->global_batch_size - c->rampup_batch_size[0]) / c->rampup_batch_size[1]);
}
static int64_t mt__ramp_step(const mt_config* c, int64_t consumed) {
    double per_increment = (double)c->rampup_batch_size[2] / (double)mt__ramp_increments(c);
    int64_t k = (int64_t)((double)consumed / per_increment);
    return k < mt__ramp_increments(c) ? k : mt__ramp_increments(c);
}
static int mt__batch_segment(const mt_config* c, int64_t consumed, int64_t* change_at) {
    *change_at = INT64_MAX;
    if (c->num_batch_size_steps > 0) {
        int i = 0;
        while (i + 1 < c->num_batch_size_steps && c->batch_size_step_samples[i + 1] <= consumed) i++;
        if (i + 1 < c->num_batch_size_steps) *change_at = c->batch_size_step_samples[i + 1];
        return c->batch_size_step_size[i];
    }
    if (c->rampup_batch_size[0] <= 0 || consumed > c->rampup_batch_size[2]) return c->global_batch_size;
    /* the first count past `consumed` with a larger step (steps never decrease), or the ramp's end */
    int64_t k = mt__ramp_step(c, consumed), lo = consumed, hi = c->rampup_batch_size[2] + 1;
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (mt__ramp_step(c, mid) > k) hi = mid;
        else lo = mid;
    }
    *change_at = hi;
    return (int)(c->rampup_batch_size[0] + k * c->rampup_batch_size[1]);
}

MT_DEF int mt_global_batch_size_at(const mt_config* c, int64_t consumed_samples) {
    int64_t change_at;
    return mt__batch_segment(c, consumed_samples, &change_at);
}

MT_DEF int mt_num_micro_batches_at(const mt_config* c, int64_t consumed_samples) {
    return mt_global_batch_size_at(c, consumed_samples) / (c->micro_batch_size * c->data_parallel_size);
}

/* Iterations run while consumed < limit, from *consumed on (which advances), a batch-size segment
 * at a time so that a long run costs one step per segment. */
static int64_t mt__iterations_until(const mt_config* c, int64_t* consumed, int64_t limit) {
    int64_t iterations = 0;
    while (*consumed < limit) {
        int64_t change_at, stop;
        int64_t batch = mt__batch_segment(c, *consumed, &change_at);
        stop = change_at < limit ? change_at : limit;
        int64_t k = (stop - *consumed + batch - 1) / batch;
        *consumed += k * batch;
        iterations += k;
    }
    return iterations;
}

/* --rampup-batch-size and --step-batch-size-schedule: what Megatron asserts, and every batch size
 * the run can reach a multiple of micro-batch x data-parallel size (Megatron checks each one when
 * the run reaches it; here the run is refused before it starts). */
static mt_status mt_batch_ramp_check(const mt_config* c, mt_error* err) {
    int64_t unit = (int64_t)c->micro_batch_size * c->data_parallel_size;
    const int64_t* r = c->rampup_batch_size;
    int ramp = r[0] != 0 || r[1] != 0 || r[2] != 0;
    if (ramp && c->num_batch_size_steps > 0)
        return mt_fail(err, MT_ERR_CONFIG, "--rampup-batch-size and --step-batch-size-schedule are mutually exclusive");
    if (ramp) {
        if (r[0] <= 0 || r[1] <= 0 || r[2] <= 0)
            return mt_fail(err, MT_ERR_CONFIG, "--rampup-batch-size %lld %lld %lld: the start batch, the increment and "
                           "the ramp-up samples must be positive", (long long)r[0], (long long)r[1], (long long)r[2]);
        if (r[0] >= c->global_batch_size || (c->global_batch_size - r[0]) % r[1])
            return mt_fail(err, MT_ERR_CONFIG, "--rampup-batch-size %lld %lld %lld: --global-batch-size %d must exceed "
                           "the start batch by a multiple of the increment", (long long)r[0], (long long)r[1],
                           (long long)r[2], c->global_batch_size);
        if (r[0] % unit || r[1] % unit)
            return mt_fail(err, MT_ERR_CONFIG, "--rampup-batch-size %lld %lld %lld: the start batch and the increment "
                           "must be multiples of --micro-batch-size %d x data-parallel size %d", (long long)r[0],
                           (long long)r[1], (long long)r[2], c->micro_batch_size, c->data_parallel_size);
        if (c->train_samples <= 0)
            return mt_fail(err, MT_ERR_CONFIG, "--rampup-batch-size needs sample-based training (--train-samples), "
                           "as in Megatron");
    }
    for (int i = 0; i < c->num_batch_size_steps; i++) {
        if (c->num_batch_size_steps > MT_MAX_BATCH_SIZE_STEPS || c->batch_size_step_size[i] <= 0 ||
            c->batch_size_step_samples[i] < 0 || (i == 0 && c->batch_size_step_samples[0] != 0) ||
            (i > 0 && c->batch_size_step_samples[i] <= c->batch_size_step_samples[i - 1]))
            return mt_fail(err, MT_ERR_CONFIG, "--step-batch-size-schedule: entry %d is not a positive batch size at "
                           "a threshold above the previous one (the first at 0)", i);
        if (c->batch_size_step_size[i] % unit)
            return mt_fail(err, MT_ERR_CONFIG, "--step-batch-size-schedule: batch size %d is not a multiple of "
                           "--micro-batch-size %d x data-parallel size %d", c->batch_size_step_size[i],
                           c->micro_batch_size, c->data_parallel_size);
    }
    return MT_OK;
}

/* --train-iters or --train-samples (never both), and the schedule lengths that go with each, as
 * Megatron's validate_args asserts; with --train-samples the iterations follow from the batch sizes
 * (training.py update_train_iters: a constant batch drops a partial last batch; the ramp counts its
 * iterations up to the ramp's end, then whole global batches; a step schedule runs until the
 * samples are reached). */
static mt_status mt_training_length_finalize(mt_config* c, mt_error* err) {
    if (c->train_samples > 0) {
        if (c->train_iters > 0)
            return mt_fail(err, MT_ERR_CONFIG, "--train-iters and --train-samples are mutually exclusive");
        if (c->lr_decay_iters > 0 || c->lr_warmup_iters > 0 || c->lr_wsd_decay_iters > 0)
            return mt_fail(err, MT_ERR_CONFIG, "--train-samples counts the schedule in samples: use "
                           "--lr-decay-samples, --lr-warmup-samples and --lr-wsd-decay-samples, not the -iters flags");
        int64_t consumed = 0, iterations;
        if (c->rampup_batch_size[0] > 0) {
            int64_t ramp_end = c->rampup_batch_size[2] < c->train_samples ? c->rampup_batch_size[2] : c->train_samples;
            iterations = mt__iterations_until(c, &consumed, ramp_end + 1);
            if (c->train_samples > consumed) iterations += (c->train_samples - consumed) / c->global_batch_size;
        } else if (c->num_batch_size_steps > 0) {
            iterations = mt__iterations_until(c, &consumed, c->train_samples);
        } else {
            iterations = c->train_samples / c->global_batch_size;
        }
        if (iterations <= 0)
            return mt_fail(err, MT_ERR_CONFIG, "--train-samples %lld is less than one global batch of %d",
                           (long long)c->train_samples, c->global_batch_size);
        c->train_iters = iterations;
        if (c->lr_decay_samples == 0) c->lr_decay_samples = c->train_samples;
        return MT_OK;
    }
    if (c->lr_decay_samples > 0 || c->lr_warmup_samples > 0 || c->lr_wsd_decay_samples > 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-decay-samples, --lr-warmup-samples and --lr-wsd-decay-samples need "
                       "--train-samples (with --train-iters use the -iters flags)");
    if (c->train_iters <= 0) return mt_fail(err, MT_ERR_CONFIG, "--train-iters or --train-samples must be positive");
    if (c->lr_decay_iters == 0) c->lr_decay_iters = c->train_iters;
    return MT_OK;
}

/* Megatron's _parse_numeric_value: a decimal with an optional K/M/B/T suffix, int(float(x) * mult). */
static int mt__schedule_number(const char* s, size_t n, int64_t* out) {
    char buf[64];
    if (n == 0 || n >= sizeof(buf)) return 0;
    memcpy(buf, s, n);
    buf[n] = 0;
    double mult = 1.0;
    char last = buf[n - 1];
    if (last == 'T' || last == 't') mult = 1e12;
    else if (last == 'B' || last == 'b') mult = 1e9;
    else if (last == 'M' || last == 'm') mult = 1e6;
    else if (last == 'K' || last == 'k') mult = 1e3;
    if (mult != 1.0) buf[--n] = 0;
    char* end;
    double v = strtod(buf, &end);
    if (n == 0 || *end || !isfinite(v) || v < 0 || v * mult >= 9.2e18) return 0;
    *out = (int64_t)(v * mult);
    return 1;
}

MT_DEF mt_status mt_batch_size_schedule_parse(const char* text, int seq_length, mt_config* c, mt_error* err) {
    if (seq_length <= 0) return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule needs --seq-length");
    int n = 0;
    const char* p = text;
    while (*p) {
        while (*p == ' ' || *p == ',' || *p == '\t') p++;
        if (!*p) break;
        const char* start = p;
        while (*p && *p != ' ' && *p != ',' && *p != '\t') p++;
        const char* colon = (const char*)memchr(start, ':', (size_t)(p - start));
        int64_t threshold, batch;
        if (!colon || !mt__schedule_number(start, (size_t)(colon - start), &threshold) ||
            !mt__schedule_number(colon + 1, (size_t)(p - colon - 1), &batch) || batch > 2147483647)
            return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule: '%.*s' is not THRESHOLD:BATCH_SIZE "
                           "(tokens, K/M/B/T allowed, then a batch size)", (int)(p - start), start);
        if (n == MT_MAX_BATCH_SIZE_STEPS)
            return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule: more than %d entries", MT_MAX_BATCH_SIZE_STEPS);
        int64_t samples = threshold / seq_length; /* thresholds are tokens */
        int i = n++; /* insertion sort by threshold, stable as Python's sort */
        while (i > 0 && c->batch_size_step_samples[i - 1] > samples) {
            c->batch_size_step_samples[i] = c->batch_size_step_samples[i - 1];
            c->batch_size_step_size[i] = c->batch_size_step_size[i - 1];
            i--;
        }
        c->batch_size_step_samples[i] = samples;
        c->batch_size_step_size[i] = (int)batch;
    }
    if (n == 0) return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule: no entries");
    c->num_batch_size_steps = n;
    if (c->batch_size_step_samples[0] != 0)
        return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule: the first threshold must be 0, got %lld samples",
                       (long long)c->batch_size_step_samples[0]);
    for (int i = 1; i < n; i++)
        if (c->batch_size_step_samples[i] <= c->batch_size_step_samples[i - 1])
            return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule: thresholds must be strictly increasing "
                           "(after // --seq-length %d: %lld then %lld samples)", seq_length,
                           (long long)c->batch_size_step_samples[i - 1], (long long)c->batch_size_step_samples[i]);
    for (int i = 0; i < n; i++)
        if (c->batch_size_step_size[i] <= 0)
            return mt_fail(err, MT_ERR_ARG, "--step-batch-size-schedule: batch size %d must be positive",
                           c->batch_size_step_size[i]);
    return MT_OK;
}

/* --moe-layer-freq's list expressions: a small recursive-descent reader of Python's list arithmetic
 * (expr := term ('+' term)*; term := factor ('*' count)* | count '*' factor; factor := '[' ints ']' | '('
 * expr ')'), each list built in out[] from *n on. */
typedef struct { const char* p; const char* err; unsigned char* out; int n, depth; } mt__freq_reader;
static void mt__freq_space(mt__freq_reader* r) { while (*r->p == ' ' || *r->p == '\t') r->p++; }
static int mt__freq_count(mt__freq_reader* r, int64_t* v) {
    mt__freq_space(r);
    if (*r->p < '0' || *r->p > '9') return 0;
    int64_t x = 0;
    while (*r->p >= '0' && *r->p <= '9') {
        x = x * 10 + (*r->p++ - '0');
        if (x > MT_MAX_MOE_PATTERN * 1000LL) { r->err = "a count too large"; return 0; }
    }
    *v = x;
    return 1;
}
static int mt__freq_expr(mt__freq_reader* r);
/* repeats out[from, n) so it appears `times` times in all */
static int mt__freq_repeat(mt__freq_reader* r, int from, int64_t times) {
    const int len = r->n - from;
    if (times == 0) { r->n = from; return 1; }
    if (len == 0) return 1;
    if ((int64_t)len * times > MT_MAX_MOE_PATTERN - from) { r->err = "more entries than layers a pattern may have"; return 0; }
    for (int64_t t = 1; t < times; t++) {
        memmove(r->out + r->n, r->out + from, (size_t)len);
        r->n += len;
    }
    return 1;
}
static int mt__freq_factor(mt__freq_reader* r) {
    mt__freq_space(r);
    if (*r->p == '(') {
        r->p++;
        if (++r->depth > 64) { r->err = "parentheses nested more than 64 deep"; return 0; }
        if (!mt__freq_expr(r)) return 0;
        r->depth--;
        mt__freq_space(r);
        if (*r->p != ')') { r->err = "a ( without its )"; return 0; }
        r->p++;
        return 1;
    }
    if (*r->p != '[') { r->err = "expected [ or ("; return 0; }
    r->p++;
    mt__freq_space(r);
    if (*r->p == ']') { r->p++; return 1; }
    for (;;) {
        int64_t v;
        if (!mt__freq_count(r, &v)) { if (!r->err) r->err = "expected an entry 0 or 1"; return 0; }
        if (v > 1) { r->err = "an entry other than 0 or 1"; return 0; }
        if (r->n >= MT_MAX_MOE_PATTERN) { r->err = "more entries than layers a pattern may have"; return 0; }
        r->out[r->n++] = (unsigned char)v;
        mt__freq_space(r);
        if (*r->p == ',') { r->p++; mt__freq_space(r); if (*r->p == ']') { r->p++; return 1; } continue; }
        if (*r->p == ']') { r->p++; return 1; }
        r->err = "expected , or ] in a list";
        return 0;
    }
}
static int mt__freq_term(mt__freq_reader* r) {
    const int from = r->n;
    int64_t times;
    mt__freq_space(r);
    if (*r->p >= '0' && *r->p <= '9') { /* count * factor */
        if (!mt__freq_count(r, &times)) return 0;
        mt__freq_space(r);
        if (*r->p != '*') { r->err = "a bare number (give the list, or an integer alone)"; return 0; }
        r->p++;
        if (!mt__freq_factor(r)) return 0;
        if (!mt__freq_repeat(r, from, times)) return 0;
    } else if (!mt__freq_factor(r)) {
        return 0;
    }
    for (;;) { /* factor * count * count ... */
        mt__freq_space(r);
        if (*r->p != '*') return 1;
        r->p++;
        if (!mt__freq_count(r, &times)) { if (!r->err) r->err = "expected a count after *"; return 0; }
        if (!mt__freq_repeat(r, from, times)) return 0;
    }
}
static int mt__freq_expr(mt__freq_reader* r) {
    if (!mt__freq_term(r)) return 0;
    for (;;) {
        mt__freq_space(r);
        if (*r->p != '+') return 1;
        r->p++;
        if (!mt__freq_term(r)) return 0;
    }
}

MT_DEF mt_status mt_moe_layer_freq_parse(const char* text, mt_config* c, mt_error* err) {
    const char* t = text;
    while (*t == ' ') t++;
    if (*t >= '0' && *t <= '9' && !strpbrk(t, "[(*+")) { /* an integer */
        char* end;
        errno = 0;
        long v = strtol(t, &end, 10);
        while (*end == ' ') end++;
        if (*end || errno || v < 1 || v > INT32_MAX)
            return mt_fail(err, MT_ERR_ARG, "--moe-layer-freq %s: an integer >= 1, or a list such as \"([0]*3+[1]*29)\"",
                           text);
        c->moe_layer_freq = (int)v;
        c->moe_layer_pattern_len = 0;
        return MT_OK;
    }
    unsigned char local[MT_MAX_MOE_PATTERN];
    mt__freq_reader r = {t, NULL, local, 0, 0};
    int ok = mt__freq_expr(&r);
    mt__freq_space(&r);
    if (ok && *r.p) { ok = 0; r.err = "text after the expression"; }
    if (ok && r.n == 0) { ok = 0; r.err = "an empty pattern"; }
    if (!ok)
        return mt_fail(err, MT_ERR_ARG, "--moe-layer-freq %s: %s (at offset %d); give an integer or a Python list of 0/1 "
                       "such as \"([0]*3+[1]*29)\" or \"[1,0,1]\"", text, r.err ? r.err : "not a list expression",
                       (int)(r.p - text));
    memcpy(c->moe_layer_pattern, local, (size_t)r.n);
    c->moe_layer_pattern_len = r.n;
    c->moe_layer_freq = 1;
    return MT_OK;
}

/* Every double finite (a NaN passes every < / >= range test below), then the ranges Megatron's
 * optimizer and model accept, for callers of the C API as much as for train_gpt's flags. */
static mt_status mt__config_numbers(const mt_config* c, mt_error* err) {
    struct { const char* name; double v; } reals[] = {
        {"--init-method-std", c->init_method_std}, {"--norm-epsilon", c->norm_epsilon},
        {"--rotary-base", c->rotary_base}, {"--rotary-percent", c->rotary_percent},
        {"--rope-scaling-factor", c->rope_scaling_factor}, {"--hidden-dropout", c->hidden_dropout},
        {"--attention-dropout", c->attention_dropout}, {"--loss-scale", c->loss_scale},
        {"--initial-loss-scale", c->initial_loss_scale}, {"--min-loss-scale", c->min_loss_scale},
        {"--lr", c->lr}, {"--min-lr", c->min_lr}, {"--lr-warmup-init", c->lr_warmup_init},
        {"--lr-warmup-fraction", c->lr_warmup_fraction}, {"--adam-beta1", c->adam_beta1},
        {"--adam-beta2", c->adam_beta2}, {"--adam-eps", c->adam_eps}, {"--weight-decay", c->weight_decay},
        {"--clip-grad", c->clip_grad},
    };
    for (size_t i = 0; i < sizeof(reals) / sizeof(reals[0]); i++)
        if (!isfinite(reals[i].v)) return mt_fail(err, MT_ERR_CONFIG, "%s %g: must be a finite number", reals[i].name,
                                                  reals[i].v);
    if (!(c->adam_eps > 0)) return mt_fail(err, MT_ERR_CONFIG, "--adam-eps %g: must be > 0", c->adam_eps);
    if (c->weight_decay < 0) return mt_fail(err, MT_ERR_CONFIG, "--weight-decay %g: must be >= 0", c->weight_decay);
    if (c->clip_grad < 0) return mt_fail(err, MT_ERR_CONFIG, "--clip-grad %g: must be >= 0", c->clip_grad);
    if (c->init_method_std < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--init-method-std %g: must be >= 0", c->init_method_std);
    if (c->lr_warmup_init < 0) return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-init %g: must be >= 0", c->lr_warmup_init);
    if (c->hidden_dropout < 0 || c->hidden_dropout >= 1 || c->attention_dropout < 0 || c->attention_dropout >= 1)
        return mt_fail(err, MT_ERR_CONFIG, "--hidden-dropout %g and --attention-dropout %g must be in [0, 1)",
                       c->hidden_dropout, c->attention_dropout);
    if (c->lr_warmup_iters < 0 || c->lr_decay_iters < 0 || c->lr_wsd_decay_iters < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-iters, --lr-decay-iters and --lr-wsd-decay-iters must be >= 0");
    if (c->train_samples < 0 || c->lr_warmup_samples < 0 || c->lr_decay_samples < 0 || c->lr_wsd_decay_samples < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--train-samples, --lr-warmup-samples, --lr-decay-samples and "
                       "--lr-wsd-decay-samples must be >= 0");
    return MT_OK;
}

/* The model's shape and flavour, and what Megatron derives from them: the ffn size, the query groups,
 * the kv channels, the rotary channels, the position embeddings. */
static mt_status mt__config_model(mt_config* c, mt_error* err) {
    if (c->num_layers <= 0) return mt_fail(err, MT_ERR_CONFIG, "--num-layers must be positive");
    if (c->hidden_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "--hidden-size must be positive");
    if (c->num_attention_heads <= 0) return mt_fail(err, MT_ERR_CONFIG, "--num-attention-heads must be positive");
    if (c->seq_length <= 0) return mt_fail(err, MT_ERR_CONFIG, "--seq-length must be positive");
    if (c->vocab_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "the vocabulary size must be positive");
    if (c->ffn_hidden_size == 0) { /* Megatron: 4h, or with SwiGLU 2/3 of it rounded down to 64 */
        int64_t ffn = 4 * (int64_t)c->hidden_size;
        if (c->swiglu) ffn = (ffn * 2 / 3) / 64 * 64;
        if (ffn > INT32_MAX)
            return mt_fail(err, MT_ERR_CONFIG, "--hidden-size %d: the derived --ffn-hidden-size %lld exceeds %d",
                           c->hidden_size, (long long)ffn, INT32_MAX);
        c->ffn_hidden_size = (int)ffn;
    }
    if (c->ffn_hidden_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "--ffn-hidden-size must be positive");
    if (c->squared_relu && c->swiglu) /* Megatron: assert not args.swiglu */
        return mt_fail(err, MT_ERR_CONFIG, "--squared-relu and --swiglu exclude each other (one MLP activation)");
    if (c->normalization != MT_NORM_LAYERNORM && c->normalization != MT_NORM_RMSNORM)
        return mt_fail(err, MT_ERR_CONFIG, "--normalization must be LayerNorm or RMSNorm");
    if (c->position_embedding_type != MT_POSITION_LEARNED && c->position_embedding_type != MT_POSITION_ROPE &&
        c->position_embedding_type != MT_POSITION_NONE)
        return mt_fail(err, MT_ERR_CONFIG, "--position-embedding-type must be learned_absolute, rope or none");
    if (c->norm_epsilon <= 0) return mt_fail(err, MT_ERR_CONFIG, "--norm-epsilon must be positive");
    if (c->num_query_groups == 0) c->num_query_groups = c->num_attention_heads;
    if (c->kv_channels == 0) {
        if (c->hidden_size % c->num_attention_heads)
            return mt_fail(err, MT_ERR_CONFIG, "--hidden-size %d is not divisible by --num-attention-heads %d",
                           c->hidden_size, c->num_attention_heads);
        c->kv_channels = c->hidden_size / c->num_attention_heads;
    }
    if (c->num_attention_heads % c->num_query_groups)
        return mt_fail(err, MT_ERR_CONFIG, "--num-attention-heads %d is not divisible by --num-query-groups %d",
                       c->num_attention_heads, c->num_query_groups);
    if (c->kv_channels <= 0) return mt_fail(err, MT_ERR_CONFIG, "--kv-channels must be positive");
    if (c->position_embedding_type == MT_POSITION_ROPE) {
        int rotary = (int)(c->kv_channels * c->rotary_percent);
        if (c->rotary_percent <= 0 || c->rotary_percent > 1 || rotary < 2 || rotary % 2)
            return mt_fail(err, MT_ERR_CONFIG, "--rotary-percent %g of --kv-channels %d must give an even number of "
                           "rotary channels", c->rotary_percent, c->kv_channels);
        if (c->rotary_base <= 0) return mt_fail(err, MT_ERR_CONFIG, "--rotary-base must be positive");
        if (c->use_rope_scaling && c->rope_scaling_factor < 1)
            return mt_fail(err, MT_ERR_CONFIG, "--rope-scaling-factor must be >= 1");
    }
    if (c->max_position_embeddings == 0) c->max_position_embeddings = c->seq_length;
    if (c->seq_length > c->max_position_embeddings)
        return mt_fail(err, MT_ERR_CONFIG, "--seq-length %d exceeds --max-position-embeddings %d", c->seq_length,
                       c->max_position_embeddings);
    return MT_OK;
}

/* The parallel layout: TP and PP against the world, the data-parallel size, what tensor parallelism
 * must divide, sequence parallelism, the padded vocabulary. */
static mt_status mt__config_layout(mt_config* c, mt_error* err) {
    if (c->tensor_model_parallel_size < 1 || c->pipeline_model_parallel_size < 1 || c->context_parallel_size < 1)
        return mt_fail(err, MT_ERR_CONFIG, "parallel sizes must be >= 1");
    if (c->world_size < 1) c->world_size = 1;
    const int64_t model_parallel64 =
        (int64_t)c->tensor_model_parallel_size * c->context_parallel_size * c->pipeline_model_parallel_size;
    if (model_parallel64 > c->world_size)
        return mt_fail(err, MT_ERR_CONFIG, "--tensor-model-parallel-size %d x --context-parallel-size %d x "
                       "--pipeline-model-parallel-size %d exceeds the world size %d", c->tensor_model_parallel_size,
                       c->context_parallel_size, c->pipeline_model_parallel_size, c->world_size);
    int model_parallel = (int)model_parallel64;
    if (c->world_size % model_parallel)
        return mt_fail(err, MT_ERR_CONFIG, "world size %d is not divisible by --tensor-model-parallel-size %d x "
                       "--context-parallel-size %d x --pipeline-model-parallel-size %d", c->world_size,
                       c->tensor_model_parallel_size, c->context_parallel_size, c->pipeline_model_parallel_size);
    c->data_parallel_size = c->world_size / model_parallel;
    if ((unsigned)c->cp_comm_type > MT_CP_ALL_GATHER)
        return mt_fail(err, MT_ERR_CONFIG, "--cp-comm-type %d is not one of p2p, a2a, all_gather", (int)c->cp_comm_type);
    if (c->context_parallel_size > 1 && c->seq_length % (2 * c->context_parallel_size))
        return mt_fail(err, MT_ERR_CONFIG, "--seq-length %d must be divisible by 2 x --context-parallel-size %d (each "
                       "rank keeps two of the sequence's 2 CP chunks)", c->seq_length, c->context_parallel_size);
    int tp = c->tensor_model_parallel_size;
    if (c->num_attention_heads % tp || c->num_query_groups % tp)
        return mt_fail(err, MT_ERR_CONFIG,
                       "--num-attention-heads %d and --num-query-groups %d must be divisible by "
                       "--tensor-model-parallel-size %d", c->num_attention_heads, c->num_query_groups, tp);
    if (c->ffn_hidden_size % tp)
        return mt_fail(err, MT_ERR_CONFIG, "--ffn-hidden-size %d is not divisible by --tensor-model-parallel-size %d",
                       c->ffn_hidden_size, tp);
    if (tp == 1) c->sequence_parallel = 0; /* as Megatron: nothing to split */
    if (c->sequence_parallel && (c->seq_length / c->context_parallel_size) % tp)
        return mt_fail(err, MT_ERR_CONFIG, "--sequence-parallel needs --seq-length %d / --context-parallel-size %d "
                       "divisible by --tensor-model-parallel-size %d", c->seq_length, c->context_parallel_size, tp);
    if (c->make_vocab_size_divisible_by < 1)
        return mt_fail(err, MT_ERR_CONFIG, "--make-vocab-size-divisible-by must be positive");
    {
        int64_t multiple = (int64_t)c->make_vocab_size_divisible_by * c->tensor_model_parallel_size, padded;
        if (mt_add_overflows_i64(c->vocab_size, multiple - 1, &padded))
            return mt_fail(err, MT_ERR_CONFIG, "the vocabulary size %lld (--vocab-size) is too large to pad",
                           (long long)c->vocab_size);
    }
    if (c->resumed_padded_vocab_size < 0)
        return mt_fail(err, MT_ERR_CONFIG, "the resumed checkpoint's padded vocabulary %lld is negative",
                       (long long)c->resumed_padded_vocab_size);
    c->padded_vocab_size = mt_padded_vocab_size_resumed(c->vocab_size, c->make_vocab_size_divisible_by,
                                                        c->tensor_model_parallel_size, c->resumed_padded_vocab_size);
    return MT_OK;
}

/* The batch: micro-batch and global batch (the step schedule's last size, the ramp), and the
 * length of training. */
static mt_status mt__config_batch(mt_config* c, mt_error* err) {
    if (c->micro_batch_size <= 0) return mt_fail(err, MT_ERR_CONFIG, "--micro-batch-size must be positive");
    if (c->global_batch_size < 0) return mt_fail(err, MT_ERR_CONFIG, "--global-batch-size must be positive");
    if ((int64_t)c->micro_batch_size * c->data_parallel_size > INT32_MAX)
        return mt_fail(err, MT_ERR_CONFIG, "--micro-batch-size %d x data-parallel size %d exceeds %d",
                       c->micro_batch_size, c->data_parallel_size, INT32_MAX);
    if (c->num_batch_size_steps > 0) { /* the schedule's last size is the global batch */
        int last = c->batch_size_step_size[c->num_batch_size_steps - 1];
        if (c->global_batch_size == 0) c->global_batch_size = last;
        if (c->global_batch_size != last)
            return mt_fail(err, MT_ERR_CONFIG, "--global-batch-size %d differs from the last batch size %d of "
                           "--step-batch-size-schedule (give one of them, or the same size)", c->global_batch_size, last);
    }
    if (c->global_batch_size == 0) c->global_batch_size = c->micro_batch_size * c->data_parallel_size;
    if (c->global_batch_size % (c->micro_batch_size * c->data_parallel_size))
        return mt_fail(err, MT_ERR_CONFIG,
                       "--global-batch-size %d is not divisible by --micro-batch-size %d x data-parallel size %d",
                       c->global_batch_size, c->micro_batch_size, c->data_parallel_size);
    if (mt_batch_ramp_check(c, err) != MT_OK) return MT_ERR_CONFIG;
    if (mt_training_length_finalize(c, err) != MT_OK) return MT_ERR_CONFIG;
    return MT_OK;
}

/* Mixture of experts: Megatron's refusals (its message where it has one; dev/moe_semantics.md section 3),
 * the ranges, and the expert width Megatron derives (--ffn-hidden-size). What this build does not have
 * yet is mt_config_check_supported's. */
static mt_status mt__config_moe(mt_config* c, mt_error* err) {
    const int E = c->num_experts, k = c->moe_router_topk, G = c->moe_router_num_groups, g = c->moe_router_group_topk;
    const double reals[] = {c->moe_router_topk_scaling_factor, c->moe_aux_loss_coeff[0], c->moe_aux_loss_coeff[1],
                            c->moe_aux_loss_coeff[2], c->moe_z_loss_coeff, c->moe_router_bias_update_rate,
                            c->moe_expert_capacity_factor};
    for (size_t i = 0; i < sizeof(reals) / sizeof(reals[0]); i++)
        if (!isfinite(reals[i]) || reals[i] < 0)
            return mt_fail(err, MT_ERR_CONFIG, "the MoE coefficients (--moe-router-topk-scaling-factor, --moe-aux-loss-coeff, "
                           "--moe-z-loss-coeff, --moe-router-bias-update-rate, --moe-expert-capacity-factor) must be "
                           "finite and >= 0 (got %g)", reals[i]);
    if (E < 0) return mt_fail(err, MT_ERR_CONFIG, "num_moe_experts must be non-negative. (--num-experts %d)", E);
    if (c->expert_model_parallel_size < 1 || c->expert_tensor_parallel_size < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--expert-model-parallel-size %d and --expert-tensor-parallel-size %d must be "
                       ">= 1", c->expert_model_parallel_size, c->expert_tensor_parallel_size);
    if (E == 0) {
        if (c->expert_model_parallel_size > 1)
            return mt_fail(err, MT_ERR_CONFIG, "num_experts must be non None to use expert model parallelism "
                           "(--expert-model-parallel-size %d without --num-experts)", c->expert_model_parallel_size);
        /* what an MoE flag would set, without experts (0 is also "not given" where the default is not 0) */
        const char* given = c->moe_ffn_hidden_size > 0 ? "--moe-ffn-hidden-size"
            : c->moe_layer_pattern_len > 0 || c->moe_layer_freq > 1 ? "--moe-layer-freq"
            : (c->moe_router_topk != 0 && c->moe_router_topk != 2) ? "--moe-router-topk"
            : c->moe_router_score_sigmoid ? "--moe-router-score-function"
            : c->moe_router_pre_softmax ? "--moe-router-pre-softmax"
            : c->moe_router_topk_scaling_factor != 0 ? "--moe-router-topk-scaling-factor"
            : c->moe_router_num_groups || c->moe_router_group_topk ? "--moe-router-num-groups / --moe-router-group-topk"
            : c->moe_load_balancing & ~MT_MOE_AUX_LOSS ? "--moe-router-load-balancing-type"
            : c->moe_aux_loss_coeff[0] != 0 || c->moe_aux_loss_coeff[1] != 0 || c->moe_aux_loss_coeff[2] != 0
                ? "--moe-aux-loss-coeff"
            : c->moe_z_loss_coeff != 0 ? "--moe-z-loss-coeff"
            : c->moe_router_enable_expert_bias ? "--moe-router-enable-expert-bias"
            : c->moe_router_dtype_fp32 ? "--moe-router-dtype"
            : c->moe_expert_capacity_factor != 0 ? "--moe-expert-capacity-factor"
            : c->moe_token_drop_position ? "--moe-token-drop-policy"
            : c->moe_pad_expert_input_to_capacity ? "--moe-pad-expert-input-to-capacity"
            : c->moe_shared_expert_intermediate_size ? "--moe-shared-expert-intermediate-size"
            : c->moe_shared_expert_gate ? "--moe-shared-expert-gate"
            : c->moe_token_dispatcher_alltoall ? "--moe-token-dispatcher-type"
            : c->moe_per_layer_logging ? "--moe-per-layer-logging" : NULL;
        if (given)
            return mt_fail(err, MT_ERR_CONFIG, "%s needs --num-experts (a dense model has no experts)", given);
        return MT_OK;
    }
    if (c->moe_ffn_hidden_size < 0 || c->moe_shared_expert_intermediate_size < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-ffn-hidden-size %d and --moe-shared-expert-intermediate-size %d must be "
                       "positive", c->moe_ffn_hidden_size, c->moe_shared_expert_intermediate_size);
    if (c->moe_ffn_hidden_size == 0) c->moe_ffn_hidden_size = c->ffn_hidden_size; /* Megatron's default */
    /* the layers */
    if (c->moe_layer_pattern_len > 0) {
        if (c->moe_layer_pattern_len != c->num_layers)
            return mt_fail(err, MT_ERR_CONFIG, "Invalid length of moe_layer_pattern: %d, expected %d (--moe-layer-freq "
                           "gives one 0/1 per layer)", c->moe_layer_pattern_len, c->num_layers);
        for (int l = 0; l < c->moe_layer_pattern_len; l++)
            if (c->moe_layer_pattern[l] > 1)
                return mt_fail(err, MT_ERR_CONFIG, "--moe-layer-freq: entry %d of the pattern is %d, not 0 or 1", l,
                               c->moe_layer_pattern[l]);
    } else if (c->moe_layer_freq < 1) {
        return mt_fail(err, MT_ERR_CONFIG, "--moe-layer-freq %d must be >= 1", c->moe_layer_freq);
    }
    if (mt_moe_num_layers(c) == 0)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-layer-freq marks no layer as MoE: drop --num-experts for a dense model");
    /* the router */
    if (k < 1 || k > E)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-router-topk %d must be in [1, --num-experts %d]", k, E);
    if (E % c->expert_model_parallel_size)
        return mt_fail(err, MT_ERR_CONFIG, "Number of experts should be a multiple of expert model parallel_size. "
                       "(--num-experts %d, --expert-model-parallel-size %d)", E, c->expert_model_parallel_size);
    if (k == 1 && !c->moe_router_score_sigmoid && !c->moe_router_pre_softmax)
        return mt_fail(err, MT_ERR_CONFIG, "Please use --moe-router-pre-softmax when topk is 1.");
    if (G < 0 || g < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-router-num-groups %d and --moe-router-group-topk %d must be >= 0", G, g);
    if (g > 0 && G == 0)
        return mt_fail(err, MT_ERR_CONFIG, "When using group limited routing, moe_router_num_groups must be specified.");
    if (G > 0 && E % G)
        return mt_fail(err, MT_ERR_CONFIG, "num_moe_experts (%d) should be divisible by moe_router_num_groups (%d).", E, G);
    if (G > 0 && g == 0)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-router-num-groups %d needs --moe-router-group-topk (group-limited "
                       "routing)", G);
    if (g > G)
        return mt_fail(err, MT_ERR_CONFIG, "moe_router_group_topk (%d) should be smaller than moe_router_num_groups (%d).",
                       g, G);
    if (g > 0 && (k < g || (int64_t)k > (int64_t)g * (E / G))) /* ours: Megatron runs these, to no purpose */
        return mt_fail(err, MT_ERR_CONFIG, "group-limited routing needs --moe-router-group-topk <= --moe-router-topk <= "
                       "group-topk x experts per group (%d <= %d <= %lld): topk // group-topk = 0 scores every group 0, "
                       "and more than the kept groups' experts would pick masked ones", g, k, (long long)g * (E / G));
    if (c->moe_load_balancing & ~(MT_MOE_AUX_LOSS | MT_MOE_SEQ_AUX_LOSS | MT_MOE_GLOBAL_AUX_LOSS))
        return mt_fail(err, MT_ERR_CONFIG, "--moe-router-load-balancing-type: unknown types (bits 0x%x)", c->moe_load_balancing);
    for (int t = 0; t < 3; t++)
        if (!(c->moe_load_balancing & (1 << t)) && c->moe_aux_loss_coeff[t] != 0)
            return mt_fail(err, MT_ERR_CONFIG, "moe_aux_loss_coeff must be a list of the same length as "
                           "moe_router_load_balancing_type (a coefficient %g for %s, which is not selected)",
                           c->moe_aux_loss_coeff[t], t == 0 ? "aux_loss" : t == 1 ? "seq_aux_loss" : "global_aux_loss");
    if (c->moe_router_enable_expert_bias && !c->moe_router_score_sigmoid)
        return mt_fail(err, MT_ERR_CONFIG, "Expert bias for aux-loss-free routing only supports 'sigmoid' and "
                       "'sqrtsoftplus' score functions. Give --moe-router-score-function sigmoid");
    /* capacity */
    if (c->moe_pad_expert_input_to_capacity && !(c->moe_expert_capacity_factor > 0))
        return mt_fail(err, MT_ERR_CONFIG, "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity");
    if (c->moe_pad_expert_input_to_capacity) {
        const int64_t N = (int64_t)c->micro_batch_size * c->seq_length, C = mt_moe_capacity(c, N);
        if (C >= N)
            return mt_fail(err, MT_ERR_CONFIG, "--moe-pad-expert-input-to-capacity with a capacity of %lld tokens >= the "
                           "micro-batch's %lld (--moe-expert-capacity-factor %g): every expert would be padded to all "
                           "tokens (Megatron's alltoall dispatcher fails on it); lower the factor or drop the padding",
                           (long long)C, (long long)N, c->moe_expert_capacity_factor);
    }
    /* the experts */
    if (c->moe_shared_expert_intermediate_size > 0 && c->add_bias_linear)
        return mt_fail(err, MT_ERR_CONFIG, "bias is not supported in the shared experts, please set "
                       "'--disable-bias-linear' instead.");
    if (c->moe_shared_expert_gate && c->moe_shared_expert_intermediate_size == 0)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-shared-expert-gate needs a shared expert "
                       "(--moe-shared-expert-intermediate-size)");
    const int etp = c->expert_tensor_parallel_size > 0 ? c->expert_tensor_parallel_size : c->tensor_model_parallel_size;
    if (c->add_bias_linear && etp != 1)
        return mt_fail(err, MT_ERR_CONFIG, "Bias in Moe is only supported when ETP==1 (--expert-tensor-parallel-size %d; "
                       "give --disable-bias-linear)", etp);
    if (c->moe_ffn_hidden_size % etp || c->moe_shared_expert_intermediate_size % c->tensor_model_parallel_size)
        return mt_fail(err, MT_ERR_CONFIG, "--moe-ffn-hidden-size %d must divide by the expert tensor-parallel size %d and "
                       "--moe-shared-expert-intermediate-size %d by --tensor-model-parallel-size %d",
                       c->moe_ffn_hidden_size, etp, c->moe_shared_expert_intermediate_size, c->tensor_model_parallel_size);
    if (c->tensor_model_parallel_size > 1 && !c->sequence_parallel)
        return mt_fail(err, MT_ERR_CONFIG, "During training, performance may degrade if MoE and tensor parallelism are "
                       "enabled without also enabling sequence parallelism. (give --sequence-parallel)");
    return MT_OK;
}

/* The pipeline: virtual stages from either flag, the layer split, the schedule of a training step;
 * and (check_supported) what this build lacks. */
static mt_status mt__config_pipeline(mt_config* c, int check_supported, mt_error* err) {
    if (c->virtual_pipeline_size < 1) c->virtual_pipeline_size = 1;
    if (c->num_layers_per_virtual_pipeline_stage > 0) {
        int64_t per_rank = (int64_t)c->pipeline_model_parallel_size * c->num_layers_per_virtual_pipeline_stage;
        if (c->virtual_pipeline_size > 1)
            return mt_fail(err, MT_ERR_CONFIG, "give --num-layers-per-virtual-pipeline-stage or "
                           "--num-virtual-stages-per-pipeline-rank, not both");
        if (c->num_layers % per_rank)
            return mt_fail(err, MT_ERR_CONFIG, "--num-layers %d is not divisible by --pipeline-model-parallel-size %d x "
                           "--num-layers-per-virtual-pipeline-stage %d", c->num_layers,
                           c->pipeline_model_parallel_size, c->num_layers_per_virtual_pipeline_stage);
        c->virtual_pipeline_size = (int)(c->num_layers / per_rank);
    }
    if (c->microbatch_group_size_per_vp_stage < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--microbatch-group-size-per-virtual-pipeline-stage must be positive");
    /* what this build lacks, once the sizes it looks at are derived (before the layer split, which
     * an uneven split with virtual stages would fail with a less useful line) */
    if (check_supported && mt_config_check_supported(c, err) != MT_OK) return MT_ERR_CONFIG;
    if (mt_pp_stage_of(c, 0, NULL, err) != MT_OK) return MT_ERR_CONFIG;
    if (c->pipeline_model_parallel_size > 1 &&
        mt_pp_schedule_check(c->pipeline_model_parallel_size, c->virtual_pipeline_size, mt_num_micro_batches(c),
                             c->microbatch_group_size_per_vp_stage, err) != MT_OK)
        return MT_ERR_CONFIG;
    return MT_OK;
}

/* The learning rates: peak and minimum, the decoupled pair, the warm-up fraction. */
static mt_status mt__config_rates(const mt_config* c, mt_error* err) {
    if (c->lr < 0 || c->min_lr < 0) return mt_fail(err, MT_ERR_CONFIG, "learning rates must be >= 0");
    if (c->min_lr > c->lr) return mt_fail(err, MT_ERR_CONFIG, "--min-lr %g exceeds --lr %g", c->min_lr, c->lr);
    if (!isfinite(c->decoupled_lr) || !isfinite(c->decoupled_min_lr))
        return mt_fail(err, MT_ERR_CONFIG, "--decoupled-lr %g, --decoupled-min-lr %g: must be finite numbers",
                       c->decoupled_lr, c->decoupled_min_lr);
    if (c->decoupled_min_lr >= 0 && c->decoupled_lr < 0)
        return mt_fail(err, MT_ERR_CONFIG, "--decoupled-min-lr %g needs --decoupled-lr (it has no effect alone)",
                       c->decoupled_min_lr);
    if (c->decoupled_lr >= 0 && (c->decoupled_min_lr >= 0 ? c->decoupled_min_lr : c->min_lr) > c->decoupled_lr)
        return mt_fail(err, MT_ERR_CONFIG, "the decoupled minimum learning rate %g exceeds --decoupled-lr %g",
                       c->decoupled_min_lr >= 0 ? c->decoupled_min_lr : c->min_lr, c->decoupled_lr);
    if (c->lr_warmup_fraction >= 0 && c->lr_warmup_iters > 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-fraction and --lr-warmup-iters are mutually exclusive");
    if (c->lr_warmup_fraction >= 0 && c->lr_warmup_samples > 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-fraction and --lr-warmup-samples are mutually exclusive");
    if (c->lr_warmup_fraction > 1.0) return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-fraction must be <= 1");
    return MT_OK;
}

/* The schedule's lengths: warm-up within the decay, WSD's annealing tail. */
static mt_status mt__config_schedule_lengths(const mt_config* c, mt_error* err) {
    if (c->lr_warmup_iters > c->lr_decay_iters)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-iters %lld exceeds --lr-decay-iters %lld",
                       (long long)c->lr_warmup_iters, (long long)c->lr_decay_iters);
    if (c->lr_warmup_samples > c->lr_decay_samples)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-warmup-samples %lld exceeds --lr-decay-samples %lld",
                       (long long)c->lr_warmup_samples, (long long)c->lr_decay_samples);
    if (c->lr_decay_style == MT_LR_WSD && c->lr_wsd_decay_iters <= 0 && c->lr_wsd_decay_samples <= 0)
        return mt_fail(err, MT_ERR_CONFIG, "--lr-decay-style WSD needs --lr-wsd-decay-iters (--lr-wsd-decay-samples "
                       "with --train-samples)");
    return MT_OK;
}

/* Adam, the fp16 loss scale, the DDP's overlap and buckets, optimizer offload. */
static mt_status mt__config_optimizer(const mt_config* c, mt_error* err) {
    if (c->adam_beta1 < 0 || c->adam_beta1 >= 1 || c->adam_beta2 < 0 || c->adam_beta2 >= 1)
        return mt_fail(err, MT_ERR_CONFIG, "Adam betas must be in [0, 1)");
    if (c->precision == MT_FP16 && c->loss_scale <= 0 && c->initial_loss_scale <= 0)
        return mt_fail(err, MT_ERR_CONFIG, "--initial-loss-scale must be positive");
    if (c->grad_reduce_in_bf16 && c->precision != MT_BF16)
        return mt_fail(err, MT_ERR_CONFIG, "--grad-reduce-in-bf16 needs --bf16 (it reduces the gradients of a bf16 model in "
                       "bf16)");
    if (c->overlap_param_gather && !c->use_distributed_optimizer)
        return mt_fail(err, MT_ERR_CONFIG, "--overlap-param-gather needs --use-distributed-optimizer");
    if (c->overlap_param_gather && !c->overlap_grad_reduce)
        return mt_fail(err, MT_ERR_CONFIG, "--overlap-param-gather needs --overlap-grad-reduce");
    if (c->ddp_bucket_size < 0) return mt_fail(err, MT_ERR_CONFIG, "--ddp-bucket-size must be positive");
    if (!(c->optimizer_offload_fraction >= 0.0 && c->optimizer_offload_fraction <= 1.0))
        return mt_fail(err, MT_ERR_CONFIG, "--optimizer-offload-fraction %g: must be in [0, 1]",
                       c->optimizer_offload_fraction);
    return MT_OK;
}

/* Activation recompute (--recompute-*), as Megatron's arguments take it. */
static mt_status mt__config_recompute(const mt_config* c, mt_error* err) {
    const mt_recompute* rc = &c->recompute;
    if (rc->granularity < MT_RECOMPUTE_NONE || rc->granularity > MT_RECOMPUTE_FULL || rc->method < MT_RECOMPUTE_UNIFORM ||
        rc->method > MT_RECOMPUTE_BLOCK || rc->modules < 0 || rc->modules > 63)
        return mt_fail(err, MT_ERR_CONFIG, "recompute: an unknown granularity, method or module");
    if (rc->granularity != MT_RECOMPUTE_FULL && rc->num_layers != 0)
        return mt_fail(err, MT_ERR_CONFIG, "--recompute-num-layers %d goes with --recompute-granularity full", rc->num_layers);
    if (rc->granularity != MT_RECOMPUTE_SELECTIVE && rc->modules != 0)
        return mt_fail(err, MT_ERR_CONFIG, "--recompute-modules goes with --recompute-granularity selective");
    if ((rc->modules & MT_RECOMPUTE_MOE_ACT) && !c->moe_grouped_gemm)
        return mt_fail(err, MT_ERR_CONFIG, "moe_act in recompute_modules is only supported with moe_grouped_gemm.");
    if (rc->granularity == MT_RECOMPUTE_FULL &&
        (rc->num_layers < 0 || rc->num_layers > c->num_layers / c->pipeline_model_parallel_size))
        return mt_fail(err, MT_ERR_CONFIG, "--recompute-num-layers %d: must be between 1 and the layers per pipeline rank "
                       "(%d)", rc->num_layers, c->num_layers / c->pipeline_model_parallel_size);
    return MT_OK;
}

/* The launch: the watchdog's timeout, this process's rank in the world. */
static mt_status mt__config_launch(const mt_config* c, mt_error* err) {
    if (!(c->distributed_timeout_minutes > 0.0 && c->distributed_timeout_minutes <= 1e6))
        return mt_fail(err, MT_ERR_CONFIG, "--distributed-timeout-minutes %g: must be in (0, 1e6]",
                       c->distributed_timeout_minutes);
    if (c->rank < 0 || c->rank >= c->world_size)
        return mt_fail(err, MT_ERR_CONFIG, "rank %d outside a world of %d", c->rank, c->world_size);
    return MT_OK;
}

/* check_supported 0: only Megatron's consistency (--plan-layouts classifies each layout it plans with
 * mt_config_check_supported itself, to show a refused one with its reason) */
static mt_status mt__config_finalize(mt_config* c, int check_supported, mt_error* err) {
    /* in this order: a later step reads what an earlier one derived */
    if (mt__config_numbers(c, err) != MT_OK || mt__config_model(c, err) != MT_OK ||
        mt__config_layout(c, err) != MT_OK || mt__config_batch(c, err) != MT_OK || mt__config_moe(c, err) != MT_OK ||
        mt__config_pipeline(c, check_supported, err) != MT_OK || mt__config_rates(c, err) != MT_OK ||
        mt_config_size_check(c, err) != MT_OK || mt_fp8_config_check(c, err) != MT_OK ||
        mt__config_schedule_lengths(c, err) != MT_OK || mt__config_optimizer(c, err) != MT_OK ||
        mt__config_recompute(c, err) != MT_OK || mt__config_launch(c, err) != MT_OK)
        return MT_ERR_CONFIG;
    return MT_OK;
}

MT_DEF mt_status mt_config_finalize(mt_config* c, mt_error* err) { return mt__config_finalize(c, 1, err); }

static const char* mt__getenv(const char* name, void* user) {
    (void)user;
    return getenv(name);
}

MT_DEF int mt_launcher_world_size(mt_env_lookup lookup, void* user, const char** source) {
    static const char* const names[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"};
    if (!lookup) lookup = mt__getenv;
    int64_t most = 1;
    if (source) *source = NULL;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        const char* v = lookup(names[i], user);
        if (!v || !*v) continue;
        char* end = NULL;
        errno = 0;
        long long n = strtoll(v, &end, 10);
        if (*end || errno || n <= most || n > (1 << 24)) continue; /* not a count, or not more ranks */
        most = n;
        if (source) *source = names[i];
    }
    return (int)most;
}

MT_DEF mt_status mt_launcher_check(int world, int built_with_mpi, mt_env_lookup lookup, void* user, mt_error* err) {
    const char* source = NULL;
    int launched = mt_launcher_world_size(lookup, user, &source);
    if (launched <= 1 || launched == world) return MT_OK;
    if (!built_with_mpi)
        return mt_fail(err, MT_ERR_CONFIG, "%s=%d says the launcher started %d processes, but this binary was built "
                       "without MPI (make found no mpicc): each process would train alone on GPU 0 and write the same "
                       "--save directory. Install an MPI (mpicc on the PATH), rebuild (make clean && make), or start "
                       "one process", source, launched, launched);
    return mt_fail(err, MT_ERR_CONFIG, "%s=%d says the launcher started %d processes, but MPI sees %d: the launcher "
                   "is not the one of the MPI this binary was built with (use that MPI's mpirun, or srun with its PMI "
                   "plugin; torchrun does not start MPI ranks)", source, launched, launched, world);
}

MT_DEF int mt_num_micro_batches(const mt_config* c) {
    return c->global_batch_size / (c->micro_batch_size * c->data_parallel_size);
}

/* Megatron's OptimizerParamScheduler.get_lr: linear warmup from lr_warmup_init, then the decay
 * style down to min_lr at the decay length, min_lr after. All lengths are in samples: the -iters
 * flags times the global batch, or the -samples flags with --train-samples; a warmup fraction of
 * the decay length is kept fractional, as in Python. */
/* Megatron's OptimizerParamScheduler.get_lr for one parameter group's peak and minimum. */
static double mt__learning_rate(const mt_config* c, int64_t num_steps, double max_lr, double min_lr) {
    const double pi = 3.14159265358979323846;
    int64_t gbs = c->global_batch_size;
    int sample_based = c->train_samples > 0;
    int64_t decay_steps = sample_based ? c->lr_decay_samples : c->lr_decay_iters * gbs;
    double warmup_steps = c->lr_warmup_fraction >= 0 ? c->lr_warmup_fraction * (double)decay_steps
                          : (double)(sample_based ? c->lr_warmup_samples : c->lr_warmup_iters * gbs);
    if (warmup_steps > 0 && (double)num_steps <= warmup_steps)
        return c->lr_warmup_init + (max_lr - c->lr_warmup_init) * (double)num_steps / warmup_steps;
    if (c->lr_decay_style == MT_LR_CONSTANT) return max_lr;
    if (num_steps > decay_steps) return min_lr;
    if (c->lr_decay_style == MT_LR_INVERSE_SQUARE_ROOT) {
        double warmup = warmup_steps > 1.0 ? warmup_steps : 1.0;
        double lr = max_lr * sqrt(warmup) / sqrt(num_steps > 0 ? (double)num_steps : 1.0);
        return lr > min_lr ? lr : min_lr;
    }
    double ratio = ((double)num_steps - warmup_steps) / ((double)decay_steps - warmup_steps);
    double coeff;
    if (c->lr_decay_style == MT_LR_LINEAR) {
        coeff = 1.0 - ratio;
    } else if (c->lr_decay_style == MT_LR_COSINE) {
        coeff = 0.5 * (cos(pi * ratio) + 1.0);
    } else { /* WSD: constant until the annealing tail, then the tail's shape down to min_lr */
        int64_t anneal_steps = sample_based ? c->lr_wsd_decay_samples : c->lr_wsd_decay_iters * gbs;
        int64_t stable_end = decay_steps - anneal_steps;
        if (num_steps <= stable_end) {
            coeff = 1.0;
        } else {
            double r = (double)(num_steps - stable_end) / (double)anneal_steps;
            switch (c->lr_wsd_decay_style) {
                case MT_WSD_LINEAR: coeff = 1.0 - r; break;
                case MT_WSD_COSINE: coeff = 0.5 * (cos(pi * r) + 1.0); break;
                case MT_WSD_MINUS_SQRT: coeff = 1.0 - sqrt(r); break;
                default: coeff = 2.0 * pow(0.5, r) - 1.0; break; /* exponential: 1 at the start, 0 at the end */
            }
        }
    }
    return min_lr + coeff * (max_lr - min_lr);
}

MT_DEF double mt_learning_rate(const mt_config* c, int64_t num_steps) {
    return mt__learning_rate(c, num_steps, c->lr, c->min_lr);
}

MT_DEF double mt_learning_rate_decoupled(const mt_config* c, int64_t num_steps) {
    if (c->decoupled_lr < 0) return mt_learning_rate(c, num_steps);
    return mt__learning_rate(c, num_steps, c->decoupled_lr, c->decoupled_min_lr >= 0 ? c->decoupled_min_lr : c->min_lr);
}

MT_DEF int mt_param_lr_decoupled(int tensor) { return tensor == MT_P_WORD_EMBEDDINGS || tensor == MT_P_OUTPUT_WEIGHT; }

/* training.py:num_floating_point_operations (no MTP): 3 passes (forward, dgrad, wgrad) x 2
 * (multiply-add) over every GEMM, causal attention halved, plus the logits. The MLP: the dense layers'
 * f, each MoE layer's top-k experts of width fe and its shared expert of width fs (the router's GEMM is
 * not counted, as in Megatron). */
MT_DEF double mt_flops_per_iteration(const mt_config* c, int64_t batch) {
    double s = c->seq_length, h = c->hidden_size, L = c->num_layers, V = (double)c->padded_vocab_size;
    double n = c->num_attention_heads, g = c->num_query_groups, d = c->kv_channels, f = c->ffn_hidden_size;
    double mlp_factor = c->swiglu ? 3.0 : 2.0; /* two GEMMs, or three with SwiGLU's gate */
    double Lm = mt_moe_num_layers(c), Ld = L - Lm, k = Lm > 0 ? c->moe_router_topk : 0;
    double fe = Lm > 0 ? (double)mt_moe_ffn(c) : 0, fs = Lm > 0 ? c->moe_shared_expert_intermediate_size : 0;
    double mlp = f * mlp_factor * Ld + fe * k * mlp_factor * Lm + fs * mlp_factor * Lm;
    double tokens = (double)batch * s;
    return tokens * (6.0 * h * mlp + 6.0 * (h * (n * d + 2.0 * g * d) + n * d * h) * L + 6.0 * h * V) +
           (double)batch * s * s * 6.0 * n * d * L;
}

MT_DEF int64_t mt_num_parameters(const mt_config* c) { return mt_param_layout(c, NULL); }

/* 6. Parameter tensors and tensor-parallel shards ---------------------------------------------- */

/* The layout at a tensor-parallel size of tp (1: the full model). Each tensor is given per layer as
 * [outer, rows, inner] with the rows cut over TP when split (see mt_param_info). */
static int64_t mt__param_layout_tp(const mt_config* c, int tp, int ep, mt_param_info* info) {
    int64_t L = c->num_layers, h = c->hidden_size, f = c->ffn_hidden_size;
    int64_t qkv = ((int64_t)c->num_attention_heads + 2 * (int64_t)c->num_query_groups) * c->kv_channels;
    int64_t attn = (int64_t)c->num_attention_heads * c->kv_channels;
    int64_t ln_bias = c->normalization == MT_NORM_LAYERNORM, bias = c->add_bias_linear != 0;
    int64_t positions = c->position_embedding_type == MT_POSITION_LEARNED ? c->max_position_embeddings : 0;
    int64_t V = c->padded_vocab_size, untied = c->untie_embeddings_and_output_weights != 0;
    int64_t glu = c->swiglu ? 2 : 1, qk = c->qk_layernorm != 0, d = c->kv_channels;
    int norm_w = c->apply_layernorm_1p ? 0 : 1; /* --apply-layernorm-1p: the weights hold w - 1, from 0 */
    /* MoE: the dense MLP's tensors over the Ld dense layers, the MoE tensors over the Lm MoE layers */
    const int64_t Lm = mt_moe_num_layers(c), Ld = L - Lm, E = c->num_experts > 0 ? c->num_experts : 0;
    const int64_t fe = mt_moe_ffn(c), fs = c->moe_shared_expert_intermediate_size > 0 ? c->moe_shared_expert_intermediate_size : 0;
    const int64_t shared = fs > 0, gate = shared && c->moe_shared_expert_gate;
    struct { const char* name; int64_t layers, outer, rows, inner; int split, wd, init; } t[MT_NUM_PARAM_TENSORS] = {
        /* (the experts' tensors, expert_fc1/fc2 weight and bias, are also cut over EP by their outer dimension) */
        /* name                 layers        outer rows       inner split wd init */
        {"word_embeddings",     1,            1,    V,         h,    1, 1, 2},
        {"position_embeddings", 1,            1,    positions, h,    0, 1, 2},
        {"ln1_weight",          L,            1,    h,         1,    0, 0, norm_w},
        {"ln1_bias",            ln_bias * L,  1,    h,         1,    0, 0, 0},
        {"qkv_weight",          L,            1,    qkv,       h,    1, 1, 2}, /* groups are whole row blocks */
        {"qkv_bias",            bias * L,     1,    qkv,       1,    1, 0, 0},
        {"q_layernorm_weight",  qk * L,       1,    d,         1,    0, 0, norm_w}, /* whole on every TP rank */
        {"q_layernorm_bias",    qk * ln_bias * L, 1, d,        1,    0, 0, 0},
        {"k_layernorm_weight",  qk * L,       1,    d,         1,    0, 0, norm_w},
        {"k_layernorm_bias",    qk * ln_bias * L, 1, d,        1,    0, 0, 0},
        {"proj_weight",         L,            h,    attn,      1,    1, 1, 3},
        {"proj_bias",           bias * L,     1,    h,         1,    0, 0, 0},
        {"ln2_weight",          L,            1,    h,         1,    0, 0, norm_w},
        {"ln2_bias",            ln_bias * L,  1,    h,         1,    0, 0, 0},
        {"fc1_weight",          Ld,           glu,  f,         h,    1, 1, 2},
        {"fc1_bias",            bias * Ld,    glu,  f,         1,    1, 0, 0},
        {"fc2_weight",          Ld,           h,    f,         1,    1, 1, 3},
        {"fc2_bias",            bias * Ld,    1,    h,         1,    0, 0, 0},
        {"router_weight",       Lm,           1,    E,         h,    0, 1, 2}, /* whole on every TP rank */
        {"router_bias",         bias * Lm,    1,    E,         1,    0, 0, 2}, /* normal(std), as Megatron's router */
        {"expert_fc1_weight",   Lm,           E * glu, fe,     h,    1, 1, 2}, /* each expert as fc1 */
        {"expert_fc1_bias",     bias * Lm,    E * glu, fe,     1,    1, 0, 0},
        {"expert_fc2_weight",   Lm,           E * h, fe,       1,    1, 1, 3}, /* each expert as fc2 */
        {"expert_fc2_bias",     bias * Lm,    E,    h,         1,    0, 0, 0},
        {"shared_fc1_weight",   shared * Lm,  glu,  fs,        h,    1, 1, 2},
        {"shared_fc2_weight",   shared * Lm,  h,    fs,        1,    1, 1, 3},
        {"shared_gate_weight",  gate * Lm,    1,    h,         1,    0, 1, 2},
        {"final_ln_weight",     1,            1,    h,         1,    0, 0, norm_w},
        {"final_ln_bias",       ln_bias,      1,    h,         1,    0, 0, 0},
        {"output_weight",       untied,       1,    V,         h,    1, 1, 2},
    };
    int64_t offset = 0;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        const int ep_split = i >= MT_P_EXPERT_FC1_WEIGHT && i <= MT_P_EXPERT_FC2_BIAS;
        int64_t rows = t[i].split ? t[i].rows / tp : t[i].rows;
        int64_t numel = t[i].layers * (ep_split ? t[i].outer / ep : t[i].outer) * rows * t[i].inner;
        if (info) {
            info[i].name = t[i].name;
            info[i].numel = numel;
            info[i].offset = offset;
            info[i].weight_decay = t[i].wd;
            info[i].init = t[i].init;
            info[i].tp_split = t[i].split;
            info[i].split_outer = t[i].outer;
            info[i].split_rows = t[i].rows;
            info[i].split_inner = t[i].inner;
            info[i].ep_split = ep_split;
        }
        offset += numel;
    }
    return offset;
}

MT_DEF int64_t mt_param_layout(const mt_config* c, mt_param_info* info) { return mt__param_layout_tp(c, 1, 1, info); }

MT_DEF int mt_param_layer_has(const mt_config* c, int tensor, int layer) {
    if (!mt_param_per_layer(tensor) || layer < 0 || layer >= c->num_layers) return 0;
    if (mt_param_moe(tensor)) return mt_moe_layer(c, layer);
    if (tensor >= MT_P_FC1_WEIGHT && tensor <= MT_P_FC2_BIAS) return !mt_moe_layer(c, layer);
    return 1;
}

MT_DEF int64_t mt_param_layout_shard(const mt_config* c, mt_param_info* info) {
    return mt__param_layout_tp(c, c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1,
                               c->num_experts > 0 && c->expert_model_parallel_size > 0 ? c->expert_model_parallel_size : 1,
                               info);
}

MT_DEF void mt_tp_rows(const mt_param_info* full, int tp, int tp_rank, int64_t* rows, int64_t* row0) {
    *rows = full->tp_split ? full->split_rows / tp : full->split_rows;
    *row0 = full->tp_split ? (int64_t)tp_rank * *rows : 0;
}

MT_DEF void mt_ep_outer(const mt_param_info* full, int ep, int ep_rank, int64_t* outer, int64_t* outer0) {
    *outer = full->ep_split ? full->split_outer / ep : full->split_outer;
    *outer0 = full->ep_split ? (int64_t)ep_rank * *outer : 0;
}

MT_DEF void mt_tp_shard_copy(const mt_config* c, int shard_rank, float* full, float* shard, int to_shard) {
    mt_param_info whole[MT_NUM_PARAM_TENSORS], part[MT_NUM_PARAM_TENSORS];
    mt_param_layout(c, whole);
    mt_param_layout_shard(c, part);
    int tp = c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1;
    int ep = c->num_experts > 0 && c->expert_model_parallel_size > 0 ? c->expert_model_parallel_size : 1;
    const int tp_rank = shard_rank % tp, ep_rank = shard_rank / tp;
    for (int i = 0; i < MT_NUM_PARAM_TENSORS; i++) {
        if (part[i].numel == 0) continue;
        int64_t per_layer_full = whole[i].split_outer * whole[i].split_rows * whole[i].split_inner;
        int64_t layers = whole[i].numel / per_layer_full, per_layer = part[i].numel / layers;
        int64_t rows, row0, outer, outer0;
        mt_tp_rows(&whole[i], tp, tp_rank, &rows, &row0);
        mt_ep_outer(&whole[i], ep, ep_rank, &outer, &outer0);
        for (int64_t l = 0; l < layers; l++)
            for (int64_t j = 0; j < per_layer; j++) {
                float* a = full + whole[i].offset + l * per_layer_full +
                           mt_shard_full_index(j, rows, whole[i].split_inner, whole[i].split_rows, row0, outer0);
                float* b = shard + part[i].offset + l * per_layer + j;
                if (to_shard) *b = *a;
                else *a = *b;
            }
    }
}

/* 7. Rank layout and pipeline stages (the layer split) ----------------------------------------- */

static int mt__cp_size(const mt_config* c) { return c->context_parallel_size > 1 ? c->context_parallel_size : 1; }

MT_DEF mt_rank_coords mt_rank_coordinates(const mt_config* c, int rank) {
    mt_rank_coords r;
    int tp = c->tensor_model_parallel_size, dp = c->data_parallel_size, cp = mt__cp_size(c);
    r.tp = rank % tp;
    r.cp = (rank / tp) % cp;
    r.dp = (rank / (tp * cp)) % dp;
    r.pp = rank / (tp * cp * dp);
    r.dpcp = r.cp + cp * r.dp;
    const int ep = c->num_experts > 0 && c->expert_model_parallel_size > 1 ? c->expert_model_parallel_size : 1;
    r.ep = r.dp % ep;
    r.edp = r.dp / ep;
    return r;
}

MT_DEF int mt_rank_of(const mt_config* c, mt_rank_coords r) {
    const int cp = mt__cp_size(c);
    return r.tp + c->tensor_model_parallel_size * (r.cp + cp * (r.dp + c->data_parallel_size * r.pp));
}

MT_DEF int mt_grad_dp_size(const mt_config* c) {
    return (c->data_parallel_size > 0 ? c->data_parallel_size : 1) * mt__cp_size(c);
}

MT_DEF int mt_cp_position(const mt_config* c, int cp_rank, int i) {
    const int cp = mt__cp_size(c);
    if (cp == 1) return i;
    const int C = c->seq_length / (2 * cp);
    return i < C ? cp_rank * C + i : (2 * cp - 1 - cp_rank) * C + (i - C);
}


/* A pipeline rank's tensors: numel set to 0 in info[] for the rest (the last stage's word embeddings
 * only while tied); returns how many layers it holds. */
static int mt__pp_held(const mt_pp_stage* st, int L, mt_param_info* info) {
    int held_layers = 0;
    for (int l = 0; l < L; l++) held_layers += mt_pp_holds(st, MT_P_LN1_WEIGHT, l);
    for (int tsr = 0; tsr < MT_NUM_PARAM_TENSORS; tsr++) {
        int keep = mt_param_per_layer(tsr) ? held_layers > 0 : mt_pp_holds(st, tsr, 0);
        if (tsr == MT_P_WORD_EMBEDDINGS && !st->embedding && info[MT_P_OUTPUT_WEIGHT].numel > 0) keep = 0;
        if (!keep) info[tsr].numel = 0;
    }
    return held_layers;
}

MT_DEF void mt_pp_stage_copy(const mt_config* c, const mt_pp_stage* st, float* full, float* part, int to_part) {
    mt_param_info all[MT_NUM_PARAM_TENSORS], held[MT_NUM_PARAM_TENSORS];
    mt_param_layout_shard(c, all);
    memcpy(held, all, sizeof(all));
    int L = c->num_layers;
    mt__pp_held(st, L, held);
    int64_t at = 0;
    for (int tsr = 0; tsr < MT_NUM_PARAM_TENSORS; tsr++) {
        if (held[tsr].numel == 0) continue;
        int layered = mt_param_per_layer(tsr);
        /* a per-layer tensor is stacked over the layers that have it (mt_param_layer_has: an MoE model's
         * MoE tensors over its MoE layers, its dense MLP's over the others) */
        int64_t stacked = 0, row = 0;
        for (int l = 0; layered && l < L; l++) stacked += mt_param_layer_has(c, tsr, l);
        if (layered && stacked == 0) continue;
        int64_t per = layered ? all[tsr].numel / stacked : all[tsr].numel;
        for (int l = 0; l < (layered ? L : 1); l++) {
            if (layered && !mt_param_layer_has(c, tsr, l)) continue;
            const int64_t at_row = row++;
            if (layered && !mt_pp_holds(st, tsr, l)) continue;
            float* f = full + all[tsr].offset + at_row * per;
            if (to_part) memcpy(part + at, f, sizeof(float) * (size_t)per);
            else memcpy(f, part + at, sizeof(float) * (size_t)per);
            at += per;
        }
    }
}
MT_DEF void mt_pp_tp_part_to_full(const mt_config* c, const mt_pp_stage* st, int tp_rank, const float* part,
                                  float* full, float* scratch) {
    mt_tp_shard_copy(c, tp_rank, full, scratch, 1);   /* the shard as full has it: the other stages' elements */
    mt_pp_stage_copy(c, st, scratch, (float*)part, 0); /* this stage's, from part */
    mt_tp_shard_copy(c, tp_rank, full, scratch, 0);
}

/* Layers of virtual stage v (of PP * VP) under cfg's split; -1 when the split is impossible. */
static int mt__pp_stage_layers(const mt_config* c, int v) {
    int pp = c->pipeline_model_parallel_size, vp = c->virtual_pipeline_size > 0 ? c->virtual_pipeline_size : 1;
    int L = c->num_layers;
    int stages = pp * vp;
    int first = c->decoder_first_pipeline_num_layers, last = c->decoder_last_pipeline_num_layers;
    if (first >= 0 || last >= 0) { /* uneven (VP = 1): the middle stages share what is left evenly */
        int middle = pp - (first >= 0) - (last >= 0);
        int64_t rest = (int64_t)L - (first > 0 ? first : 0) - (last > 0 ? last : 0); /* flags up to 2^31 - 1 */
        if (v == 0 && first >= 0) return first;
        if (v == pp - 1 && last >= 0) return last;
        if (middle <= 0 || rest < 0 || rest % middle || rest / middle == 0) return -1; /* no empty middle stage */
        return (int)(rest / middle);
    }
    int e = c->account_for_embedding_in_pipeline_split != 0, l = c->account_for_loss_in_pipeline_split != 0;
    int total = L + e + l;
    if (total % stages) return -1;
    int per = total / stages;
    return per - (v == 0 ? e : 0) - (v == stages - 1 ? l : 0);
}

MT_DEF mt_status mt_pp_stage_of(const mt_config* c, int pp_rank, mt_pp_stage* out, mt_error* err) {
    int pp = c->pipeline_model_parallel_size, vp = c->virtual_pipeline_size > 0 ? c->virtual_pipeline_size : 1;
    int L = c->num_layers;
    if (pp < 1 || vp < 1 || vp > MT_PP_MAX_CHUNKS || (vp > 1 && pp == 1))
        return mt_fail(err, MT_ERR_CONFIG, "pipeline: %d virtual stages per rank over %d stages (virtual stages need "
                       "--pipeline-model-parallel-size > 1 and at most %d per rank)", vp, pp, MT_PP_MAX_CHUNKS);
    if (pp_rank < 0 || pp_rank >= pp)
        return mt_fail(err, MT_ERR_RANGE, "pipeline rank %d outside [0, %d)", pp_rank, pp);
    if ((int64_t)pp * vp > (int64_t)L + 2) /* every virtual stage but the first and last builds a layer */
        return mt_fail(err, MT_ERR_CONFIG, "pipeline: %d stages x %d virtual stages exceed the %d layers", pp, vp, L);
    /* an uneven split with virtual stages is not built (mt_config_check_supported refuses it; here its
     * stages would not add up to the layers, refused below) */
    int uneven = c->decoder_first_pipeline_num_layers >= 0 || c->decoder_last_pipeline_num_layers >= 0;
    if (uneven && (c->account_for_embedding_in_pipeline_split || c->account_for_loss_in_pipeline_split))
        return mt_fail(err, MT_ERR_CONFIG, "--decoder-first/last-pipeline-num-layers and --account-for-*-in-pipeline-"
                       "split are exclusive (as in Megatron)");
    if (uneven && pp == 1)
        return mt_fail(err, MT_ERR_CONFIG, "--decoder-first/last-pipeline-num-layers need "
                       "--pipeline-model-parallel-size > 1 (with one stage they would change the model)");
    int stages = pp * vp, first = 0, sum = 0;
    if (out) memset(out, 0, sizeof(*out));
    for (int v = 0; v < stages; v++) {
        int n = mt__pp_stage_layers(c, v);
        if (n < 0)
            return mt_fail(err, MT_ERR_CONFIG, "pipeline: %d layers%s do not split evenly over %d %sstages", L,
                           uneven ? " (less the first/last stage's)" : "", uneven ? pp - (c->decoder_first_pipeline_num_layers >= 0) -
                           (c->decoder_last_pipeline_num_layers >= 0) : stages, vp > 1 ? "virtual " : "");
        if (out && v % pp == pp_rank) {
            out->first_layer[v / pp] = first;
            out->num_layers[v / pp] = n;
        }
        first += n;
        sum += n;
    }
    if (sum != L)
        return mt_fail(err, MT_ERR_CONFIG, "pipeline: the stages' layers add up to %d, not --num-layers %d", sum, L);
    if (out) {
        out->num_chunks = vp;
        out->embedding = pp_rank == 0;
        out->head = pp_rank == pp - 1;
    }
    return MT_OK;
}

MT_DEF int mt_pp_holds(const mt_pp_stage* st, int tensor, int layer) {
    switch (tensor) {
        case MT_P_WORD_EMBEDDINGS: return st->embedding || st->head; /* the head's copy only while tied */
        case MT_P_POSITION_EMBEDDINGS: return st->embedding;
        case MT_P_FINAL_LN_WEIGHT: case MT_P_FINAL_LN_BIAS: case MT_P_OUTPUT_WEIGHT: return st->head;
        default:
            for (int c = 0; c < st->num_chunks; c++)
                if (layer >= st->first_layer[c] && layer < st->first_layer[c] + st->num_layers[c]) return 1;
            return 0;
    }
}

/* 8. DDP buffer layout: buckets and distributed-optimizer shards ------------------------------- */

static int64_t mt__round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
static int64_t mt__gcd(int64_t a, int64_t b) { while (b) { int64_t t = a % b; a = b; b = t; } return a; }

MT_DEF void mt_buffer_layout_free(mt_buffer_layout* b) {
    if (!b) return;
    free(b->params);
    free(b->buckets);
    free(b->index);
    memset(b, 0, sizeof(*b));
}

MT_DEF mt_status mt_buffer_layout_build(mt_buffer_layout* b, const mt_config* c, mt_error* err) {
    memset(b, 0, sizeof(*b));
    mt_param_info info[MT_NUM_PARAM_TENSORS];
    mt_param_layout_shard(c, info); /* this tensor-parallel rank's shard */
    int L = c->num_layers, dp = mt_grad_dp_size(c); /* the gradient-reduction group shards */
    /* a per-layer tensor is stacked over the layers that have it (mt_param_layer_has: every layer, or in an
     * MoE model with dense layers the dense MLP's over the dense layers and the MoE tensors over the MoE
     * ones): each layer's slice is its numel / that count; below[tsr * L + l] counts the held layers under
     * l that have it (its slice's place in the canonical order) */
    int* below = (int*)calloc((size_t)MT_NUM_PARAM_TENSORS * (size_t)(L + 1), sizeof(int));
    int stacked[MT_NUM_PARAM_TENSORS];
    if (!below) return mt_fail(err, MT_ERR_OOM, "cannot allocate the gradient buffer layout");
    int pp_rank = c->world_size > 0 && c->data_parallel_size > 0 && c->rank >= 0 && c->rank < c->world_size
                      ? mt_rank_coordinates(c, c->rank).pp : 0;
    mt_status st = mt_pp_stage_of(c, pp_rank, &b->stage, err);
    if (st != MT_OK) return free(below), st;
    mt__pp_held(&b->stage, L, info);
    for (int tsr = 0; tsr < MT_NUM_PARAM_TENSORS; tsr++) {
        stacked[tsr] = 0;
        for (int l = 0; l < L; l++) stacked[tsr] += mt_param_per_layer(tsr) && mt_param_layer_has(c, tsr, l);
        int held = 0;
        for (int l = 0; l < L; l++) {
            below[tsr * (L + 1) + l] = held;
            held += mt_pp_holds(&b->stage, MT_P_LN1_WEIGHT, l) && mt_param_layer_has(c, tsr, l);
        }
        below[tsr * (L + 1) + L] = held; /* the held layers that have it */
    }
    /* canonical offsets restricted to the held tensors and layers, in canonical order */
    int64_t canonical_base[MT_NUM_PARAM_TENSORS], running = 0;
    for (int tsr = 0; tsr < MT_NUM_PARAM_TENSORS; tsr++) {
        canonical_base[tsr] = running;
        running += mt_param_per_layer(tsr) ? (stacked[tsr] ? info[tsr].numel / stacked[tsr] : 0) *
                                                 below[tsr * (L + 1) + L]
                                           : info[tsr].numel;
    }
    b->canonical_size = running;
    /* model order (Megatron's module.parameters()): embeddings, each layer, final norm, output
     * layer; tensors the flavour lacks (numel 0) are not parameters */
    int n = 0, order[MT_NUM_PARAM_TENSORS * 2 + 1];
    int outside[] = {MT_P_WORD_EMBEDDINGS, MT_P_POSITION_EMBEDDINGS, -1, MT_P_FINAL_LN_WEIGHT, MT_P_FINAL_LN_BIAS,
                     MT_P_OUTPUT_WEIGHT};
    int per_layer = 0, num_order = 0;
    /* expert parallelism: the experts' tensors go last, in buckets of their own (Megatron's expert-parallel
     * buffer), reduced over the expert-data-parallel group; at EP = 1 they stay in the layers' order */
    const int ep = c->num_experts > 0 && c->expert_model_parallel_size > 1 ? c->expert_model_parallel_size : 1;
    int expert_tensors = 0;
    for (size_t i = 0; i < sizeof(outside) / sizeof(outside[0]); i++) {
        if (outside[i] < 0) { /* the layers */
            for (int tsr = MT_P_LN1_WEIGHT; tsr <= MT_P_LAST_LAYER_TENSOR; tsr++) {
                if (info[tsr].numel == 0) continue;
                if (ep > 1 && info[tsr].ep_split) { expert_tensors++; continue; }
                order[num_order++] = tsr; per_layer++;
            }
        } else if (info[outside[i]].numel > 0) {
            order[num_order++] = outside[i];
            n++;
        }
    }
    n = 0; /* the parameters: each held (tensor, layer) slice that exists, and the tensors outside the layers */
    for (int tsr = 0; tsr < MT_NUM_PARAM_TENSORS; tsr++)
        if (info[tsr].numel > 0) n += mt_param_per_layer(tsr) ? below[tsr * (L + 1) + L] : 1;
    (void)per_layer;
    b->num_layers = L;
    b->params = (mt_buffer_param*)calloc((size_t)(n > 0 ? n : 1), sizeof(mt_buffer_param));
    b->buckets = (mt_buffer_bucket*)calloc((size_t)(n > 0 ? n : 1), sizeof(mt_buffer_bucket));
    b->index = (int*)calloc((size_t)MT_NUM_PARAM_TENSORS * (size_t)L, sizeof(int));
    if (!b->params || !b->buckets || !b->index) {
        mt_buffer_layout_free(b);
        free(below);
        return mt_fail(err, MT_ERR_OOM, "cannot allocate the gradient buffer layout");
    }
    if (n == 0) {
        mt_buffer_layout_free(b);
        free(below);
        return mt_fail(err, MT_ERR_CONFIG, "pipeline rank %d holds no parameters (an empty stage)", pp_rank);
    }
    for (int i = 0; i < MT_NUM_PARAM_TENSORS * L; i++) b->index[i] = -1;
    /* walk the model order backwards */
    int k = 0;
#define MT__PLACE_SLICE(tsr_, layer_)                                                                      \
    do { /* the next parameter: (tsr_, layer_)'s slice, at its place in the canonical order */         \
        mt_buffer_param* p_ = &b->params[k];                                                           \
        p_->tensor = (tsr_);                                                                           \
        p_->layer = (layer_);                                                                          \
        p_->numel = info[tsr_].numel / stacked[tsr_];                                                  \
        p_->canonical = canonical_base[tsr_] + (int64_t)below[(tsr_) * (L + 1) + (layer_)] * p_->numel; \
        b->index[(tsr_) * L + (layer_)] = k++;                                                         \
    } while (0)
    for (int o = num_order - 1; o >= 0; o--) {
        int tensor = order[o], layered = mt_param_per_layer(tensor);
        /* a run of per-layer tensors: walk layers L-1..0, each layer's tensors in reverse */
        if (layered) {
            int first = o;
            while (first > 0 && mt_param_per_layer(order[first - 1])) first--;
            for (int layer = L - 1; layer >= 0; layer--) {
                if (!mt_pp_holds(&b->stage, MT_P_LN1_WEIGHT, layer)) continue;
                for (int j = o; j >= first; j--)
                    if (mt_param_layer_has(c, order[j], layer)) MT__PLACE_SLICE(order[j], layer);
            }
            o = first;
            continue;
        }
        mt_buffer_param* p = &b->params[k];
        p->tensor = tensor;
        p->numel = info[tensor].numel;
        p->canonical = canonical_base[tensor];
        for (int l = 0; l < L; l++) b->index[tensor * L + l] = k;
        k++;
    }
    const int first_expert_param = k; /* the experts' tensors (EP > 1): layers L-1..0, each layer's in reverse */
    for (int layer = L - 1; expert_tensors > 0 && layer >= 0; layer--) {
        if (!mt_pp_holds(&b->stage, MT_P_LN1_WEIGHT, layer)) continue;
        for (int tsr = MT_P_LAST_LAYER_TENSOR; tsr >= MT_P_LN1_WEIGHT; tsr--) {
            if (info[tsr].numel > 0 && info[tsr].ep_split && mt_param_layer_has(c, tsr, layer)) MT__PLACE_SLICE(tsr, layer);
        }
    }
#undef MT__PLACE_SLICE
    free(below);
    if (k != n) {
        mt_buffer_layout_free(b);
        return mt_fail(err, MT_ERR_CONFIG, "internal: the buffer layout placed %d of %d parameters", k, n);
    }
    b->num_params = n;
    int64_t bucket_size = 0; /* 0: one bucket */
    if (c->overlap_grad_reduce) {
        bucket_size = c->ddp_bucket_size > 0 ? c->ddp_bucket_size : 40000000;
        if (c->ddp_bucket_size <= 0 && 1000000LL * dp > bucket_size) bucket_size = 1000000LL * dp;
    }
    int dist = c->use_distributed_optimizer;
    int64_t bucket_divisor = dp / mt__gcd(dp, 128) * 128; /* lcm(dp, 128) */
    int64_t start = 0, bucket_start = 0, end = 0;
    int nb = 0, first = 0;
    for (int i = 0; i < n; i++) {
        mt_buffer_param* p = &b->params[i];
        /* Megatron starts a parameter at a multiple of 64 elements with the distributed optimizer; here also at
         * a multiple of 8 without it (16 bytes of bf16): a tensor of a size not a multiple of 8 (the MoE
         * router's bias of E elements) must not leave every tensor after it off the 16-byte alignment that the
         * kernels' vector loads and cuBLASLt's algorithms assume. Models whose tensors are multiples of 8
         * elements are laid out as Megatron lays them out. */
        start = mt__round_up(start, dist ? 64 : 8);
        p->offset = start;
        p->bucket = nb;
        end = start + p->numel;
        if ((bucket_size > 0 && end - bucket_start >= bucket_size) || i == n - 1 ||
            (expert_tensors > 0 && i == first_expert_param - 1)) { /* dense and expert parameters never share one */
            mt_buffer_bucket* bk = &b->buckets[nb];
            bk->ep = i >= first_expert_param ? ep : 0;
            bk->start = bucket_start;
            bk->numel_unpadded = end - bucket_start;
            bk->end = dist ? mt__round_up(end, bucket_divisor) : end;
            bk->ready_layer = L;
            for (int j = first; j <= i; j++) {
                const mt_buffer_param* q = &b->params[j];
                int ready = mt_param_per_layer(q->tensor) ? q->layer
                            : (q->tensor >= MT_P_FINAL_LN_WEIGHT ? L : -1); /* final norm, output layer: L */
                if (ready < bk->ready_layer) bk->ready_layer = ready;
            }
            bucket_start = start = bk->end;
            first = i + 1;
            nb++;
        } else {
            start = end;
        }
    }
    b->num_buckets = nb;
    b->size = bucket_start;
    b->elem = c->precision == MT_FP32 ? 4 : 2;
    /* each parameter's storage in buffer order; a few bytes of padding keep every address what it
     * is without FP8 storage modulo 256 (an FP8 weight: 256-aligned, as in the FP8 arena), so the
     * kernels' vector paths and cuBLASLt's alignment-keyed algorithms stay the same */
    for (int i = 0; i < n; i++) {
        mt_buffer_param* p = &b->params[i];
        p->fp8 = mt_fp8_param_stored(c, p->tensor, p->layer);
        const int64_t at = mt_buffer_storage_byte(b, p->offset), want = p->fp8 ? 0 : p->offset * b->elem % 256;
        p->storage = at + ((want - at) % 256 + 256) % 256;
    }
    b->storage_bytes = mt_buffer_storage_byte(b, b->size);
    return MT_OK;
}

MT_DEF int mt_fp8_param_stored(const mt_config* c, int tensor, int layer) {
    if (!c->fp8_param_gather || c->fp8_format == MT_FP8_NONE || !c->use_distributed_optimizer) return 0;
    return (tensor == MT_P_QKV_WEIGHT || tensor == MT_P_PROJ_WEIGHT || tensor == MT_P_FC1_WEIGHT ||
            tensor == MT_P_FC2_WEIGHT) && mt_fp8_layer(c, layer);
}

MT_DEF int64_t mt_buffer_storage_byte(const mt_buffer_layout* b, int64_t element) {
    int lo = 0, hi = b->num_params; /* the last parameter that starts below `element`: params[lo - 1] */
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (b->params[mid].offset < element) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0) return element * b->elem;
    const mt_buffer_param* q = &b->params[lo - 1];
    const int64_t width = q->fp8 ? 1 : b->elem, inside = element - q->offset;
    if (inside <= q->numel) return q->storage + inside * width;
    return q->storage + q->numel * width + (inside - q->numel) * b->elem; /* padding after q */
}

MT_DEF int64_t mt_buffer_offset(const mt_buffer_layout* b, int tensor, int layer) {
    int i = b->index[tensor * b->num_layers + layer];
    return i < 0 ? -1 : b->params[i].offset;
}

MT_DEF void mt_bucket_shard(const mt_buffer_bucket* bucket, int dp, int dp_rank, int64_t* begin, int64_t* end) {
    if (bucket->ep > 1 && dp % bucket->ep == 0) dp /= bucket->ep, dp_rank /= bucket->ep;
    int64_t shard = (bucket->end - bucket->start) / dp;
    *begin = bucket->start + (int64_t)dp_rank * shard;
    *end = *begin + shard;
}

/* 9. Pipeline schedules ------------------------------------------------------------------------ */

static int mt__pp_group(int pp, int vp, int m, int group_size) {
    (void)m;
    return vp == 1 ? 1 : group_size <= 0 ? pp : group_size;
}

MT_DEF mt_status mt_pp_schedule_check(int pp, int vp, int m, int group_size, mt_error* err) {
    if (pp < 1 || vp < 1 || m < 1)
        return mt_fail(err, MT_ERR_CONFIG, "pipeline schedule: PP (%d), VP (%d) and micro-batches (%d) must be >= 1",
                       pp, vp, m);
    if ((int64_t)2 * m * vp > INT32_MAX) /* the schedule's 2 M VP units are counted in ints */
        return mt_fail(err, MT_ERR_CONFIG, "pipeline schedule: %d micro-batches x %d virtual stages is too long (2 M VP must "
                       "stay below 2^31)", m, vp);
    if (vp == 1) return MT_OK;
    int g = mt__pp_group(pp, vp, m, group_size);
    if (pp == 1)
        return mt_fail(err, MT_ERR_CONFIG, "interleaved pipeline schedule: VP = %d needs PP > 1", vp);
    if (g < pp || g > m)
        return mt_fail(err, MT_ERR_CONFIG,
                       "interleaved pipeline schedule: micro-batch group size %d must be in [PP = %d, M = %d]", g, pp, m);
    if (m % g != 0 && m % g < pp)
        return mt_fail(err, MT_ERR_CONFIG,
                       "interleaved pipeline schedule: M = %d leaves a last group of %d micro-batches (M %% group size %d), "
                       "fewer than PP = %d", m, m % g, g, pp);
    return MT_OK;
}

MT_DEF int mt_pp_num_warmup(int pp, int vp, int m, int group_size, int rank) {
    if (vp == 1) return pp - rank - 1 < m ? pp - rank - 1 : m;
    int64_t w = 2 * (int64_t)(pp - rank - 1) + (int64_t)(vp - 1) * mt__pp_group(pp, vp, m, group_size);
    int64_t total = (int64_t)m * vp;
    return (int)(w < total ? w : total);
}

/* Entry k of the schedule table: groups [g0, g0 + g) of micro-batches (the last group: [g0, M)),
 * each walked over chunks 0 .. VP-1, the whole group per chunk. */
static void mt__pp_table(int vp, int m, int g, int k, int32_t* mb, int32_t* chunk) {
    int per_group = g * vp, g0 = (k / per_group) * g;
    int size = g0 + g >= m ? m - g0 : g; /* the last group: what is left */
    int i = k - g0 * vp;                 /* position within the group's [VP, size] block */
    *chunk = i / size;
    *mb = g0 + i % size;
}

/* The schedule of one rank, unchecked (tests also run it on settings the check refuses). */
static void mt__pp_fill(int pp, int vp, int m, int group_size, int rank, mt_pp_op* ops /* [2 M VP] */) {
    int g = mt__pp_group(pp, vp, m, group_size), total = m * vp;
    int warmup = mt_pp_num_warmup(pp, vp, m, group_size, rank);
    int prev = (rank + pp - 1) % pp, next = (rank + 1) % pp, last = pp * vp - 1;
    int n = 0, f = 0, b = 0;
    for (int step = 0; step < 2 * total; step++) {
        /* warm-up: forwards; steady: forward then backward; cool-down: backwards */
        int forward = f < warmup || (f < total && (f - warmup) == b);
        mt_pp_op* op = &ops[n++];
        int32_t mb, chunk;
        if (forward) {
            mt__pp_table(vp, m, g, f++, &mb, &chunk);
        } else {
            mt__pp_table(vp, m, g, b++, &mb, &chunk);
            chunk = vp - 1 - chunk;
        }
        int v = chunk * pp + rank; /* virtual stage */
        op->kind = (int8_t)(forward ? MT_PP_FORWARD : MT_PP_BACKWARD);
        op->micro_batch = mb;
        op->chunk = chunk;
        if (forward) {
            op->recv_rank = v > 0 ? prev : -1;
            op->send_rank = v < last ? next : -1;
        } else {
            op->recv_rank = v < last ? next : -1;
            op->send_rank = v > 0 ? prev : -1;
        }
    }
}

MT_DEF mt_status mt_pp_schedule(int pp, int vp, int m, int group_size, int rank, mt_pp_op* ops, int* num_warmup,
                                mt_error* err) {
    mt_status st = mt_pp_schedule_check(pp, vp, m, group_size, err);
    if (st != MT_OK) return st;
    if (rank < 0 || rank >= pp)
        return mt_fail(err, MT_ERR_RANGE, "pipeline schedule: rank %d outside [0, PP = %d)", rank, pp);
    mt__pp_fill(pp, vp, m, group_size, rank, ops);
    if (num_warmup) *num_warmup = mt_pp_num_warmup(pp, vp, m, group_size, rank);
    return MT_OK;
}

MT_DEF int mt_pp_slots_needed(const mt_pp_op* ops, int num_ops) {
    int live = 0, most = 1;
    for (int k = 0; k < num_ops; k++) {
        live += ops[k].kind == MT_PP_FORWARD ? 1 : -1;
        if (live > most) most = live;
    }
    return most;
}

MT_DEF mt_status mt_pp_activation_slots(int pp, int vp, int m, int group_size, int rank, int* slots, mt_error* err) {
    *slots = 0;
    mt_status st = mt_pp_schedule_check(pp, vp, m, group_size, err);
    if (st != MT_OK) return st;
    if (rank < 0 || rank >= pp)
        return mt_fail(err, MT_ERR_RANGE, "pipeline schedule: rank %d outside [0, PP = %d)", rank, pp);
    /* mt_pp_slots_needed of mt_pp_schedule's units, counted without building them (M may be in the
     * millions): the warm-up's forwards, then one more forward before each backward; every unit when
     * the warm-up takes them all (tests/test_pipeline.h checks this against the schedule) */
    const int total = m * vp, warmup = mt_pp_num_warmup(pp, vp, m, group_size, rank);
    *slots = warmup < total ? warmup + 1 : total;
    return MT_OK;
}

/* 10. Memory plan of any layout: arenas, recompute, optimizer pieces, --plan-layouts ----------- */

MT_DEF void mt_plan_options_defaults(mt_plan_options* o) {
    memset(o, 0, sizeof(*o));
    o->pp_rank = -1;
}

MT_DEF int mt_flash_attention(const mt_config* c) {
    return c->precision == MT_BF16 && (c->kv_channels == 64 || c->kv_channels == 128);
}

MT_DEF int mt_explicit_positions(const mt_config* c) { return c->reset_position_ids || mt__cp_size(c) > 1; }

MT_DEF void mt_document_boundaries(const int32_t* inputs, int B, int S, int64_t eod, int32_t* doc_start,
                                   int32_t* positions) {
    for (int b = 0; b < B; b++) {
        const int32_t* in = inputs + (int64_t)b * S;
        int32_t* ds = doc_start + (int64_t)b * S;
        int32_t start = 0;
        for (int i = 0; i < S; i++) {
            if (i > 0 && in[i - 1] == eod) start = i; /* the eod at i - 1 ended the previous document */
            ds[i] = start;
            if (positions) positions[(int64_t)b * S + i] = i - start;
        }
    }
}

MT_DEF void mt_position_index(const int32_t* positions, int BT, int S, int32_t* offsets, int32_t* rows) {
    memset(offsets, 0, sizeof(int32_t) * ((size_t)S + 1));
    for (int r = 0; r < BT; r++) offsets[positions[r] + 1]++;
    for (int p = 0; p < S; p++) offsets[p + 1] += offsets[p];
    for (int r = 0; r < BT; r++) rows[offsets[positions[r]]++] = r; /* offsets[p] walks to offsets[p + 1] */
    for (int p = S; p > 0; p--) offsets[p] = offsets[p - 1];           /* back to the groups' starts */
    offsets[0] = 0;
}

MT_DEF int64_t mt_offload_elements(const mt_config* c, int64_t shard) {
    if (!c->optimizer_cpu_offload || shard <= 0) return 0;
    if (c->optimizer_offload_fraction >= 1.0) return shard;
    int64_t n = (int64_t)(c->optimizer_offload_fraction * (double)shard);
    return n / 16 * 16;
}

static size_t mt__align256(size_t x) { return (x + 255) & ~(size_t)255; }

/* Full recompute's n in a chunk of `count` layers: uniform's group size, block's recomputed layers. */
static int64_t mt__recompute_n(const mt_recompute* rc, int64_t count) {
    int64_t n = rc->num_layers > 0 ? rc->num_layers : rc->method == MT_RECOMPUTE_UNIFORM ? 1 : count;
    return n < count ? n : count;
}

/* Selective: whether a region is one the modules recompute (then every layer uses one layer's room). */
static int mt__selective_region(const mt_recompute* rc, int region) {
    const int m = rc->modules ? rc->modules : MT_RECOMPUTE_CORE_ATTN;
    const int moe_experts = region == MT_ACT_MOE_FC1 || region == MT_ACT_MOE_SHARED || region == MT_ACT_MOE_GATE ||
                            region == MT_ACT_MOE_EP_IN || region == MT_ACT_MOE_EP_PROB;
    return (region == MT_ACT_PROBS && (m & MT_RECOMPUTE_CORE_ATTN)) || (region == MT_ACT_LN2 && (m & MT_RECOMPUTE_LAYERNORM)) ||
           (region == MT_ACT_ACT && (m & (MT_RECOMPUTE_ACT | MT_RECOMPUTE_MLP))) ||
           (region == MT_ACT_FC1 && (m & MT_RECOMPUTE_MLP)) ||
           (region == MT_ACT_MOE_ACT && (m & (MT_RECOMPUTE_MOE_ACT | MT_RECOMPUTE_MOE))) ||
           (moe_experts && (m & MT_RECOMPUTE_MOE));
}

/* An MoE layer's routing (the router's logits, the probabilities and map, the permutation, the row counts, the
 * aux losses' gradient weights, the rows received per EP rank): kept per layer by full recompute too, so a
 * replayed MoE layer takes the forward's routing as it was (its bookkeeping, the tokens per expert and the aux
 * losses' running sums, is the forward's alone) and recomputes only the experts' and the shared expert's
 * activations from it. A few [N, E] arrays per layer against the experts' [N k, fe] ones. */
static int mt__moe_routing_region(int region) {
    return region == MT_ACT_MOE_LOGITS || region == MT_ACT_MOE_PROBS || region == MT_ACT_MOE_ROW ||
           region == MT_ACT_MOE_TOKEN || region == MT_ACT_MOE_ROW_PROB || region == MT_ACT_MOE_COUNTS ||
           region == MT_ACT_MOE_AUXW || region == MT_ACT_MOE_EP_COUNTS;
}

MT_DEF int64_t mt_recompute_position(const mt_recompute* rc, int region, int64_t count, int64_t i) {
    if (!rc || rc->granularity == MT_RECOMPUTE_NONE) return i;
    if (rc->granularity == MT_RECOMPUTE_SELECTIVE) return mt__selective_region(rc, region) ? 0 : i;
    if (mt__moe_routing_region(region)) return i;
    const int input = region == MT_ACT_RESIDUAL || region == MT_ACT_LN1_MEAN || region == MT_ACT_LN1_RSTD;
    const int64_t n = mt__recompute_n(rc, count);
    if (rc->method == MT_RECOMPUTE_BLOCK) /* every layer's input kept; the recomputed layers share room 0 */
        return input ? i : i < n ? 0 : i - n + 1;
    if (!input) return n > 0 ? i % n : 0; /* uniform: one group's activations */
    /* uniform inputs: the groups' inputs [0, G), the inputs of a group's later layers while it is
     * replayed [G, G + n - 1), the chunk's output last */
    const int64_t groups = n > 0 ? (count + n - 1) / n : 0;
    if (i >= count) return n > 0 ? groups + n - 1 : 0;
    return i % n == 0 ? i / n : groups + i % n - 1;
}

MT_DEF int mt_recompute_replay(const mt_recompute* rc, int64_t count, int64_t i, int64_t* first) {
    if (!rc || rc->granularity != MT_RECOMPUTE_FULL || i < 0 || i >= count) return 0;
    const int64_t n = mt__recompute_n(rc, count);
    if (rc->method == MT_RECOMPUTE_BLOCK) { /* the last recomputed layer's activations are still in room 0 */
        if (i >= n - 1) return 0;
        *first = i;
        return 1;
    }
    const int64_t g = i / n, groups = (count + n - 1) / n;
    if (g == groups - 1 || i % n != n - 1) return 0; /* the last group is still in place; a group replays once */
    *first = g * n;
    return 1;
}

MT_DEF void mt_recompute_describe(const mt_recompute* rc, char* out, size_t size) {
    if (!size) return;
    if (rc->granularity == MT_RECOMPUTE_FULL) {
        if (rc->num_layers > 0)
            snprintf(out, size, "full %s %d", rc->method == MT_RECOMPUTE_BLOCK ? "block" : "uniform", rc->num_layers);
        else
            snprintf(out, size, "full %s", rc->method == MT_RECOMPUTE_BLOCK ? "block, every layer" : "uniform 1");
        return;
    }
    if (rc->granularity != MT_RECOMPUTE_SELECTIVE) {
        snprintf(out, size, "none");
        return;
    }
    static const char* const names[] = {"core_attn", "layernorm", "act", "mlp", "moe_act", "moe"};
    const int m = rc->modules ? rc->modules : MT_RECOMPUTE_CORE_ATTN;
    size_t used = (size_t)snprintf(out, size, "selective (");
    for (int k = 0, n = 0; k < 6 && used < size; k++)
        if (m & (1 << k)) used += (size_t)snprintf(out + used, size - used, "%s%s", n++ ? ", " : "", names[k]);
    if (used < size) snprintf(out + used, size - used, ")");
}

/* Layers' worth of one per-layer region a slot keeps (for a chunk of L layers): the most rooms
 * mt_recompute_position hands out, the residual stream's including the chunk's output. */
static int64_t mt__kept_layers(const mt_recompute* rc, int region, int64_t L) {
    int64_t kept = 0;
    const int64_t last = region == MT_ACT_RESIDUAL ? L : L - 1;
    for (int64_t i = 0; i <= last; i++) {
        int64_t at = mt_recompute_position(rc, region, L, i) + 1;
        if (at > kept) kept = at;
    }
    return kept;
}

/* Sizes of a plan, saturating at MT__SIZE_MAX instead of wrapping: a config whose memory does not
 * fit 64 bits gets a plan of MT__SIZE_MAX bytes, which mt_memory_plan_compute refuses. */
#define MT__SIZE_MAX ((int64_t)INT64_MAX)
static int64_t mt__size_mul(int64_t a, int64_t b) {
    int64_t r;
    return a < 0 || b < 0 || mt_mul_overflows_i64(a, b, &r) ? MT__SIZE_MAX : r;
}
static int64_t mt__size_mul3(int64_t a, int64_t b, int64_t c) { return mt__size_mul(mt__size_mul(a, b), c); }
static int64_t mt__size_add(int64_t a, int64_t b) {
    int64_t r;
    return a < 0 || b < 0 || mt_add_overflows_i64(a, b, &r) ? MT__SIZE_MAX : r;
}

static int64_t mt__size_align256(int64_t n) { return n > MT__SIZE_MAX - 255 ? MT__SIZE_MAX : (int64_t)mt__align256((size_t)n); }
MT_DEF int64_t mt_cp_ring_scratch_bytes(int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t d) {
    const int64_t kv = mt__size_mul(2, mt__size_mul(mt__size_mul(B, Hkv), mt__size_mul(T, d))); /* one block's K, V */
    const int64_t acc = mt__size_mul(mt__size_mul(B, H), mt__size_mul(T, d));
    const int64_t ring = mt__size_add(mt__size_add(mt__size_mul(2, mt__size_align256(mt__size_mul(kv, 2))),
                                                   mt__size_align256(mt__size_mul(acc, 4))),
                                      mt__size_mul(2, mt__size_align256(mt__size_mul(kv, 4))));
    const int64_t step = mt__size_add(mt__size_add(mt__size_align256(mt__size_mul(acc, 2)),
                                                   mt__size_align256(mt__size_mul(mt__size_mul(B, H), mt__size_mul(T, 4)))),
                                      mt__size_align256(mt__size_mul(kv, 2)));
    return mt__size_add(ring, step);
}

MT_DEF int64_t mt_cp_scratch_bytes(const mt_config* c) {
    const int64_t cp = mt__cp_size(c);
    if (cp == 1) return 0;
    const int64_t tp = c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1;
    const int64_t e = c->precision == MT_FP32 ? 4 : 2, B = c->micro_batch_size, S = c->seq_length, d = c->kv_channels;
    const int64_t heads = c->num_attention_heads / tp, groups = c->num_query_groups / tp, BTl = B * (S / cp);
    switch (c->cp_comm_type) {
        case MT_CP_ALL_GATHER: return mt__size_mul(6 * e, mt__size_mul3(B * groups, S, d));
        case MT_CP_A2A:
            return mt__size_mul(e, mt__size_add(mt__size_mul3(3, BTl, (heads + 2 * groups) * d),
                                                mt__size_mul3(2, BTl, heads * d)));
        default: return mt_cp_ring_scratch_bytes(B, heads, groups, S / cp, d);
    }
}

MT_DEF void mt_activation_layout_compute(const mt_config* c, int layers, int head, int num_slots,
                                         const mt_recompute* rc, mt_activation_layout* out) {
    memset(out, 0, sizeof(*out));
    const int tp = c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1;
    const int sp = c->sequence_parallel && tp > 1, flash = mt_flash_attention(c);
    /* S: this rank's rows of a sequence (S_full / CP with context parallelism: two chunks) */
    const int64_t cp = mt__cp_size(c), S_full = c->seq_length;
    const int64_t e = c->precision == MT_FP32 ? 4 : 2, B = c->micro_batch_size, S = S_full / cp, BT = B * S;
    const int64_t R = sp ? BT / tp : BT, h = c->hidden_size, d = c->kv_channels, L = layers;
    const int64_t heads = c->num_attention_heads / tp, groups = c->num_query_groups / tp;
    const int64_t qkv_width = (heads + 2 * groups) * d, attn_width = heads * d, f = c->ffn_hidden_size / tp;
    const int64_t f1 = c->swiglu ? 2 * f : f, V_full = c->padded_vocab_size, V = V_full / tp;
    const int64_t heads_elems = mt__size_mul3(B * heads, S, d), group_elems = mt__size_mul3(B * groups, S, d);
    /* scores: the local queries against every key (CP all_gather), or the whole sequence of heads / CP heads (a2a):
     * the same count */
    const int64_t score_elems = mt__size_mul3(B * heads, S, S_full), lse = mt__size_mul3(B * heads, S, 4);
    const int64_t Rh = mt__size_mul3(R, h, e), BTwide_e = mt__size_mul(BT, e);
    /* mixture of experts (moe_layers 0: none); the shared expert is tensor-parallel like the dense MLP */
    const int64_t moe_layers = mt_moe_num_layers(c), E = moe_layers ? c->num_experts : 0;
    const int64_t fe = moe_layers ? mt_moe_ffn(c) / tp : 0, f1e = c->swiglu ? 2 * fe : fe;
    const int64_t fs = moe_layers ? c->moe_shared_expert_intermediate_size / tp : 0, fs1 = c->swiglu ? 2 * fs : fs;
    const int64_t Rmax = moe_layers ? mt_moe_max_rows(c, BT) : 0, NE4 = mt__size_mul3(BT, E, 4);
    const int64_t ep = moe_layers && c->expert_model_parallel_size > 1 ? c->expert_model_parallel_size : 1;
    const int64_t Rexp = moe_layers ? mt_moe_expert_rows(c, BT) : 0, Rrows = Rexp > Rmax ? Rexp : Rmax;
    const int gate = moe_layers && fs > 0 && c->moe_shared_expert_gate;
    int aux = 0;
    for (int k = 0; k < 3; k++) aux |= (c->moe_load_balancing & (1 << k)) && c->moe_aux_loss_coeff[k] > 0;
    const int64_t mlp_f1 = moe_layers == c->num_layers ? fs1 : (f1 > fs1 ? f1 : fs1);
    const int64_t mlp_f = moe_layers == c->num_layers ? fs : (f > fs ? f : fs);
    int64_t wide = h;
    if (qkv_width > wide) wide = qkv_width;
    if (f1 > wide) wide = f1;
    if (fs1 > wide) wide = fs1;
    if (attn_width > wide) wide = attn_width;
    /* bytes: per layer for the per-layer saved regions, else of the region; 0 where the config has none */
    int64_t per_layer[MT_ACT_REGIONS] = {0}, once[MT_ACT_REGIONS] = {0};
    once[MT_ACT_LN1] = Rh;
    once[MT_ACT_Q] = flash ? 0 : mt__size_mul(heads_elems, e);
    once[MT_ACT_K] = flash ? 0 : mt__size_mul(group_elems, e);
    once[MT_ACT_V] = flash ? 0 : mt__size_mul(group_elems, e);
    once[MT_ACT_O] = flash ? 0 : mt__size_mul(heads_elems, e);
    once[MT_ACT_DK] = flash ? 0 : mt__size_mul(group_elems, e);
    once[MT_ACT_DV] = flash ? 0 : mt__size_mul(group_elems, e);
    once[MT_ACT_DSCORES] = flash ? 0 : mt__size_mul(score_elems, e);
    once[MT_ACT_DSUM] = flash ? lse : 0;
    once[MT_ACT_LOGITS_ROW] = mt__size_mul(V_full, 4);
    once[MT_ACT_BRANCH] = mt__size_mul(BTwide_e, wide);
    once[MT_ACT_BRANCH2] = mt__size_mul(BTwide_e, wide);
    once[MT_ACT_DRESIDUAL] = Rh;
    once[MT_ACT_GATHERED] = sp ? mt__size_mul(BTwide_e, h) : 0;
    once[MT_ACT_GATHERED_GRAD] = sp ? mt__size_mul(BTwide_e, h) : 0;
    once[MT_ACT_ROWS] = sp ? Rh : 0;
    once[MT_ACT_CE_STATS] = tp > 1 ? mt__size_mul3(tp, BT, 3 * 4) : 0;
    once[MT_ACT_INPUTS] = BT * 4;
    once[MT_ACT_TARGETS] = BT * 4;
    once[MT_ACT_LOSSES] = BT * 4;
    once[MT_ACT_EMBED_INDEX] = (3 * BT + 2 + (mt_explicit_positions(c) ? S_full + 1 + BT : 0)) * 4; /* + mt_position_index */
    /* --qk-layernorm: the QKV rows with q and k normalised (v copied), [BT, qkv_width], made from the
     * kept QKV rows where attention reads them (forward and backward), with every head's mean and 1/std */
    once[MT_ACT_QK_NORM] = c->qk_layernorm ? mt__size_mul(BTwide_e, qkv_width) : 0;
    once[MT_ACT_QK_STATS] = c->qk_layernorm ? mt__size_mul3(BT, heads + groups, 2 * 4) : 0;
    /* the permuted rows' scratch also holds one row per token (the backward's gated shared expert gradient) */
    once[MT_ACT_MOE_XPERM] = mt__size_mul3(E ? (Rrows > BT ? Rrows : BT) : 0, h, e);
    once[MT_ACT_MOE_Y] = mt__size_mul3(E ? (Rrows > BT ? Rrows : BT) : 0, h, e);
    once[MT_ACT_MOE_DZ] = mt__size_mul3(Rexp, f1e, e);
    once[MT_ACT_MOE_DACT] = mt__size_mul3(Rexp, fe, e);
    once[MT_ACT_MOE_DLOGITS] = NE4;
    once[MT_ACT_MOE_DPROBS] = NE4;
    once[MT_ACT_MOE_X32] = e != 4 && E ? mt__size_mul3(BT, h, 4) : 0;
    once[MT_ACT_MOE_W32] = e != 4 ? mt__size_mul3(E, h, 4) : 0;
    once[MT_ACT_MOE_WORK] = E ? mt__size_mul(MT_MOE_WORK_WORDS(BT, E, B), 4) : 0;
    once[MT_ACT_MOE_STATS] = E ? (2 * (B + 1) * E + 64) * 4 : 0;
    once[MT_ACT_MOE_EP_INDEX] = ep > 1 ? mt__size_mul3(2, Rexp, 4) : 0;
    once[MT_ACT_MOE_EP_DROW] = ep > 1 ? mt__size_mul(mt__size_add(mt__size_mul(2, Rexp), Rmax), 4) : 0;
    once[MT_ACT_CP] = mt_cp_scratch_bytes(c);
    per_layer[MT_ACT_RESIDUAL] = Rh; /* L + 1 of them: each layer's input and the chunk's output */
    per_layer[MT_ACT_LN1_MEAN] = R * 4;
    per_layer[MT_ACT_LN1_RSTD] = R * 4;
    per_layer[MT_ACT_QKV] = mt__size_mul(BTwide_e, qkv_width);
    per_layer[MT_ACT_PROBS] = flash ? 0 : mt__size_mul(score_elems, e);
    per_layer[MT_ACT_LSE] = flash ? lse : 0;
    per_layer[MT_ACT_ATTN_OUT] = mt__size_mul(BTwide_e, attn_width);
    per_layer[MT_ACT_RESIDUAL_MID] = Rh;
    per_layer[MT_ACT_LN2] = Rh;
    per_layer[MT_ACT_LN2_MEAN] = R * 4;
    per_layer[MT_ACT_LN2_RSTD] = R * 4;
    per_layer[MT_ACT_FC1] = mt__size_mul(BTwide_e, moe_layers ? mlp_f1 : f1); /* MoE: the shared expert's */
    per_layer[MT_ACT_ACT] = mt__size_mul(BTwide_e, moe_layers ? mlp_f : f);
    per_layer[MT_ACT_MOE_LOGITS] = NE4;
    per_layer[MT_ACT_MOE_PROBS] = NE4;
    per_layer[MT_ACT_MOE_ROW] = NE4;
    per_layer[MT_ACT_MOE_TOKEN] = mt__size_mul(Rmax, 4);
    per_layer[MT_ACT_MOE_ROW_PROB] = mt__size_mul(Rmax, 4);
    per_layer[MT_ACT_MOE_COUNTS] = E ? (2 * E + 1) * 4 : 0;
    per_layer[MT_ACT_MOE_AUXW] = aux ? mt__size_mul3(B, E, 4) : 0;
    per_layer[MT_ACT_MOE_FC1] = mt__size_mul3(Rexp, f1e, e);
    per_layer[MT_ACT_MOE_ACT] = mt__size_mul3(Rexp, fe, e);
    per_layer[MT_ACT_MOE_SHARED] = gate ? mt__size_mul(BTwide_e, h) : 0;
    per_layer[MT_ACT_MOE_GATE] = gate ? BT * 4 : 0;
    per_layer[MT_ACT_MOE_EP_IN] = ep > 1 ? mt__size_mul3(Rexp, h, e) : 0;
    per_layer[MT_ACT_MOE_EP_PROB] = ep > 1 ? mt__size_mul(Rexp, 4) : 0;
    per_layer[MT_ACT_MOE_EP_COUNTS] = ep > 1 ? E * 4 : 0;
    /* doc_start and positions of the local rows; with CP also the whole samples' [2, B, S_full] (a2a) */
    once[MT_ACT_DOCS] = cp > 1 ? (2 * BT + 2 * B * S_full) * 4 : c->reset_position_ids || c->reset_attention_mask ? 2 * BT * 4 : 0;
    once[MT_ACT_LNF] = head ? Rh : 0;
    once[MT_ACT_LNF_MEAN] = head ? R * 4 : 0;
    once[MT_ACT_LNF_RSTD] = head ? R * 4 : 0;
    once[MT_ACT_LOGITS] = head ? mt__size_mul(BTwide_e, V) : 0;
    out->num_slots = num_slots > 0 ? num_slots : 1;
    int64_t off = 0;
    for (int r = 0; r < MT_ACT_REGIONS; r++) {
        if (r == MT_ACT_RESIDUAL) { /* the slots start */
            out->scratch_bytes = (size_t)off;
            off = 0;
        }
        if (per_layer[r] > 0) out->kept_layers[r] = mt__kept_layers(rc, r, L);
        const int64_t bytes = per_layer[r] > 0 ? mt__size_mul(per_layer[r], out->kept_layers[r]) : once[r];
        out->bytes[r] = (size_t)bytes;
        out->offset[r] = (size_t)mt__size_add(r >= MT_ACT_RESIDUAL ? (int64_t)out->scratch_bytes : 0, off);
        off = mt__size_add(off, mt__size_align256(bytes));
    }
    out->saved_bytes = (size_t)off;
    out->total = (size_t)mt__size_add((int64_t)out->scratch_bytes, mt__size_mul(out->num_slots, off));
}

MT_DEF int64_t mt_fp8_scale_inv_floats(int blocks_128x128, int rows, int cols) {
    int64_t row_blocks = (rows + 127) / 128, col_blocks = (cols + 127) / 128;
    if (!blocks_128x128) return col_blocks * rows;
    return row_blocks * ((col_blocks + 3) / 4 * 4);
}

MT_DEF void mt_fp8_arena_layout_compute(const mt_config* c, int fp8_layers, mt_fp8_arena_layout* out) {
    memset(out, 0, sizeof(*out));
    if (c->fp8_format == MT_FP8_NONE) return;
    const int tp = c->tensor_model_parallel_size > 0 ? c->tensor_model_parallel_size : 1;
    const int64_t h = c->hidden_size, d = c->kv_channels, heads = c->num_attention_heads / tp;
    const int64_t groups = c->num_query_groups / tp, f = c->ffn_hidden_size / tp, f1 = c->swiglu ? 2 * f : f;
    const int64_t BT = (int64_t)c->micro_batch_size * c->seq_length;
    /* the four linears [out, in]: QKV, proj, fc1, fc2 (megatron.cu fp8_linear_dims) */
    const int64_t dims[4][2] = {{(heads + 2 * groups) * d, h}, {h, heads * d}, {f1, h}, {h, f}};
    int64_t wide = 0;
    for (int k = 0; k < 4; k++) {
        int out_dim = (int)dims[k][0], in_dim = (int)dims[k][1];
        /* W and W^T; with --fp8-param-gather W lives in the parameter storage, W^T here */
        out->weights_per_layer += (c->fp8_param_gather ? 1 : 2) * dims[k][0] * dims[k][1];
        out->weight_blocks_per_layer += (mt_fp8_scale_inv_floats(1, out_dim, in_dim) + 3) / 4 * 4 +
                                        (mt_fp8_scale_inv_floats(1, in_dim, out_dim) + 3) / 4 * 4;
        if (dims[k][0] > wide) wide = dims[k][0];
        if (dims[k][1] > wide) wide = dims[k][1];
    }
    out->num_tensors = fp8_layers * 4 * 3;
    out->history_len = c->fp8_recipe == MT_FP8_DELAYED ? c->fp8_amax_history_len : 1;
    const int blockwise = c->fp8_recipe == MT_FP8_BLOCKWISE;
    const int64_t rows_blocks = (mt_fp8_scale_inv_floats(0, (int)BT, (int)wide) + 3) / 4 * 4;
    const int64_t cols_blocks = (mt_fp8_scale_inv_floats(0, (int)wide, (int)BT) + 3) / 4 * 4;
    const int64_t nt = out->num_tensors, scratch = mt__size_mul(BT, wide);
    const int64_t bytes[MT_FP8A_REGIONS] = {
        nt * 4, nt * 4 * MT_FP8_SCALE_INV_STRIDE, nt * 4, nt * 4, mt__size_mul3(nt, out->history_len, 4),
        mt__size_mul(fp8_layers, out->weights_per_layer), scratch, scratch, scratch, scratch,
        blockwise ? rows_blocks * 4 : 0, blockwise ? cols_blocks * 4 : 0, blockwise ? rows_blocks * 4 : 0,
        blockwise ? cols_blocks * 4 : 0, blockwise ? fp8_layers * out->weight_blocks_per_layer * 4 : 0};
    int64_t off = 0;
    for (int r = 0; r < MT_FP8A_REGIONS; r++) {
        out->offset[r] = (size_t)off;
        off = mt__size_add(off, mt__size_align256(bytes[r]));
    }
    out->total = (size_t)off;
}

MT_DEF int64_t mt_optimizer_pieces(const mt_buffer_layout* B, int dp, int dp_rank, int64_t gpu_shard,
                                   mt_optimizer_piece* out) {
    int64_t count = 0, master = 0;
    for (int b = 0; b < B->num_buckets; b++) {
        int64_t begin, end;
        mt_bucket_shard(&B->buckets[b], dp, dp_rank, &begin, &end);
        for (int i = 0; i < B->num_params; i++) {
            const mt_buffer_param* p = &B->params[i];
            if (p->bucket != b) continue;
            int64_t lo = p->offset > begin ? p->offset : begin;
            int64_t hi = p->offset + p->numel < end ? p->offset + p->numel : end;
            if (!out && lo < hi) { /* counted, not walked: a model of 10^14 parameters has 10^9 pieces */
                const int64_t cut = gpu_shard - master + begin, C = MT_OPT_CHUNK_ELEMENTS; /* the GPU's end, here */
                if (cut > lo && cut < hi) count += (cut - lo + C - 1) / C + (hi - cut + C - 1) / C;
                else count += (hi - lo + C - 1) / C;
                continue;
            }
            for (int64_t x = lo; x < hi;) {
                int64_t m = master + (x - begin), len = hi - x < MT_OPT_CHUNK_ELEMENTS ? hi - x : MT_OPT_CHUNK_ELEMENTS;
                if (m < gpu_shard && m + len > gpu_shard) len = gpu_shard - m;
                if (out) {
                    out[count].buffer = x;
                    out[count].master = m;
                    out[count].length = len;
                    out[count].tensor = p->tensor;
                }
                count++;
                x += len;
            }
        }
        master += end - begin;
    }
    return count;
}

/* One pipeline rank's plan (pp_rank in [0, PP)): the buffer, stage and slots the trainer of a GPU of
 * that pipeline rank builds (mt_buffer_layout_build, mt_pp_activation_slots). */
static mt_status mt__memory_plan_rank(const mt_config* c, const mt_plan_options* o, int pp_rank, mt_memory_plan* p,
                                      mt_error* err) {
    memset(p, 0, sizeof(*p));
    /* dp: the gradient-reduction group (DP x CP), which the distributed optimizer shards over */
    const int pp = c->pipeline_model_parallel_size, tp = c->tensor_model_parallel_size, dp = mt_grad_dp_size(c);
    const int cp = mt__cp_size(c);
    const int vp = c->virtual_pipeline_size > 0 ? c->virtual_pipeline_size : 1, M = mt_num_micro_batches(c);
    const int sharded = c->use_distributed_optimizer && dp > 1, alias = c->precision == MT_FP32 && !sharded;
    const size_t elem = c->precision == MT_FP32 ? 4 : 2;
    mt_config at = *c; /* a rank of this pipeline stage (and of the planned DP and CP ranks) */
    mt_rank_coords coords = {0, o->dp_rank, pp_rank, 0, 0, o->cp_rank, 0};
    at.rank = mt_rank_of(c, coords);
    const int dpcp_rank = mt_rank_coordinates(c, at.rank).dpcp;
    mt_buffer_layout B;
    mt_status st = mt_buffer_layout_build(&B, &at, err);
    if (st != MT_OK) return st;
    const mt_pp_stage* stage = &B.stage;
    st = mt_pp_activation_slots(pp, vp, M, c->microbatch_group_size_per_vp_stage, pp_rank, &p->in_flight, err);
    if (st != MT_OK) {
        mt_buffer_layout_free(&B);
        return st;
    }
    p->pp_rank = pp_rank;
    p->num_micro_batches = M;
    int largest = 0, fp8_layers = 0;
    for (int k = 0; k < stage->num_chunks; k++) {
        p->num_layers += stage->num_layers[k];
        if (stage->num_layers[k] > largest) largest = stage->num_layers[k];
    }
    int moe_layers = 0; /* the MoE layers this rank holds (their trainer state) */
    for (int l = 0; l < c->num_layers; l++) {
        fp8_layers += mt_pp_holds(stage, MT_P_LN1_WEIGHT, l) && mt_fp8_layer(c, l);
        moe_layers += mt_pp_holds(stage, MT_P_LN1_WEIGHT, l) && mt_moe_layer(c, l);
    }
    p->num_parameters = B.canonical_size;
    p->buffer_elements = B.size;
    for (int b = 0; b < B.num_buckets; b++) p->shard_elements += (B.buckets[b].end - B.buckets[b].start) / (sharded ? dp : 1);
    p->offload_elements = mt_offload_elements(c, p->shard_elements);
    const int64_t gpu_shard = p->shard_elements - p->offload_elements, n = p->buffer_elements;
    p->optimizer_chunks = mt_optimizer_pieces(&B, sharded ? dp : 1, sharded ? dpcp_rank : 0, gpu_shard, NULL);
    mt_activation_layout a;
    mt_activation_layout_compute(c, largest, stage->head, p->in_flight, &c->recompute, &a);
    p->parameter_bytes = alias ? (size_t)n * 4 : (size_t)B.storage_bytes; /* n x elem, FP8-stored weights 1 byte */
    p->master_bytes = alias ? 0 : (size_t)gpu_shard * 4;
    p->gradient_bytes = (size_t)n * 4;
    p->optimizer_bytes = (size_t)gpu_shard * 8;
    p->activation_saved_bytes = a.saved_bytes;
    p->activation_bytes = a.total;
    int64_t wide = c->hidden_size > (int64_t)c->ffn_hidden_size / tp * (c->swiglu ? 2 : 1)
                       ? c->hidden_size : (int64_t)c->ffn_hidden_size / tp * (c->swiglu ? 2 : 1);
    const int64_t shared1 = c->num_experts > 0 ? (int64_t)c->moe_shared_expert_intermediate_size / tp * (c->swiglu ? 2 : 1)
                                               : 0; /* the trainer's column sums also serve the shared expert */
    if (shared1 > wide) wide = shared1;
    const int64_t qkv = (int64_t)(c->num_attention_heads + 2 * c->num_query_groups) / tp * c->kv_channels;
    size_t colsum = (size_t)MT_COLSUM_MAX_CHUNKS * (size_t)(qkv > wide ? qkv : wide);
    if ((size_t)MT_NORM_BWD_BLOCKS * (size_t)c->hidden_size > colsum) colsum = (size_t)MT_NORM_BWD_BLOCKS * c->hidden_size;
    const int rot = c->position_embedding_type == MT_POSITION_ROPE ? (int)(c->kv_channels * c->rotary_percent) : 0;
    int64_t workspace = mt__size_add((int64_t)(MT_CUBLAS_WORKSPACE_BYTES + 3 * colsum * 4 + MT_REDUCE_SCRATCH_BYTES(c->world_size)),
                                     mt__size_mul3(2 * (int64_t)c->seq_length, rot / 2, 4));
    workspace = mt__size_add(workspace, mt__size_mul(p->optimizer_chunks + 1, 8));
    workspace = mt__size_add(workspace, mt__size_mul(mt_grad_reduce_scratch(c, &B), 2)); /* --grad-reduce-in-bf16 */
    workspace = mt__size_add(workspace, mt__size_mul(p->optimizer_chunks > 0 ? p->optimizer_chunks : 1, MT_OPT_CHUNK_BYTES));
    if (c->fp8_param_gather) /* the chunks' places in the parameter storage (megatron.cu fp8_publish_chunk) */
        workspace = mt__size_add(workspace, mt__size_mul(p->optimizer_chunks > 0 ? p->optimizer_chunks : 1,
                                                         MT_PUBLISH_CHUNK_BYTES));
    if (pp > 1) /* an input gradient waiting to be sent to the previous stage, [R, h] */
        workspace = mt__size_add(workspace, mt__size_mul3(c->sequence_parallel && tp > 1
                                                              ? (int64_t)c->micro_batch_size * c->seq_length / cp / tp
                                                              : (int64_t)c->micro_batch_size * c->seq_length / cp,
                                                          c->hidden_size, (int64_t)elem));
    if (moe_layers) /* the trainer's MoE state: expert bias, tokens per expert, global aux sums, logged losses */
        workspace = mt__size_add(workspace, (int64_t)MT_MOE_STATE_BYTES(moe_layers, c->num_experts));
    p->workspace_bytes = (size_t)workspace;
    if (c->fp8_format != MT_FP8_NONE) {
        mt_fp8_arena_layout f;
        mt_fp8_arena_layout_compute(c, fp8_layers, &f);
        p->fp8_bytes = f.total;
    }
    const int64_t piece = p->offload_elements < MT_OFFLOAD_PIECE_ELEMENTS ? p->offload_elements : MT_OFFLOAD_PIECE_ELEMENTS;
    p->offload_bytes = c->precision == MT_FP32 ? 0 : (size_t)piece * 4;
    p->host_pinned_bytes = (size_t)p->offload_elements * 12 + (size_t)MT_OFFLOAD_SLOTS * (size_t)piece * 4;
    const size_t parts[] = {p->parameter_bytes, p->master_bytes, p->gradient_bytes, p->optimizer_bytes,
                            p->activation_bytes, p->workspace_bytes, p->fp8_bytes, p->offload_bytes};
    int64_t total = 0;
    for (size_t k = 0; k < sizeof(parts) / sizeof(parts[0]); k++) total = mt__size_add(total, (int64_t)parts[k]);
    if (total >= MT__SIZE_MAX / 2) { /* saturated somewhere (the overhead below still has to fit) */
        mt_buffer_layout_free(&B);
        return mt_fail(err, MT_ERR_CONFIG, "pipeline rank %d would need more than 2^62 bytes (--micro-batch-size %d x "
                       "--seq-length %d activations of %d layers, %d in flight): not a size this build can plan",
                       pp_rank, c->micro_batch_size, c->seq_length, largest, p->in_flight);
    }
    p->total_bytes = (size_t)total;
    /* the communicators megatron.cu's process groups create on this rank */
    int comms = (c->world_size > 1) + (tp > 1) + (dp > 1) + (cp > 1); /* world, TP, DP x CP, CP */
    if (pp > 1) comms += 2 + (stage->embedding || stage->head); /* activations, gradients; the embedding group */
    p->overhead_bytes = MT_PLAN_CONTEXT_BYTES + MT_PLAN_CUBLAS_BYTES + (size_t)comms * MT_PLAN_NCCL_BYTES;
    p->device_bytes = p->total_bytes + p->overhead_bytes;
    mt_buffer_layout_free(&B);
    return MT_OK;
}

MT_DEF int64_t mt_grad_reduce_scratch(const mt_config* c, const mt_buffer_layout* B) {
    if (!c->grad_reduce_in_bf16 || c->data_parallel_size <= 1) return 0;
    int64_t largest = 0;
    for (int b = 0; b < B->num_buckets; b++)
        if (B->buckets[b].end - B->buckets[b].start > largest) largest = B->buckets[b].end - B->buckets[b].start;
    return largest;
}

MT_DEF size_t mt_memory_plan_bf16_grad_savings(const mt_memory_plan* p) {
    const size_t bf16_bytes = (size_t)p->buffer_elements * 2;
    return p->gradient_bytes > bf16_bytes ? p->gradient_bytes - bf16_bytes : 0;
}

MT_DEF mt_status mt_memory_plan_compute(const mt_config* c, const mt_plan_options* opts, mt_memory_plan* plan,
                                        mt_error* err) {
    mt_plan_options defaults;
    mt_plan_options_defaults(&defaults);
    const mt_plan_options* o = opts ? opts : &defaults;
    memset(plan, 0, sizeof(*plan));
    if (c->padded_vocab_size <= 0 || c->kv_channels <= 0 || c->ffn_hidden_size <= 0 || c->data_parallel_size <= 0 ||
        c->world_size != c->tensor_model_parallel_size * c->pipeline_model_parallel_size * c->data_parallel_size *
                             mt__cp_size(c))
        return mt_fail(err, MT_ERR_CONFIG, "the memory plan needs a finalized config (mt_config_finalize)");
    const int pp = c->pipeline_model_parallel_size;
    if (o->pp_rank >= pp) return mt_fail(err, MT_ERR_RANGE, "pipeline rank %d outside [0, %d)", o->pp_rank, pp);
    if (o->dp_rank < 0 || o->dp_rank >= c->data_parallel_size)
        return mt_fail(err, MT_ERR_RANGE, "data-parallel rank %d outside [0, %d)", o->dp_rank, c->data_parallel_size);
    if (o->cp_rank < 0 || o->cp_rank >= mt__cp_size(c))
        return mt_fail(err, MT_ERR_RANGE, "context-parallel rank %d outside [0, %d)", o->cp_rank, mt__cp_size(c));
    if (o->pp_rank >= 0) return mt__memory_plan_rank(c, o, o->pp_rank, plan, err);
    for (int r = 0; r < pp; r++) { /* the rank that needs the most */
        mt_memory_plan p;
        mt_status st = mt__memory_plan_rank(c, o, r, &p, err);
        if (st != MT_OK) return st;
        if (r == 0 || p.device_bytes > plan->device_bytes) *plan = p;
    }
    return MT_OK;
}

/* The cost model of --plan-layouts (DESIGN.md): a step's seconds on one GPU of the layout. */
#define MT_COST_TFLOPS 400.0         /* sustained bf16 GEMM throughput of one H100 (fp32: 50) */
#define MT_COST_NVLINK_GBS 150.0     /* TP and intra-node all-reduce bus bandwidth, GB/s */
#define MT_COST_NETWORK_GBS 25.0     /* inter-node bandwidth per GPU (DP across nodes), GB/s */
#define MT_COST_GPUS_PER_NODE 8
static double mt__layout_seconds(const mt_config* c, int tp, int pp, int vp, int dp) {
    const double world = (double)tp * pp * dp, M = mt_num_micro_batches(c);
    const double tflops = c->precision == MT_FP32 ? MT_COST_TFLOPS / 8 : MT_COST_TFLOPS;
    double compute = mt_flops_per_iteration(c, c->global_batch_size) / world / (tflops * 1e12);
    if (c->recompute.granularity == MT_RECOMPUTE_FULL) compute *= 4.0 / 3.0; /* the forward once more */
    double bubble = compute * (pp - 1) / (vp * M);
    /* TP: per layer and micro-batch, 2 forward and 2 backward all-reduces (or all-gather +
     * reduce-scatter) of [B S, h] activations, ring traffic 2 (TP-1)/TP of it */
    const double elem = c->precision == MT_FP32 ? 4 : 2;
    double act = (double)c->micro_batch_size * c->seq_length * c->hidden_size * elem;
    double tp_comm = tp > 1 ? 4.0 * (c->num_layers / (double)pp) * M * act * 2.0 * (tp - 1) / tp / (MT_COST_NVLINK_GBS * 1e9) : 0;
    /* DP: the fp32 gradients reduced once per step (2 (DP-1)/DP of them), over NVLink inside a node */
    double grads = 4.0 * (double)mt_num_parameters(c) / (tp * pp);
    double bw = tp * pp * dp <= MT_COST_GPUS_PER_NODE ? MT_COST_NVLINK_GBS : MT_COST_NETWORK_GBS;
    double dp_comm = dp > 1 ? grads * 2.0 * (dp - 1) / dp / (bw * 1e9) : 0;
    if (c->overlap_grad_reduce) dp_comm *= 0.25; /* mostly behind the backward */
    return compute + bubble + tp_comm + dp_comm;
}

MT_DEF mt_status mt_plan_layouts(const mt_config* c, const mt_plan_options* opts, int world, mt_layout_candidate* out,
                                 int max, int* count, mt_error* err) {
    *count = 0;
    mt_plan_options o;
    if (opts) o = *opts;
    else mt_plan_options_defaults(&o);
    o.pp_rank = -1;
    if (world < 1) return mt_fail(err, MT_ERR_ARG, "--world-size %d: must be >= 1", world);
    for (int tp = 1; tp <= world && tp <= MT_COST_GPUS_PER_NODE; tp++) {
        if (world % tp) continue;
        for (int pp = 1; pp <= world / tp; pp++) {
            if ((world / tp) % pp) continue;
            for (int vp = 1; vp <= (pp > 1 ? 4 : 1); vp++) {
                mt_config x = *c;
                x.tensor_model_parallel_size = tp;
                x.pipeline_model_parallel_size = pp;
                x.world_size = world;
                x.rank = 0;
                x.sequence_parallel = c->sequence_parallel;
                x.vocab_size = c->vocab_size;
                x.data_parallel_size = 0;
                x.global_batch_size = c->global_batch_size;
                x.virtual_pipeline_size = vp; /* the split and schedule of this layout, the defaults' */
                x.num_layers_per_virtual_pipeline_stage = 0;
                x.microbatch_group_size_per_vp_stage = 0;
                x.decoder_first_pipeline_num_layers = x.decoder_last_pipeline_num_layers = -1;
                if (x.train_samples > 0) x.train_iters = 0; /* derived again from the samples */
                /* no such layout: heads, ffn or batch that do not divide, a layer split or schedule that does
                 * not exist (Megatron's checks); one this build lacks is kept, marked refused with the line
                 * the trainer would give (the same function decides both) */
                if (mt__config_finalize(&x, 0, NULL) != MT_OK) continue;
                mt_memory_plan plan;
                if (mt_memory_plan_compute(&x, &o, &plan, NULL) != MT_OK) continue;
                if (*count >= max) return mt_fail(err, MT_ERR_RANGE, "more than %d layouts", max);
                mt_layout_candidate* k = &out[(*count)++];
                mt_error why;
                k->refused = mt_config_check_supported(&x, &why) != MT_OK;
                if (k->refused) memcpy(k->reason, why.message, sizeof(k->reason));
                else k->reason[0] = 0;
                k->tp = tp;
                k->pp = pp;
                k->vp = vp;
                k->dp = x.data_parallel_size;
                k->global_batch_size = x.global_batch_size;
                k->step_seconds = mt__layout_seconds(&x, tp, pp, vp, x.data_parallel_size);
                k->tokens_per_second = (double)x.global_batch_size * x.seq_length / k->step_seconds / world;
                k->plan = plan;
            }
        }
    }
    for (int i = 1; i < *count; i++) /* fastest first (insertion sort, stable) */
        for (int j = i; j > 0 && out[j].tokens_per_second > out[j - 1].tokens_per_second; j--) {
            mt_layout_candidate t = out[j];
            out[j] = out[j - 1];
            out[j - 1] = t;
        }
    return MT_OK;
}

/* 11. Thread pool ------------------------------------------------------------------------------ */

struct mt__pool_worker {
    struct mt_thread_pool* pool;
    int index;
};
struct mt_thread_pool {
    int size; /* workers, the caller included */
    pthread_t* threads;
    struct mt__pool_worker* workers;
    pthread_mutex_t lock;
    pthread_cond_t start, done;
    void (*fn)(void* arg, int worker, int workers);
    void* arg;
    uint64_t generation;
    int pending, quit, started;
};

static void* mt__pool_main(void* p) {
    struct mt__pool_worker* w = (struct mt__pool_worker*)p;
    mt_thread_pool* pool = w->pool;
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool->lock);
        while (pool->generation == seen && !pool->quit) pthread_cond_wait(&pool->start, &pool->lock);
        if (pool->quit) {
            pthread_mutex_unlock(&pool->lock);
            return NULL;
        }
        seen = pool->generation;
        void (*fn)(void*, int, int) = pool->fn;
        void* arg = pool->arg;
        pthread_mutex_unlock(&pool->lock);
        fn(arg, w->index, pool->size);
        pthread_mutex_lock(&pool->lock);
        if (--pool->pending == 0) pthread_cond_signal(&pool->done);
        pthread_mutex_unlock(&pool->lock);
    }
}

MT_DEF void mt_thread_pool_free(mt_thread_pool* pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    pool->quit = 1;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->started; i++) pthread_join(pool->threads[i], NULL);
    pthread_cond_destroy(&pool->start);
    pthread_cond_destroy(&pool->done);
    pthread_mutex_destroy(&pool->lock);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

MT_DEF mt_status mt_thread_pool_create(mt_thread_pool** out, int threads, mt_error* err) {
    *out = NULL;
    if (threads < 1 || threads > 1024) return mt_fail(err, MT_ERR_ARG, "thread pool: %d threads (1 to 1024)", threads);
    mt_thread_pool* pool = (mt_thread_pool*)calloc(1, sizeof(mt_thread_pool));
    if (!pool) return mt_fail(err, MT_ERR_OOM, "cannot allocate a thread pool");
    pool->size = threads;
    pool->threads = (pthread_t*)calloc((size_t)threads, sizeof(pthread_t));
    pool->workers = (struct mt__pool_worker*)calloc((size_t)threads, sizeof(*pool->workers));
    if (!pool->threads || !pool->workers || pthread_mutex_init(&pool->lock, NULL) != 0) {
        free(pool->threads);
        free(pool->workers);
        free(pool);
        return mt_fail(err, MT_ERR_OOM, "cannot set up a thread pool of %d threads", threads);
    }
    pthread_cond_init(&pool->start, NULL);
    pthread_cond_init(&pool->done, NULL);
    for (int i = 1; i < threads; i++) {
        pool->workers[i].pool = pool;
        pool->workers[i].index = i;
        if (pthread_create(&pool->threads[pool->started], NULL, mt__pool_main, &pool->workers[i]) != 0) {
            mt_thread_pool_free(pool);
            return mt_fail(err, MT_ERR_OOM, "cannot start thread %d of a pool of %d", i, threads);
        }
        pool->started++;
    }
    *out = pool;
    return MT_OK;
}

MT_DEF int mt_thread_pool_size(const mt_thread_pool* pool) { return pool ? pool->size : 1; }

MT_DEF void mt_thread_pool_run(mt_thread_pool* pool, void (*fn)(void* arg, int worker, int workers), void* arg) {
    if (!pool || pool->size == 1) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->pending = pool->size - 1;
    pool->generation++;
    pthread_cond_broadcast(&pool->start);
    pthread_mutex_unlock(&pool->lock);
    fn(arg, 0, pool->size);
    pthread_mutex_lock(&pool->lock);
    while (pool->pending > 0) pthread_cond_wait(&pool->done, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
}

/* 12. CPU AdamW (optimizer offload) ------------------------------------------------------------ */

MT_DEF void mt_adamw_cpu_scalar(const mt_adamw_step* h, int decay, const float* grad, float* master, float* m, float* v,
                                int64_t n) {
    const float wd = decay ? h->weight_decay : 0.0f, one_minus_beta1 = 1.0f - h->beta1,
                one_minus_beta2 = 1.0f - h->beta2;
    for (int64_t i = 0; i < n; i++) {
        const float g = grad[i] * h->grad_scale;
        const float mi = fmaf(m[i], h->beta1, one_minus_beta1 * g);
        const float vi = fmaf(v[i], h->beta2, g * (one_minus_beta2 * g));
        const float update = fmaf(master[i], wd, (mi / h->bias_correction1) / (sqrtf(vi / h->bias_correction2) + h->eps));
        master[i] = fmaf(-update, h->lr, master[i]);
        m[i] = mi;
        v[i] = vi;
    }
}

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define MT__ADAMW_AVX2 1
/* 8 elements per instruction; the same operations as the scalar loop, each correctly rounded */
__attribute__((target("avx2,fma"))) static void mt__adamw_avx2(const mt_adamw_step* h, float wd, const float* grad,
                                                                 float* master, float* m, float* v, int64_t n) {
    const __m256 gs = _mm256_set1_ps(h->grad_scale), b1 = _mm256_set1_ps(h->beta1), b2 = _mm256_set1_ps(h->beta2);
    const __m256 omb1 = _mm256_set1_ps(1.0f - h->beta1), omb2 = _mm256_set1_ps(1.0f - h->beta2);
    const __m256 bc1 = _mm256_set1_ps(h->bias_correction1), bc2 = _mm256_set1_ps(h->bias_correction2);
    const __m256 eps = _mm256_set1_ps(h->eps), decay = _mm256_set1_ps(wd), lr = _mm256_set1_ps(h->lr);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(grad + i), gs);
        const __m256 mi = _mm256_fmadd_ps(_mm256_loadu_ps(m + i), b1, _mm256_mul_ps(omb1, g));
        const __m256 vi = _mm256_fmadd_ps(_mm256_loadu_ps(v + i), b2, _mm256_mul_ps(g, _mm256_mul_ps(omb2, g)));
        const __m256 p = _mm256_loadu_ps(master + i);
        const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_div_ps(vi, bc2)), eps);
        const __m256 update = _mm256_fmadd_ps(p, decay, _mm256_div_ps(_mm256_div_ps(mi, bc1), denom));
        _mm256_storeu_ps(master + i, _mm256_fnmadd_ps(update, lr, p)); /* p - update * lr, one rounding */
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
    }
    if (i < n) mt_adamw_cpu_scalar(h, wd != 0.0f, grad + i, master + i, m + i, v + i, n - i);
}
#endif

MT_DEF void mt_adamw_cpu(const mt_adamw_step* h, int decay, const float* grad, float* master, float* m, float* v,
                         int64_t n) {
#ifdef MT__ADAMW_AVX2
    __builtin_cpu_init(); /* idempotent; then the CPU's features are a table look-up */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        mt_adamw_step k = *h;
        if (!decay) k.weight_decay = 0.0f;
        mt__adamw_avx2(&k, k.weight_decay, grad, master, m, v, n);
        return;
    }
#endif
    mt_adamw_cpu_scalar(h, decay, grad, master, m, v, n);
}

typedef struct {
    const mt_adamw_step* h;
    const mt_adamw_segment* segments;
    int num_segments;
    int64_t total;
    const float* grad;
    float *master, *m, *v;
} mt__adamw_job;

/* Worker w of W: elements [w T / W, (w+1) T / W) of the segments' concatenation, cut at 16 elements. */
static void mt__adamw_worker(void* arg, int w, int workers) {
    const mt__adamw_job* j = (const mt__adamw_job*)arg;
    int64_t lo = j->total * w / workers / 16 * 16, hi = w == workers - 1 ? j->total : j->total * (w + 1) / workers / 16 * 16;
    int64_t at = 0; /* start of the current segment in the concatenation */
    for (int s = 0; s < j->num_segments && at < hi; s++) {
        const mt_adamw_segment* g = &j->segments[s];
        int64_t a = lo > at ? lo : at, b = hi < at + g->length ? hi : at + g->length;
        if (a < b) {
            int64_t k = g->offset + (a - at);
            mt_adamw_step h = *j->h;
            if (g->decoupled) h.lr = h.lr_decoupled;
            mt_adamw_cpu(&h, g->decay, j->grad + k, j->master + k, j->m + k, j->v + k, b - a);
        }
        at += g->length;
    }
}

MT_DEF void mt_adamw_cpu_parallel(mt_thread_pool* pool, const mt_adamw_step* h, const mt_adamw_segment* segments,
                                  int num_segments, const float* grad, float* master, float* m, float* v) {
    mt__adamw_job job;
    job.h = h;
    job.segments = segments;
    job.num_segments = num_segments;
    job.total = 0;
    for (int s = 0; s < num_segments; s++) job.total += segments[s].length;
    job.grad = grad;
    job.master = master;
    job.m = m;
    job.v = v;
    mt_thread_pool_run(pool, mt__adamw_worker, &job);
}

/* 13. Checkpoint files: header and checks, names, tracker, retention, commit, integrity -------- */

MT_DEF void mt_checkpoint_header_init(int64_t* h, const mt_config* c) {
    memset(h, 0, sizeof(int64_t) * MT_CK_HEADER_WORDS);
    h[MT_CK_MAGIC] = MT_CKPT_MAGIC;
    h[MT_CK_VERSION] = MT_CKPT_VERSION;
    h[MT_CK_LAYERS] = c->num_layers;
    h[MT_CK_HIDDEN] = c->hidden_size;
    h[MT_CK_HEADS] = c->num_attention_heads;
    h[MT_CK_GROUPS] = c->num_query_groups;
    h[MT_CK_KV] = c->kv_channels;
    h[MT_CK_FFN] = c->ffn_hidden_size;
    h[MT_CK_VOCAB] = c->padded_vocab_size;
    h[MT_CK_POSITIONS] = c->max_position_embeddings;
    h[MT_CK_NUM_PARAMS] = mt_num_parameters(c);
    h[MT_CK_PRECISION] = c->precision;
    h[MT_CK_SEED] = (int64_t)c->seed;
    h[MT_CK_TP] = c->tensor_model_parallel_size;
    h[MT_CK_PP] = c->pipeline_model_parallel_size;
    h[MT_CK_NORMALIZATION] = c->normalization;
    h[MT_CK_SWIGLU] = c->swiglu != 0;
    h[MT_CK_POSITION_TYPE] = c->position_embedding_type;
    if (c->position_embedding_type == MT_POSITION_ROPE) {
        double scaling = c->use_rope_scaling ? c->rope_scaling_factor : 0.0;
        memcpy(&h[MT_CK_ROTARY_BASE_BITS], &c->rotary_base, sizeof(double));
        memcpy(&h[MT_CK_ROTARY_PERCENT_BITS], &c->rotary_percent, sizeof(double));
        memcpy(&h[MT_CK_ROPE_SCALING_FACTOR_BITS], &scaling, sizeof(double));
    }
    h[MT_CK_UNTIED] = c->untie_embeddings_and_output_weights != 0;
    h[MT_CK_NO_BIAS_LINEAR] = !c->add_bias_linear;
    h[MT_CK_LAYERNORM_1P] = c->apply_layernorm_1p != 0;
    h[MT_CK_SQUARED_RELU] = c->squared_relu != 0;
    h[MT_CK_QK_LAYERNORM] = c->qk_layernorm != 0;
    memcpy(&h[MT_CK_NORM_EPS_BITS], &c->norm_epsilon, sizeof(double));
    h[MT_CK_TRUE_VOCAB] = c->vocab_size;
    if (mt_moe_num_layers(c) > 0) {
        h[MT_CK_NUM_EXPERTS] = c->num_experts;
        h[MT_CK_MOE_FFN] = mt_moe_ffn(c);
        h[MT_CK_MOE_SHARED] = c->moe_shared_expert_intermediate_size;
        h[MT_CK_MOE_SHARED_GATE] = c->moe_shared_expert_intermediate_size > 0 && c->moe_shared_expert_gate;
        h[MT_CK_MOE_LAYERS] = mt_moe_num_layers(c);
        h[MT_CK_MOE_LAYER_FREQ] = mt_moe_layers_word(c);
        h[MT_CK_MOE_EXPERT_BIAS] = c->moe_router_enable_expert_bias != 0;
        h[MT_CK_EP] = c->expert_model_parallel_size > 1 ? c->expert_model_parallel_size : 0;
    }
}

MT_DEF int64_t mt_moe_layers_word(const mt_config* c) {
    const int L = c->num_layers;
    if (mt_moe_num_layers(c) == 0) return 0;
    if (c->moe_layer_pattern_len <= 0) return c->moe_layer_freq < L ? c->moe_layer_freq : L; /* past L: layer 0 alone */
    /* a pattern that is some N's layers: layer 0, then the next MoE layer at N (none: N = L) */
    int n = L;
    for (int l = 1; l < L && l < c->moe_layer_pattern_len; l++)
        if (mt_moe_layer(c, l)) { n = l; break; }
    int same = mt_moe_layer(c, 0);
    for (int l = 0; same && l < L; l++) same = mt_moe_layer(c, l) == (l % n == 0);
    if (same) return n;
    uint64_t x = 14695981039346656037ULL;
    for (int l = 0; l < L; l++) x = (x ^ (uint64_t)(mt_moe_layer(c, l) ? 1 : 0)) * 1099511628211ULL;
    return (int64_t)(x | (1ULL << 63));
}

/* The MoE fields of a header's model; the layers from MT_CK_MOE_LAYER_FREQ's N (a pattern that is no N's,
 * which this build does not write, cannot be rebuilt: 0). */
static int mt__moe_from_header(mt_config* c, const int64_t* h) {
    c->num_experts = (int)h[MT_CK_NUM_EXPERTS];
    c->moe_ffn_hidden_size = (int)h[MT_CK_MOE_FFN];
    c->moe_shared_expert_intermediate_size = (int)h[MT_CK_MOE_SHARED];
    c->moe_shared_expert_gate = h[MT_CK_MOE_SHARED_GATE] != 0;
    c->moe_router_enable_expert_bias = h[MT_CK_MOE_EXPERT_BIAS] != 0;
    c->moe_layer_pattern_len = 0;
    c->moe_layer_freq = 1;
    if (c->num_experts <= 0) return 1;
    if (h[MT_CK_MOE_LAYER_FREQ] < 1 || h[MT_CK_MOE_LAYER_FREQ] > c->num_layers) return 0;
    c->moe_layer_freq = (int)h[MT_CK_MOE_LAYER_FREQ];
    return mt_moe_num_layers(c) == h[MT_CK_MOE_LAYERS];
}

MT_DEF void mt_config_from_checkpoint_header(mt_config* c, const int64_t* h) {
    c->num_layers = (int)h[MT_CK_LAYERS];
    c->hidden_size = (int)h[MT_CK_HIDDEN];
    c->num_attention_heads = (int)h[MT_CK_HEADS];
    c->num_query_groups = (int)h[MT_CK_GROUPS];
    c->kv_channels = (int)h[MT_CK_KV];
    c->ffn_hidden_size = (int)h[MT_CK_FFN];
    c->padded_vocab_size = h[MT_CK_VOCAB];
    c->vocab_size = h[MT_CK_VOCAB]; /* pads to itself; the true size is h[MT_CK_TRUE_VOCAB] */
    c->max_position_embeddings = (int)h[MT_CK_POSITIONS];
    c->normalization = (mt_normalization)h[MT_CK_NORMALIZATION];
    c->swiglu = (int)h[MT_CK_SWIGLU];
    c->position_embedding_type = (mt_position_embedding)h[MT_CK_POSITION_TYPE];
    if (c->position_embedding_type == MT_POSITION_ROPE) {
        double scaling;
        memcpy(&c->rotary_base, &h[MT_CK_ROTARY_BASE_BITS], sizeof(double));
        memcpy(&c->rotary_percent, &h[MT_CK_ROTARY_PERCENT_BITS], sizeof(double));
        memcpy(&scaling, &h[MT_CK_ROPE_SCALING_FACTOR_BITS], sizeof(double));
        c->use_rope_scaling = scaling > 0;
        if (scaling > 0) c->rope_scaling_factor = scaling;
    }
    c->untie_embeddings_and_output_weights = (int)h[MT_CK_UNTIED];
    c->add_bias_linear = !h[MT_CK_NO_BIAS_LINEAR];
    c->apply_layernorm_1p = h[MT_CK_LAYERNORM_1P] != 0;
    c->squared_relu = h[MT_CK_SQUARED_RELU] != 0;
    c->qk_layernorm = h[MT_CK_QK_LAYERNORM] != 0;
    if (h[MT_CK_NORM_EPS_BITS]) memcpy(&c->norm_epsilon, &h[MT_CK_NORM_EPS_BITS], sizeof(double));
    mt__moe_from_header(c, h);
}

MT_DEF mt_status mt_checkpoint_header_check(const int64_t* h, const char* path, mt_config* cfg_out, mt_error* err) {
    if (h[MT_CK_MAGIC] != MT_CKPT_MAGIC || h[MT_CK_VERSION] != MT_CKPT_VERSION)
        return mt_fail(err, MT_ERR_FORMAT, "%s is not a megatron.c checkpoint (bad magic or version)", path);
    /* words and the range each must be in (all inclusive) */
    static const struct { int word; int64_t lo, hi; const char* what; } range[] = {
        {MT_CK_LAYERS, 1, INT32_MAX, "--num-layers"},
        {MT_CK_HIDDEN, 1, INT32_MAX, "--hidden-size"},
        {MT_CK_HEADS, 1, INT32_MAX, "--num-attention-heads"},
        {MT_CK_GROUPS, 1, INT32_MAX, "--num-query-groups"},
        {MT_CK_KV, 1, INT32_MAX, "--kv-channels"},
        {MT_CK_FFN, 1, INT32_MAX, "--ffn-hidden-size"},
        {MT_CK_VOCAB, 1, INT64_MAX, "the padded vocabulary"},
        {MT_CK_POSITIONS, 1, INT32_MAX, "--max-position-embeddings"},
        {MT_CK_NUM_PARAMS, 1, INT64_MAX, "the parameter count"},
        {MT_CK_PRECISION, MT_FP32, MT_FP16, "the precision"},
        {MT_CK_ITERATION, 0, INT64_MAX, "the iteration"},
        {MT_CK_CONSUMED, 0, INT64_MAX, "the consumed samples"},
        {MT_CK_SCHED_STEPS, 0, INT64_MAX, "the scheduler's steps"},
        {MT_CK_ADAM_STEP, 0, INT64_MAX, "the Adam step"},
        {MT_CK_GROWTH, 0, INT32_MAX, "the loss scaler's growth tracker"},
        {MT_CK_HYSTERESIS, INT32_MIN, INT32_MAX, "the loss scaler's hysteresis tracker"}, /* counts down past 0 */
        {MT_CK_TP, 1, INT32_MAX, "--tensor-model-parallel-size"},
        {MT_CK_PP, 1, INT32_MAX, "--pipeline-model-parallel-size"},
        {MT_CK_SHARDED_DP, 0, INT32_MAX, "the optimizer's sharding"},
        {MT_CK_DP_RANK, 0, INT32_MAX, "the data-parallel rank"},
        {MT_CK_SHARD_NUMEL, 0, INT64_MAX / 16, "the shard size"},
        {MT_CK_NORMALIZATION, 0, 1, "the normalization"},
        {MT_CK_SWIGLU, 0, 1, "--swiglu"},
        {MT_CK_POSITION_TYPE, MT_POSITION_LEARNED, MT_POSITION_NONE, "the position embedding type"},
        {MT_CK_UNTIED, 0, 1, "--untie-embeddings-and-output-weights"},
        {MT_CK_NO_BIAS_LINEAR, 0, 1, "--disable-bias-linear"},
        {MT_CK_LAYERNORM_1P, 0, 1, "--apply-layernorm-1p"},
        {MT_CK_SQUARED_RELU, 0, 1, "--squared-relu"},
        {MT_CK_QK_LAYERNORM, 0, 1, "--qk-layernorm"},
        {MT_CK_TRUE_VOCAB, 0, INT64_MAX, "the true vocabulary"},
        {MT_CK_TP_RANK, 0, INT32_MAX, "the tensor-parallel rank"},
        {MT_CK_FP8_TENSORS, 0, INT32_MAX, "the FP8 tensor count"},
        {MT_CK_FP8_HISTORY_LEN, 0, 65536, "the FP8 amax history length"},
        {MT_CK_FP8_HISTORY_POS, 0, 65535, "the FP8 amax history slot"},
        {MT_CK_PP_RANK, 0, INT32_MAX, "the pipeline rank"},
        {MT_CK_VP, 0, MT_PP_MAX_CHUNKS, "the virtual pipeline stages"},
        {MT_CK_STAGE_NUMEL, 0, INT64_MAX, "the stage's parameter count"},
        {MT_CK_DDP_OVERLAP, 0, 2, "the distributed optimizer's --overlap-grad-reduce"},
        {MT_CK_DDP_BUCKET_SIZE, 0, INT64_MAX, "the distributed optimizer's --ddp-bucket-size"},
        {MT_CK_MANIFESTED, 0, 1, "the manifest mark"},
        {MT_CK_NUM_EXPERTS, 0, INT32_MAX, "--num-experts"},
        {MT_CK_MOE_FFN, 0, INT32_MAX, "--moe-ffn-hidden-size"},
        {MT_CK_MOE_SHARED, 0, INT32_MAX, "--moe-shared-expert-intermediate-size"},
        {MT_CK_MOE_SHARED_GATE, 0, 1, "--moe-shared-expert-gate"},
        {MT_CK_MOE_LAYERS, 0, INT32_MAX, "the MoE layers"},
        {MT_CK_MOE_EXPERT_BIAS, 0, 1, "--moe-router-enable-expert-bias"},
        {MT_CK_EP, 0, 65536, "--expert-model-parallel-size"},
        {MT_CK_EP_RANK, 0, 65535, "the expert-parallel rank"},
    };
    for (size_t i = 0; i < sizeof(range) / sizeof(range[0]); i++)
        if (h[range[i].word] < range[i].lo || h[range[i].word] > range[i].hi)
            return mt_fail(err, MT_ERR_FORMAT, "%s: header word %d (%s) is %lld, outside [%lld, %lld]", path,
                           range[i].word, range[i].what, (long long)h[range[i].word], (long long)range[i].lo,
                           (long long)range[i].hi);
    if (h[MT_CK_NUM_EXPERTS] > 0 && h[MT_CK_LAYERS] > MT_MAX_MOE_PATTERN) /* before any loop over its layers */
        return mt_fail(err, MT_ERR_FORMAT, "%s: an MoE model of %lld layers (this build reads at most %d)", path,
                       (long long)h[MT_CK_LAYERS], MT_MAX_MOE_PATTERN);
    /* the words that relate to each other */
    const char* bad = NULL;
    if (h[MT_CK_HEADS] % h[MT_CK_GROUPS]) bad = "the attention heads are not a multiple of the query groups";
    else if (h[MT_CK_SWIGLU] && h[MT_CK_SQUARED_RELU]) bad = "both --swiglu and --squared-relu are set";
    else if (h[MT_CK_TRUE_VOCAB] > h[MT_CK_VOCAB]) bad = "the true vocabulary exceeds the padded one";
    else if (h[MT_CK_TP_RANK] >= h[MT_CK_TP]) bad = "the tensor-parallel rank is not below the tensor-parallel size";
    else if (h[MT_CK_PP_RANK] >= h[MT_CK_PP]) bad = "the pipeline rank is not below the pipeline-parallel size";
    else if (h[MT_CK_PP] > 1 ? h[MT_CK_VP] < 1 || h[MT_CK_STAGE_NUMEL] < 1 || h[MT_CK_STAGE_NUMEL] > h[MT_CK_NUM_PARAMS]
                             : h[MT_CK_VP] != 0 || h[MT_CK_STAGE_NUMEL] != 0)
        bad = "the pipeline stage words (virtual stages, parameter count) do not fit the pipeline-parallel size";
    else if (h[MT_CK_EP] == 1 || h[MT_CK_EP_RANK] >= (h[MT_CK_EP] > 1 ? h[MT_CK_EP] : 1) ||
             (h[MT_CK_EP] > 1 && (h[MT_CK_NUM_EXPERTS] == 0 || h[MT_CK_NUM_EXPERTS] % h[MT_CK_EP] ||
                                  h[MT_CK_SHARDED_DP] % h[MT_CK_EP])))
        bad = "the expert-parallel words (size, rank) do not fit the experts or the optimizer's sharding";
    else if (h[MT_CK_DP_RANK] >= (h[MT_CK_SHARDED_DP] > h[MT_CK_EP] ? h[MT_CK_SHARDED_DP]
                                  : h[MT_CK_EP] > 1 ? h[MT_CK_EP] : 1))
        bad = "the data-parallel rank is not below the optimizer's sharding";
    else if (h[MT_CK_EP] > 1 && h[MT_CK_DP_RANK] % h[MT_CK_EP] != h[MT_CK_EP_RANK])
        bad = "the data-parallel rank is not one of the expert-parallel rank's (DP rank % EP = EP rank)";
    else if (h[MT_CK_FP8_TENSORS] > 0 && (h[MT_CK_FP8_HISTORY_LEN] < 1 || h[MT_CK_FP8_HISTORY_POS] >= h[MT_CK_FP8_HISTORY_LEN]))
        bad = "the FP8 amax history (length and slot) is inconsistent";
    else if (h[MT_CK_NUM_EXPERTS] == 0 ? h[MT_CK_MOE_FFN] || h[MT_CK_MOE_SHARED] || h[MT_CK_MOE_SHARED_GATE] ||
                                             h[MT_CK_MOE_LAYERS] || h[MT_CK_MOE_LAYER_FREQ] || h[MT_CK_MOE_EXPERT_BIAS]
                                       : h[MT_CK_MOE_FFN] < 1 || h[MT_CK_MOE_LAYERS] < 1 ||
                                             h[MT_CK_MOE_LAYERS] > h[MT_CK_LAYERS] ||
                                             (h[MT_CK_MOE_SHARED_GATE] && !h[MT_CK_MOE_SHARED]))
        bad = "the MoE words (experts, expert width, shared expert and its gate, MoE layers, expert bias) are inconsistent";
    else if (h[MT_CK_NUM_EXPERTS] > 0) {
        mt_config moe;
        mt_config_defaults(&moe);
        moe.num_layers = (int)h[MT_CK_LAYERS];
        if (!mt__moe_from_header(&moe, h))
            bad = "its MoE layers are no --moe-layer-freq N's, or not as many as it says (a pattern this build does not write)";
    }
    if (bad) return mt_fail(err, MT_ERR_FORMAT, "%s: %s", path, bad);
    double loss_scale, eps, base, percent, scaling;
    memcpy(&loss_scale, &h[MT_CK_LOSS_SCALE_BITS], sizeof(double));
    memcpy(&eps, &h[MT_CK_NORM_EPS_BITS], sizeof(double));
    if (!isfinite(loss_scale) || !(loss_scale > 0))
        return mt_fail(err, MT_ERR_FORMAT, "%s: the loss scale %g is not a finite number > 0", path, loss_scale);
    if (h[MT_CK_NORM_EPS_BITS] != 0 && !(isfinite(eps) && eps > 0)) /* 0: a file from before the word */
        return mt_fail(err, MT_ERR_FORMAT, "%s: the norm epsilon %g is not a finite number > 0", path, eps);
    if (h[MT_CK_POSITION_TYPE] == MT_POSITION_ROPE) {
        memcpy(&base, &h[MT_CK_ROTARY_BASE_BITS], sizeof(double));
        memcpy(&percent, &h[MT_CK_ROTARY_PERCENT_BITS], sizeof(double));
        memcpy(&scaling, &h[MT_CK_ROPE_SCALING_FACTOR_BITS], sizeof(double));
        if (!(isfinite(base) && base > 0 && isfinite(percent) && percent > 0 && percent <= 1 && isfinite(scaling) &&
              (scaling == 0 || scaling >= 1)))
            return mt_fail(err, MT_ERR_FORMAT, "%s: the rope words (base %g, percent %g, scaling %g) are invalid", path,
                           base, percent, scaling);
    }
    /* the model's sizes: every product the trainer forms from them, overflow-checked */
    mt_config c;
    mt_config_defaults(&c);
    mt_config_from_checkpoint_header(&c, h);
    c.seq_length = 1; /* only the model's own sizes matter here */
    c.tensor_model_parallel_size = (int)h[MT_CK_TP];
    mt_error size_err;
    if (mt_config_size_check(&c, &size_err) != MT_OK)
        return mt_fail(err, MT_ERR_FORMAT, "%s: %s", path, size_err.message);
    if (h[MT_CK_NUM_EXPERTS] > 0) {
        /* the MoE tensors (which mt_config_size_check does not count), bounded per MoE layer with SwiGLU's
         * widths and every bias: E (3 fe h + 2 fe + 2 h + 1) + 3 fs h + h; then the expert bias (MoE layers x
         * E, below the routers' weights) fits too */
        const int64_t E = h[MT_CK_NUM_EXPERTS], fe = h[MT_CK_MOE_FFN], fs = h[MT_CK_MOE_SHARED], hid = h[MT_CK_HIDDEN];
        int64_t a = 0, b = 0, per_expert = 0, shared = 0, moe = 0;
        int over = mt_mul_overflows_i64(fe, hid, &a) || mt_mul_overflows_i64(a, 3, &a) ||
                   mt_add_overflows_i64(a, 2 * fe + 2 * hid + 1, &per_expert) ||
                   mt_mul_overflows_i64(per_expert, E, &moe) || mt_mul_overflows_i64(fs, hid, &b) ||
                   mt_mul_overflows_i64(b, 3, &b) || mt_add_overflows_i64(b, hid, &shared) ||
                   mt_add_overflows_i64(moe, shared, &moe) || mt_mul_overflows_i64(moe, h[MT_CK_MOE_LAYERS], &moe);
        if (over || moe > INT64_MAX / 64)
            return mt_fail(err, MT_ERR_FORMAT, "%s: the MoE tensors' sizes (%lld experts of width %lld, shared expert "
                           "%lld, %lld MoE layers) overflow", path, (long long)E, (long long)fe, (long long)fs,
                           (long long)h[MT_CK_MOE_LAYERS]);
    }
    int64_t n = mt_param_layout(&c, NULL);
    if (n != h[MT_CK_NUM_PARAMS])
        return mt_fail(err, MT_ERR_FORMAT, "%s: the header says %lld parameters but its model has %lld", path,
                       (long long)h[MT_CK_NUM_PARAMS], (long long)n);
    if (h[MT_CK_VOCAB] % h[MT_CK_TP] || h[MT_CK_HEADS] % h[MT_CK_TP] || h[MT_CK_GROUPS] % h[MT_CK_TP] ||
        h[MT_CK_FFN] % h[MT_CK_TP])
        return mt_fail(err, MT_ERR_FORMAT, "%s: the model does not divide over %lld tensor-parallel ranks", path,
                       (long long)h[MT_CK_TP]);
    if (cfg_out) {
        mt_config_defaults(cfg_out);
        mt_config_from_checkpoint_header(cfg_out, h);
    }
    return MT_OK;
}

/* A model file's floats after its header, in order: the arrays, the FP8 state, then the expert bias
 * (*bias_at: where it starts, *bias_numel: its size); the one place of that rule. */
static int64_t mt__ckpt_model_floats(const int64_t* h, int64_t* bias_at, int64_t* bias_numel) {
    mt_config c;
    mt_config_defaults(&c);
    mt_config_from_checkpoint_header(&c, h);
    c.tensor_model_parallel_size = (int)h[MT_CK_TP];
    c.expert_model_parallel_size = h[MT_CK_EP] > 1 ? (int)h[MT_CK_EP] : 1;
    const int64_t arrays = h[MT_CK_SHARDED_DP] > 0 ? 1 : 3;
    /* the file's tensors: its pipeline stage's (this TP rank's shard of them), or its TP shard */
    const int64_t numel = h[MT_CK_PP] > 1 ? h[MT_CK_STAGE_NUMEL] : mt_param_layout_shard(&c, NULL);
    /* FP8: scale [n], scale_inv [n, 4] (16-byte slots), history [n, len] */
    const int64_t fp8 = h[MT_CK_FP8_TENSORS] * (1 + 4 + h[MT_CK_FP8_HISTORY_LEN]);
    /* the routers' expert bias [MoE layers, experts] (the header check bounds both words by the model's
     * router weights, so the product fits) */
    const int64_t bias = h[MT_CK_MOE_EXPERT_BIAS] ? h[MT_CK_MOE_LAYERS] * h[MT_CK_NUM_EXPERTS] : 0;
    if (bias_at) *bias_at = arrays * numel + fp8;
    if (bias_numel) *bias_numel = bias;
    return arrays * numel + fp8 + bias;
}

MT_DEF int64_t mt_checkpoint_file_bytes(const int64_t* h, int shard_file) {
    const int64_t header = (int64_t)sizeof(int64_t) * MT_CK_HEADER_WORDS;
    if (shard_file) return header + 3 * 4 * h[MT_CK_SHARD_NUMEL];
    return header + 4 * mt__ckpt_model_floats(h, NULL, NULL);
}

MT_DEF int64_t mt_checkpoint_expert_bias_numel(const int64_t* h, int64_t* at) {
    int64_t numel = 0;
    mt__ckpt_model_floats(h, at, &numel);
    return numel;
}

/* ---- one rank's files: their names, the rank words of their headers, the checks of a reader ---- */

/* bytes at offset of file fd, all of them: 0, or -1 (an error, or the file ends first) */
static int mt__ckpt_read_at(int fd, int64_t offset, void* out, size_t bytes) {
    if (lseek(fd, (off_t)offset, SEEK_SET) == (off_t)-1) return -1;
    char* p = (char*)out;
    while (bytes > 0) {
        ssize_t k = read(fd, p, bytes < ((size_t)1 << 30) ? bytes : ((size_t)1 << 30));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        p += k;
        bytes -= (size_t)k;
    }
    return 0;
}

MT_DEF void mt_ckpt_rank_dir_ep(char* buf, size_t cap, const char* iter_dir, int pp, int ep, int tp_rank, int pp_rank,
                                int ep_rank) {
    char tail[16] = "";
    if (ep > 1) snprintf(tail, sizeof(tail), "_%03d", ep_rank);
    if (pp > 1) snprintf(buf, cap, "%s/mp_rank_%02d_%03d%s", iter_dir, tp_rank, pp_rank, tail);
    else snprintf(buf, cap, "%s/mp_rank_%02d%s", iter_dir, tp_rank, tail);
}

MT_DEF void mt_ckpt_rank_dir(char* buf, size_t cap, const char* iter_dir, int pp, int tp_rank, int pp_rank) {
    mt_ckpt_rank_dir_ep(buf, cap, iter_dir, pp, 1, tp_rank, pp_rank, 0);
}

MT_DEF void mt_ckpt_file_path(char* buf, size_t cap, const char* rank_dir, int dp_shard) {
    if (dp_shard < 0) snprintf(buf, cap, "%s/model_optim_rng.bin", rank_dir);
    else snprintf(buf, cap, "%s/distrib_optim_dp%03d.bin", rank_dir, dp_shard);
}

MT_DEF int mt_ckpt_rank_files(const mt_ckpt_rank* r, mt_ckpt_file files[2]) {
    char rank_dir[48];
    const int ep = r->ep > 1 ? r->ep : 1;
    mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), "", r->pp, ep, r->tp_rank, r->pp_rank, r->dp_rank % ep); /* "/mp_rank_..." */
    int n = 0;
    if (r->sharded) {
        mt_ckpt_file_path(files[n].path, sizeof(files[n].path), rank_dir + 1, r->dp_rank);
        files[n++].shard = 1;
    }
    if (r->dp_rank < ep) { /* the first DP rank of those holding its experts (DP rank 0 at EP = 1) */
        mt_ckpt_file_path(files[n].path, sizeof(files[n].path), rank_dir + 1, -1);
        files[n++].shard = 0;
    }
    return n;
}

MT_DEF void mt_checkpoint_header_set_rank(int64_t* h, const mt_ckpt_rank* r) {
    h[MT_CK_SHARDED_DP] = r->sharded ? r->dp : 0;
    h[MT_CK_DP_RANK] = r->dp_rank;
    h[MT_CK_SHARD_NUMEL] = r->sharded ? r->shard_numel : 0;
    h[MT_CK_DDP_OVERLAP] = r->sharded ? 1 + (r->ddp.overlap_grad_reduce != 0) : 0;
    h[MT_CK_DDP_BUCKET_SIZE] = r->sharded ? r->ddp.ddp_bucket_size : 0;
    h[MT_CK_TP_RANK] = r->tp_rank;
    h[MT_CK_PP_RANK] = r->pp_rank;
    h[MT_CK_VP] = r->pp > 1 ? r->vp : 0;
    h[MT_CK_STAGE_NUMEL] = r->pp > 1 ? r->stage_numel : 0;
    h[MT_CK_EP] = r->ep > 1 ? r->ep : 0;
    h[MT_CK_EP_RANK] = r->ep > 1 ? r->dp_rank % r->ep : 0;
}

/* The file's size on disk (bytes; -1: unknown) against the size its header describes. */
static mt_status mt__ckpt_size_check(const int64_t* h, int64_t bytes, int shard_file, const char* path, mt_error* err) {
    const int64_t want = mt_checkpoint_file_bytes(h, shard_file);
    if (bytes != want)
        return mt_fail(err, MT_ERR_FORMAT, "%s has %lld bytes, but its header describes %lld (%s)", path,
                       (long long)bytes, (long long)want, bytes < want ? "truncated" : "too long");
    return MT_OK;
}

MT_DEF mt_status mt_checkpoint_header_check_model(const int64_t* h, const char* path, const mt_config* cfg,
                                                  int any_layout, mt_error* err) {
    int64_t expected[MT_CK_HEADER_WORDS];
    mt_checkpoint_header_init(expected, cfg);
    /* every word that describes the model (shape, flavour, parallel layout) must be this run's */
    struct { int word; const char* what; } shape[] = {
        {MT_CK_LAYERS, "--num-layers"},
        {MT_CK_HIDDEN, "--hidden-size"},
        {MT_CK_HEADS, "--num-attention-heads"},
        {MT_CK_GROUPS, "--num-query-groups"},
        {MT_CK_KV, "--kv-channels"},
        {MT_CK_FFN, "--ffn-hidden-size"},
        {MT_CK_VOCAB, "padded vocabulary size"},
        {MT_CK_POSITIONS, "--max-position-embeddings"},
        {MT_CK_TP, "--tensor-model-parallel-size"},
        {MT_CK_PP, "--pipeline-model-parallel-size"},
        {MT_CK_NORMALIZATION, "--normalization (0 LayerNorm, 1 RMSNorm)"},
        {MT_CK_SWIGLU, "--swiglu"},
        {MT_CK_POSITION_TYPE, "--position-embedding-type (0 learned_absolute, 1 rope, 2 none)"},
        {MT_CK_ROTARY_BASE_BITS, "--rotary-base (bits)"},
        {MT_CK_ROTARY_PERCENT_BITS, "--rotary-percent (bits)"},
        {MT_CK_ROPE_SCALING_FACTOR_BITS, "--rope-scaling-factor (bits)"},
        {MT_CK_UNTIED, "--untie-embeddings-and-output-weights"},
        {MT_CK_NO_BIAS_LINEAR, "--disable-bias-linear"},
        {MT_CK_LAYERNORM_1P, "--apply-layernorm-1p"},
        {MT_CK_SQUARED_RELU, "--squared-relu"},
        {MT_CK_QK_LAYERNORM, "--qk-layernorm"},
        {MT_CK_NUM_EXPERTS, "--num-experts (0: a dense model)"},
        {MT_CK_MOE_FFN, "the expert width (--moe-ffn-hidden-size)"},
        {MT_CK_MOE_SHARED, "--moe-shared-expert-intermediate-size"},
        {MT_CK_MOE_SHARED_GATE, "--moe-shared-expert-gate"},
        {MT_CK_MOE_LAYERS, "MoE layers (--moe-layer-freq)"},
        {MT_CK_MOE_LAYER_FREQ, "the MoE layers (--moe-layer-freq, or a pattern's hash)"},
        {MT_CK_MOE_EXPERT_BIAS, "--moe-router-enable-expert-bias (the routers' expert bias)"},
        {MT_CK_EP, "--expert-model-parallel-size (0: 1)"},
    };
    for (size_t i = 0; i < sizeof(shape) / sizeof(shape[0]); i++) {
        const int w = shape[i].word;
        if (any_layout && (w == MT_CK_TP || w == MT_CK_PP || w == MT_CK_EP || (w == MT_CK_VOCAB && h[MT_CK_TRUE_VOCAB] > 0)))
            continue;
        if (h[w] != expected[w])
            return mt_fail(err, MT_ERR_CONFIG, "checkpoint %s has %s %lld but this run has %lld", path, shape[i].what,
                           (long long)h[w], (long long)expected[w]);
    }
    if (any_layout && h[MT_CK_TRUE_VOCAB] > 0 && h[MT_CK_TRUE_VOCAB] != cfg->vocab_size)
        return mt_fail(err, MT_ERR_CONFIG, "checkpoint %s has a vocabulary of %lld but this run has %lld", path,
                       (long long)h[MT_CK_TRUE_VOCAB], (long long)cfg->vocab_size);
    return MT_OK;
}

MT_DEF mt_status mt_checkpoint_header_check_rank(const int64_t* h, int64_t file_bytes, const char* path,
                                                 const mt_config* cfg, const mt_ckpt_rank* r, int64_t iteration,
                                                 int shard_file, mt_error* err) {
    mt_status st = mt_checkpoint_header_check(h, path, NULL, err);
    if (st != MT_OK) return st;
    if (h[MT_CK_ITERATION] != iteration)
        return mt_fail(err, MT_ERR_FORMAT, "%s holds iteration %lld, not %lld", path, (long long)h[MT_CK_ITERATION],
                       (long long)iteration);
    st = mt__ckpt_size_check(h, file_bytes, shard_file, path, err);
    if (st != MT_OK) return st;
    st = mt_checkpoint_header_check_model(h, path, cfg, 0, err);
    if (st != MT_OK) return st;
    if (h[MT_CK_TP_RANK] != r->tp_rank)
        return mt_fail(err, MT_ERR_FORMAT, "%s holds tensor-parallel rank %lld's shard, not rank %d's", path,
                       (long long)h[MT_CK_TP_RANK], r->tp_rank);
    if (h[MT_CK_EP_RANK] != (r->ep > 1 ? r->dp_rank % r->ep : 0))
        return mt_fail(err, MT_ERR_FORMAT, "%s holds expert-parallel rank %lld's experts, not rank %d's", path,
                       (long long)h[MT_CK_EP_RANK], r->ep > 1 ? r->dp_rank % r->ep : 0);
    const int pp = r->pp > 1;
    if (h[MT_CK_PP_RANK] != r->pp_rank || h[MT_CK_VP] != (pp ? r->vp : 0) ||
        h[MT_CK_STAGE_NUMEL] != (pp ? r->stage_numel : 0))
        return mt_fail(err, MT_ERR_CONFIG,
                       "%s holds pipeline rank %lld's layers (%lld virtual stages, %lld parameters); "
                       "this rank is pipeline rank %d of another split: resume with the same pipeline layout", path,
                       (long long)h[MT_CK_PP_RANK], (long long)h[MT_CK_VP], (long long)h[MT_CK_STAGE_NUMEL],
                       r->pp_rank);
    const int64_t sharded = h[MT_CK_SHARDED_DP], mine = r->sharded ? r->dp : 0;
    if (sharded != 0 && sharded != mine)
        return mt_fail(err, MT_ERR_CONFIG,
                       "checkpoint %s holds optimizer state sharded over %lld data-parallel ranks "
                       "(--use-distributed-optimizer); this run has %d ranks%s: resume with the same layout",
                       path, (long long)sharded, r->dp, r->sharded ? "" : " without it");
    if (shard_file && (h[MT_CK_DP_RANK] != r->dp_rank || h[MT_CK_SHARD_NUMEL] != r->shard_numel))
        return mt_fail(err, MT_ERR_FORMAT,
                       "%s is the shard of DP rank %lld with %lld elements, not of rank %d with %lld", path,
                       (long long)h[MT_CK_DP_RANK], (long long)h[MT_CK_SHARD_NUMEL], r->dp_rank,
                       (long long)r->shard_numel);
    return MT_OK;
}

MT_DEF mt_status mt_ckpt_read_header(const char* path, const int64_t* ref, int shard_file, int tp_rank, int pp_rank,
                                     int dp_rank, int64_t* h, int* fd_out, mt_error* err) {
    if (fd_out) *fd_out = -1;
    int fd = mt_open_regular_file(path, err);
    if (fd < 0) return MT_ERR_IO;
    mt_status st = mt__ckpt_read_at(fd, 0, h, sizeof(int64_t) * MT_CK_HEADER_WORDS) == 0
                       ? mt_checkpoint_header_check(h, path, NULL, err)
                       : mt_fail(err, MT_ERR_FORMAT, "%s is truncated (no header)", path);
    struct stat sb;
    if (st == MT_OK) st = mt__ckpt_size_check(h, fstat(fd, &sb) == 0 ? (int64_t)sb.st_size : -1, shard_file, path, err);
    if (st == MT_OK && ref) {
        /* every word but the rank's own and the stage's size: as the first file's */
        for (int w = 0; w < MT_CK_HEADER_WORDS && st == MT_OK; w++) {
            if (w == MT_CK_TP_RANK || w == MT_CK_PP_RANK || w == MT_CK_DP_RANK || w == MT_CK_STAGE_NUMEL ||
                w == MT_CK_SHARD_NUMEL || w == MT_CK_FP8_TENSORS || w == MT_CK_FP8_HISTORY_POS || w == MT_CK_EP_RANK)
                continue;
            if (h[w] != ref[w])
                st = mt_fail(err, MT_ERR_FORMAT, "%s: header word %d is %lld, but %lld in the first model file", path, w,
                             (long long)h[w], (long long)ref[w]);
        }
        /* (the EP rank follows from the DP rank: DP_RANK % EP = EP_RANK, mt_checkpoint_header_check) */
        if (st == MT_OK && (h[MT_CK_TP_RANK] != tp_rank || h[MT_CK_PP_RANK] != pp_rank || h[MT_CK_DP_RANK] != dp_rank))
            st = mt_fail(err, MT_ERR_FORMAT, "%s holds the part of (TP, PP, DP) rank (%lld, %lld, %lld), not (%d, %d, %d)",
                         path, (long long)h[MT_CK_TP_RANK], (long long)h[MT_CK_PP_RANK], (long long)h[MT_CK_DP_RANK],
                         tp_rank, pp_rank, dp_rank);
    }
    if (st == MT_OK && fd_out) *fd_out = fd;
    else close(fd);
    return st;
}

MT_DEF mt_status mt_checkpoint_read_expert_bias(int fd, const char* path, const int64_t* h, float* out, mt_error* err) {
    int64_t at = 0;
    const int64_t n = mt_checkpoint_expert_bias_numel(h, &at), E = h[MT_CK_NUM_EXPERTS];
    if (n == 0) return MT_OK;
    if (mt__ckpt_read_at(fd, (int64_t)sizeof(int64_t) * MT_CK_HEADER_WORDS + at * (int64_t)sizeof(float), out,
                         sizeof(float) * (size_t)n) != 0)
        return mt_fail(err, MT_ERR_FORMAT, "%s: the expert bias (%lld MoE layers x %lld experts) is cut short", path,
                       (long long)h[MT_CK_MOE_LAYERS], (long long)E);
    /* what the file says before it reaches the routing: every value finite (a NaN would pick no expert) */
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(out[i]))
            return mt_fail(err, MT_ERR_FORMAT, "%s: the expert bias of MoE layer %lld, expert %lld is %g (must be "
                           "finite)", path, (long long)(i / E), (long long)(i % E), (double)out[i]);
    return MT_OK;
}

/* ---- the tracker, retention, a save's directories ---- */

static const char mt__tracker_name[] = "latest_checkpointed_iteration.txt";

MT_DEF mt_status mt_checkpoint_read_tracker(const char* dir, int64_t* iteration, mt_error* err) {
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, mt__tracker_name);
    char* text = NULL;
    size_t n = 0;
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT)
        return mt_fail(err, MT_ERR_IO, "no checkpoint in %s (cannot open %s: %s)", dir, path, strerror(ENOENT));
    mt_status st = mt_read_file(path, 64, &text, &n, err);
    if (st != MT_OK) return st;
    const char* p = text;
    while (*p == ' ' || *p == '\t') p++;
    char* end = NULL;
    errno = 0;
    long long it = *p >= '0' && *p <= '9' ? strtoll(p, &end, 10) : -1;
    int ok = it >= 0 && errno == 0 && end != NULL;
    while (ok && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r')) end++;
    ok = ok && *end == 0 && (size_t)(end - text) == n; /* no embedded NUL, nothing else */
    st = ok ? MT_OK : mt_fail(err, MT_ERR_FORMAT, "%s does not hold an iteration number%s", path,
                              strncmp(p, "release", 7) == 0 ? " (Megatron's \"release\" checkpoints are not supported)" : "");
    if (ok) *iteration = it;
    free(text);
    return st;
}

MT_DEF mt_status mt_checkpoint_write_tracker(const char* dir, int64_t iteration, mt_error* err) {
    char path[4200], text[32];
    snprintf(path, sizeof(path), "%s/%s", dir, mt__tracker_name);
    const void* chunk = text;
    const size_t size = (size_t)snprintf(text, sizeof(text), "%lld", (long long)iteration);
    return mt_write_file(path, 1, &chunk, &size, err);
}

MT_DEF void mt_checkpoint_iteration_dir(char* out, size_t cap, const char* dir, int64_t iteration) {
    struct stat st;
    snprintf(out, cap, "%s/iter_%07lld.old", dir, (long long)iteration);
    int only_old = stat(out, &st) == 0;
    snprintf(out, cap, "%s/iter_%07lld", dir, (long long)iteration);
    if (only_old && stat(out, &st) != 0 && errno == ENOENT) snprintf(out, cap, "%s/iter_%07lld.old", dir, (long long)iteration);
}

MT_DEF int64_t mt_checkpoint_retain_victim(int64_t previous, int64_t saved, int64_t retain_interval, int64_t pending) {
    if (retain_interval < 1 || previous <= 0 || previous == saved || previous == pending) return -1;
    return previous % retain_interval == 0 ? -1 : previous;
}

MT_DEF mt_status mt_checkpoint_retain_apply(const char* dir, int64_t previous, int64_t saved, int64_t retain_interval,
                                            int64_t pending, int64_t* deleted, mt_error* err) {
    *deleted = -1;
    const int64_t victim = mt_checkpoint_retain_victim(previous, saved, retain_interval, pending);
    if (victim < 0) return MT_OK;
    int64_t tracked = -1;
    mt_error tracker_err;
    if (mt_checkpoint_read_tracker(dir, &tracked, &tracker_err) != MT_OK || tracked != saved) return MT_OK;
    char path[4200], retired[4300];
    mt_checkpoint_iteration_dir(path, sizeof(path), dir, victim);
    struct stat st;
    if (stat(path, &st) != 0) {
        if (errno == ENOENT) return MT_OK; /* already gone */
        return mt_fail(err, MT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
    }
    if (!S_ISDIR(st.st_mode)) return MT_OK; /* not a checkpoint directory */
#ifdef O_NOFOLLOW /* a symbolic link is kept, as Megatron does (without O_NOFOLLOW: the link goes, never its target) */
    int fd = open(path, O_RDONLY | O_NOFOLLOW);
    if (fd < 0 && errno == ELOOP) return MT_OK;
    if (fd >= 0) close(fd);
#endif
    snprintf(retired, sizeof(retired), "%s/.tmp_iter_%07lld.retired", dir, (long long)victim);
    mt_remove_tree(retired); /* one a crash left */
    if (rename(path, retired) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot move %s aside to delete it: %s", path, strerror(errno));
    if (mt_remove_tree(retired) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot delete %s (moved aside from %s): %s", retired, path, strerror(errno));
    *deleted = victim;
    return MT_OK;
}

MT_DEF int mt_make_directories(const char* path) {
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char* p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    return mkdir(buf, 0755) != 0 && errno != EEXIST ? -1 : 0;
}

MT_DEF void mt_checkpoint_save_dirs(const char* dir, int64_t iteration, char* final_dir, size_t final_cap,
                                    char* tmp_dir, size_t tmp_cap) {
    snprintf(final_dir, final_cap, "%s/iter_%07lld", dir, (long long)iteration);
    snprintf(tmp_dir, tmp_cap, "%s/.tmp_iter_%07lld", dir, (long long)iteration);
}

MT_DEF void mt_checkpoint_tidy(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return;
    struct dirent* e;
    char path[4400], final_dir[4400];
    while ((e = readdir(d))) {
        const char* n = e->d_name;
        size_t len = strlen(n);
        snprintf(path, sizeof(path), "%s/%s", dir, n);
        if (!strncmp(n, ".tmp_iter_", 10)) {
            mt_remove_tree(path);
        } else if (!strncmp(n, "iter_", 5) && len > 9 && !strcmp(n + len - 4, ".old")) {
            snprintf(final_dir, sizeof(final_dir), "%s/%.*s", dir, (int)(len - 4), n);
            struct stat st;
            if (stat(final_dir, &st) == 0) mt_remove_tree(path);
            else if (errno == ENOENT) rename(path, final_dir);
        }
    }
    closedir(d);
    snprintf(path, sizeof(path), "%s/.", dir);
    mt_sync_directory_of(path); /* of dir */
}

/* The manifest ---------------------------------------------------------------------------------- */

#define MT__MANIFEST_HEAD "megatron.c checkpoint manifest 1\n"

typedef struct {
    char** paths; /* relative to the iteration directory */
    int count, capacity;
} mt__file_list;

static void mt__file_list_free(mt__file_list* l) {
    for (int i = 0; i < l->count; i++) free(l->paths[i]);
    free(l->paths);
    memset(l, 0, sizeof(*l));
}

static int mt__strcmp_ptr(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }

/* Every regular file under root/rel (rel "" at the top), recursively, but the manifest and its
 * temporaries; anything neither a file nor a directory (a FIFO, a device) is refused (stat: links are
 * followed, nesting is bounded). */
static mt_status mt__list_files(const char* root, const char* rel, mt__file_list* l, int depth, mt_error* err) {
    char dir[4400];
    snprintf(dir, sizeof(dir), "%s%s%s", root, *rel ? "/" : "", rel);
    if (depth > 8) return mt_fail(err, MT_ERR_FORMAT, "%s: directories nested too deep for a checkpoint", dir);
    DIR* d = opendir(dir);
    if (!d) return mt_fail(err, MT_ERR_IO, "cannot list %s: %s", dir, strerror(errno));
    mt_status st = MT_OK;
    struct dirent* e;
    while (st == MT_OK && (e = readdir(d)) != NULL) {
        const char* n = e->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..")) continue;
        if (!*rel && (!strcmp(n, MT_CKPT_MANIFEST) || !strncmp(n, MT_CKPT_MANIFEST ".tmp.", sizeof(MT_CKPT_MANIFEST) + 4)))
            continue;
        char child_rel[4400], child[8800];
        snprintf(child_rel, sizeof(child_rel), "%s%s%s", rel, *rel ? "/" : "", n);
        snprintf(child, sizeof(child), "%s/%s", root, child_rel);
        struct stat sb;
        if (stat(child, &sb) != 0) st = mt_fail(err, MT_ERR_IO, "cannot stat %s: %s", child, strerror(errno));
        else if (S_ISDIR(sb.st_mode)) st = mt__list_files(root, child_rel, l, depth + 1, err);
        else if (!S_ISREG(sb.st_mode) || strchr(n, '\n'))
            st = mt_fail(err, MT_ERR_FORMAT, "%s is not a regular file (a checkpoint holds files and directories only)", child);
        else {
            if (l->count == l->capacity) {
                int cap = l->capacity ? 2 * l->capacity : 16;
                char** grown = (char**)realloc(l->paths, sizeof(char*) * (size_t)cap);
                if (!grown) { st = mt_fail(err, MT_ERR_OOM, "out of memory listing %s", root); break; }
                l->paths = grown;
                l->capacity = cap;
            }
            l->paths[l->count] = mt__concat(child_rel, "");
            if (!l->paths[l->count]) st = mt_fail(err, MT_ERR_OOM, "out of memory listing %s", root);
            else l->count++;
        }
    }
    closedir(d);
    return st;
}

/* size and CRC-32C of a regular file, reading it in pieces through buf */
static mt_status mt__file_checksum(const char* path, unsigned char* buf, size_t cap, int64_t* size, uint32_t* crc,
                                   mt_error* err) {
    struct stat sb;
    int fd = mt__open_regular(path, &sb, err);
    if (fd < 0) return MT_ERR_IO;
    uint32_t c = 0;
    int64_t total = 0;
    mt_status st = MT_OK;
    for (;;) {
        ssize_t k = read(fd, buf, cap);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) st = mt_fail(err, MT_ERR_IO, "cannot read %s: %s", path, strerror(errno));
        if (k <= 0) break;
        c = mt_crc32c_extend(c, buf, (size_t)k);
        total += k;
    }
    close(fd);
    *size = total;
    *crc = c;
    return st;
}

#define MT__CHECKSUM_BUFFER ((size_t)8 << 20)

MT_DEF mt_status mt_checkpoint_manifest_write(const char* iter_dir, mt_error* err) {
    return mt_checkpoint_manifest_write_known(iter_dir, NULL, 0, err);
}

MT_DEF mt_status mt_checkpoint_manifest_write_known(const char* iter_dir, const mt_checkpoint_file_crc* known,
                                                    int num_known, mt_error* err) {
    mt__file_list l = {NULL, 0, 0};
    mt_status st = mt__list_files(iter_dir, "", &l, 0, err);
    if (st == MT_OK && l.count > 0) qsort(l.paths, (size_t)l.count, sizeof(char*), mt__strcmp_ptr);
    unsigned char* buf = st == MT_OK ? (unsigned char*)malloc(MT__CHECKSUM_BUFFER) : NULL;
    size_t cap = 256 + (size_t)l.count * 64, n = 0;
    char* text = st == MT_OK ? (char*)malloc(cap) : NULL;
    if (st == MT_OK && (!buf || !text)) st = mt_fail(err, MT_ERR_OOM, "out of memory writing the manifest of %s", iter_dir);
    if (st == MT_OK) n = (size_t)snprintf(text, cap, MT__MANIFEST_HEAD "files %d\n", l.count);
    for (int i = 0; i < l.count && st == MT_OK; i++) {
        char path[8800];
        snprintf(path, sizeof(path), "%s/%s", iter_dir, l.paths[i]);
        int64_t size = 0;
        uint32_t crc = 0;
        const mt_checkpoint_file_crc* k = NULL;
        for (int j = 0; j < num_known && !k; j++)
            if (!strcmp(known[j].path, l.paths[i])) k = &known[j];
        struct stat sb;
        if (k && stat(path, &sb) == 0 && S_ISREG(sb.st_mode) && (int64_t)sb.st_size == k->size) {
            size = k->size;
            crc = k->crc;
        } else {
            st = mt__file_checksum(path, buf, MT__CHECKSUM_BUFFER, &size, &crc, err);
        }
        size_t need = n + strlen(l.paths[i]) + 64;
        if (st == MT_OK && need > cap) {
            char* grown = (char*)realloc(text, need * 2);
            if (!grown) st = mt_fail(err, MT_ERR_OOM, "out of memory writing the manifest of %s", iter_dir);
            else { text = grown; cap = need * 2; }
        }
        if (st == MT_OK) n += (size_t)snprintf(text + n, cap - n, "%08x %lld %s\n", crc, (long long)size, l.paths[i]);
    }
    if (st == MT_OK) {
        char path[4400];
        snprintf(path, sizeof(path), "%s/%s", iter_dir, MT_CKPT_MANIFEST);
        const void* chunk = text;
        st = mt_write_file(path, 1, &chunk, &n, err);
    }
    free(text);
    free(buf);
    mt__file_list_free(&l);
    return st;
}

/* A manifest's path: relative, no empty, "." or ".." part (so it names a file inside the directory) */
static int mt__manifest_path_ok(const char* p) {
    if (!*p || *p == '/') return 0;
    for (const char* part = p; part;) {
        const char* slash = strchr(part, '/');
        size_t len = slash ? (size_t)(slash - part) : strlen(part);
        if (len == 0 || (len == 1 && part[0] == '.') || (len == 2 && part[0] == '.' && part[1] == '.')) return 0;
        part = slash ? slash + 1 : NULL;
    }
    return 1;
}

MT_DEF mt_status mt_checkpoint_manifest_verify(const char* iter_dir, mt_error* err) {
    char manifest[4400];
    snprintf(manifest, sizeof(manifest), "%s/%s", iter_dir, MT_CKPT_MANIFEST);
    char* text = NULL;
    size_t size = 0;
    mt_status st = mt_read_file(manifest, (size_t)1 << 26, &text, &size, err);
    if (st != MT_OK) return st;
    mt__file_list listed = {NULL, 0, 0}, present = {NULL, 0, 0};
    unsigned char* buf = NULL;
    char* line = text;
    long long count = -1;
    const size_t head = sizeof(MT__MANIFEST_HEAD) - 1;
    if (size < head || memcmp(text, MT__MANIFEST_HEAD, head) != 0 || strlen(text) != size ||
        sscanf(text + head, "files %lld", &count) != 1 || count < 0 || count > 1000000)
        st = mt_fail(err, MT_ERR_FORMAT, "%s is not a checkpoint manifest (bad first lines)", manifest);
    if (st == MT_OK) {
        line = strchr(text + head, '\n');
        if (!line) st = mt_fail(err, MT_ERR_FORMAT, "%s is cut short", manifest);
        else line++;
    }
    if (st == MT_OK) {
        listed.paths = (char**)calloc((size_t)(count > 0 ? count : 1), sizeof(char*));
        listed.capacity = (int)count;
        buf = (unsigned char*)malloc(MT__CHECKSUM_BUFFER);
        if (!listed.paths || !buf) st = mt_fail(err, MT_ERR_OOM, "out of memory verifying %s", manifest);
    }
    for (long long i = 0; i < count && st == MT_OK; i++) {
        char* end = strchr(line, '\n');
        unsigned crc = 0;
        long long bytes = -1;
        int used = 0;
        if (end) *end = 0;
        if (!end || sscanf(line, "%8x %lld %n", &crc, &bytes, &used) != 2 || used == 0 || bytes < 0 ||
            !mt__manifest_path_ok(line + used)) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: line %lld is not '<crc32c> <size> <path>'", manifest, i + 3);
            break;
        }
        const char* rel = line + used;
        line = end + 1;
        listed.paths[listed.count++] = (char*)rel; /* points into text */
        char path[8800];
        snprintf(path, sizeof(path), "%s/%s", iter_dir, rel);
        struct stat sb;
        if (stat(path, &sb) != 0) {
            st = mt_fail(err, MT_ERR_FORMAT, "checkpoint %s: %s is missing (%s)", iter_dir, rel, strerror(errno));
            break;
        }
        if (S_ISREG(sb.st_mode) && (long long)sb.st_size != bytes) {
            st = mt_fail(err, MT_ERR_FORMAT, "checkpoint %s: %s has %lld bytes, its manifest says %lld (%s)", iter_dir,
                         rel, (long long)sb.st_size, bytes, (long long)sb.st_size < bytes ? "truncated" : "too long");
            break;
        }
        int64_t got_size = 0;
        uint32_t got = 0;
        st = mt__file_checksum(path, buf, MT__CHECKSUM_BUFFER, &got_size, &got, err);
        if (st != MT_OK) break;
        if (got_size != bytes || got != crc)
            st = mt_fail(err, MT_ERR_FORMAT, "checkpoint %s: %s is corrupted (CRC-32C %08x, its manifest says %08x)",
                         iter_dir, rel, got, crc);
    }
    if (st == MT_OK && *line)
        st = mt_fail(err, MT_ERR_FORMAT, "%s: more lines than the %lld files it counts", manifest, count);
    /* nothing beside the listed files */
    if (st == MT_OK) st = mt__list_files(iter_dir, "", &present, 0, err);
    if (st == MT_OK) {
        qsort(listed.paths, (size_t)listed.count, sizeof(char*), mt__strcmp_ptr);
        for (int i = 0; i < present.count && st == MT_OK; i++)
            if (!bsearch(&present.paths[i], listed.paths, (size_t)listed.count, sizeof(char*), mt__strcmp_ptr))
                st = mt_fail(err, MT_ERR_FORMAT, "checkpoint %s: %s is not in its manifest", iter_dir, present.paths[i]);
    }
    listed.count = 0; /* its strings live in text */
    free(listed.paths);
    mt__file_list_free(&present);
    free(buf);
    free(text);
    return st;
}

/* ---- the commit of a save ---- */

MT_DEF mt_status mt_checkpoint_commit(const char* dir, int64_t iteration, const char* tmp_dir,
                                      const mt_checkpoint_file_crc* known, int num_known, mt_error* err) {
    char final_dir[4096], old_dir[4160];
    snprintf(final_dir, sizeof(final_dir), "%s/iter_%07lld", dir, (long long)iteration);
    snprintf(old_dir, sizeof(old_dir), "%s.old", final_dir);
    mt_status st = mt_checkpoint_manifest_write_known(tmp_dir, known, num_known, err);
    if (st != MT_OK) mt_remove_tree(tmp_dir);
    else if (rename(final_dir, old_dir) != 0 && errno != ENOENT) /* an older copy of this iteration steps aside */
        st = mt_fail(err, MT_ERR_IO, "cannot replace %s: %s", final_dir, strerror(errno));
    else if (rename(tmp_dir, final_dir) != 0)
        st = mt_fail(err, MT_ERR_IO, "cannot rename %s to %s: %s", tmp_dir, final_dir, strerror(errno));
    else if (mt_sync_directory_of(final_dir) != 0)
        st = mt_fail(err, MT_ERR_IO, "cannot sync %s: %s", dir, strerror(errno));
    if (st == MT_OK) mt_remove_tree(old_dir);
    else rename(old_dir, final_dir); /* the new one did not arrive: the old one comes back */
    if (st == MT_OK) st = mt_checkpoint_write_tracker(dir, iteration, err);
    return st;
}

/* ---- the integrity rule ---- */

/* The first model file of an iteration directory: mp_rank_00 (one stage) or mp_rank_00_000 (a pipeline). */
static void mt__ckpt_first_file(char* path, size_t cap, const char* iter_dir) {
    char rank_dir[4300];
    struct stat sb;
    mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), iter_dir, 1, 0, 0);
    if (stat(rank_dir, &sb) != 0) mt_ckpt_rank_dir(rank_dir, sizeof(rank_dir), iter_dir, 2, 0, 0); /* PP or EP > 1 */
    if (stat(rank_dir, &sb) != 0) mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), iter_dir, 2, 2, 0, 0, 0); /* both */
    mt_ckpt_file_path(path, cap, rank_dir, -1);
}

MT_DEF mt_status mt_checkpoint_check_integrity(const char* iter_dir, int no_verify, mt_error* warning, mt_error* err) {
    if (warning) warning->message[0] = 0;
    char manifest[4400], path[4400];
    struct stat sb;
    if (stat(iter_dir, &sb) != 0) return mt_fail(err, MT_ERR_IO, "no checkpoint at %s (%s)", iter_dir, strerror(errno));
    if (!S_ISDIR(sb.st_mode)) return mt_fail(err, MT_ERR_IO, "no checkpoint at %s (not a directory)", iter_dir);
    snprintf(manifest, sizeof(manifest), "%s/%s", iter_dir, MT_CKPT_MANIFEST);
    mt_error why;
    mt_status st;
    if (stat(manifest, &sb) == 0 || errno != ENOENT) {
        st = mt_checkpoint_manifest_verify(iter_dir, &why);
    } else {
        /* no manifest: the header says whether the checkpoint was committed with one */
        int64_t h[MT_CK_HEADER_WORDS];
        mt__ckpt_first_file(path, sizeof(path), iter_dir);
        st = mt_ckpt_read_header(path, NULL, 0, 0, 0, 0, h, NULL, &why);
        if (st == MT_OK && h[MT_CK_MANIFESTED] == 0) {
            mt_fail(warning, MT_OK, "checkpoint %s has no %s: saved before manifests, it is read without an "
                    "integrity check", iter_dir, MT_CKPT_MANIFEST);
            return MT_OK;
        }
        if (st == MT_OK)
            st = mt_fail(&why, MT_ERR_FORMAT, "checkpoint %s has no %s but was saved with one: incomplete or tampered",
                         iter_dir, MT_CKPT_MANIFEST);
    }
    if (st == MT_OK) return MT_OK;
    if (!no_verify) return mt_fail(err, st, "%s", why.message);
    mt_fail(warning, MT_OK, "%.440s (read anyway: integrity checking is off)", why.message);
    return MT_OK;
}

MT_DEF mt_status mt_checkpoint_select(const char* dir, int64_t iteration, int no_verify, int64_t* chosen,
                                      int* fell_back, mt_error* warning, mt_error* err) {
    if (fell_back) *fell_back = 0;
    if (warning) warning->message[0] = 0;
    const int tracked = iteration < 0;
    mt_status st = tracked ? mt_checkpoint_read_tracker(dir, &iteration, err) : MT_OK;
    if (st != MT_OK) return st;
    char iter_dir[4200];
    mt_checkpoint_iteration_dir(iter_dir, sizeof(iter_dir), dir, iteration);
    *chosen = iteration;
    mt_error refused;
    st = mt_checkpoint_check_integrity(iter_dir, no_verify, warning, &refused);
    if (st == MT_OK) return MT_OK;
    if (!tracked || !fell_back) return mt_fail(err, st, "%s", refused.message);
    /* older iterations with a manifest that verifies, newest first (a directory holds few: list it once
     * per candidate) */
    mt_error scratch;
    struct stat sb;
    for (int64_t limit = iteration;;) {
        int64_t next = -1;
        DIR* d = opendir(dir);
        if (!d) break;
        struct dirent* e;
        while ((e = readdir(d)) != NULL) {
            const char* n = e->d_name;
            if (strncmp(n, "iter_", 5) != 0 || strlen(n) != 12 || strspn(n + 5, "0123456789") != 7) continue;
            int64_t it = strtoll(n + 5, NULL, 10);
            char candidate[4400];
            snprintf(candidate, sizeof(candidate), "%s/%s/%s", dir, n, MT_CKPT_MANIFEST);
            if (it < limit && it > next && stat(candidate, &sb) == 0) next = it;
        }
        closedir(d);
        if (next < 0) break;
        snprintf(iter_dir, sizeof(iter_dir), "%s/iter_%07lld", dir, (long long)next);
        if (mt_checkpoint_manifest_verify(iter_dir, &scratch) == MT_OK) {
            *chosen = next;
            *fell_back = 1;
            mt_fail(warning, MT_OK, "the tracker's iteration %lld was refused (%.360s); read iteration %lld, the newest "
                    "older one that verifies", (long long)iteration, refused.message, (long long)next);
            return MT_OK;
        }
        limit = next;
    }
    return mt_fail(err, st, "%s", refused.message);
}

/* 14. Checkpoints at any layout: the reader of any rank's part --------------------------------- */

MT_DEF mt_ckpt_ddp mt_ckpt_saved_ddp(const mt_ckpt* ck, const mt_ckpt_ddp* fallback) {
    mt_ckpt_ddp d = {0, 0};
    if (ck->header[MT_CK_DDP_OVERLAP] > 0) {
        d.overlap_grad_reduce = ck->header[MT_CK_DDP_OVERLAP] == 2;
        d.ddp_bucket_size = ck->header[MT_CK_DDP_BUCKET_SIZE];
    } else if (fallback) {
        d = *fallback;
    }
    return d;
}

MT_DEF mt_status mt_ckpt_config(mt_config* c, const int64_t* h, int tp, int pp, int vp, int dp, const mt_ckpt_ddp* ddp,
                                int tp_rank, int pp_rank, mt_error* err) {
    mt_config_defaults(c);
    mt_config_from_checkpoint_header(c, h);
    c->tensor_model_parallel_size = tp;
    c->pipeline_model_parallel_size = pp;
    c->virtual_pipeline_size = vp > 0 ? vp : 1;
    c->expert_model_parallel_size = h[MT_CK_EP] > 1 ? (int)h[MT_CK_EP] : 1;
    c->data_parallel_size = dp > 0 ? dp : c->expert_model_parallel_size;
    c->world_size = tp * pp * c->data_parallel_size;
    c->use_distributed_optimizer = dp > 0;
    if (ddp) {
        c->overlap_grad_reduce = ddp->overlap_grad_reduce;
        c->ddp_bucket_size = ddp->ddp_bucket_size;
    }
    mt_rank_coords coords = {tp_rank, 0, pp_rank, 0, 0, 0, 0};
    c->rank = mt_rank_of(c, coords);
    return mt_pp_stage_of(c, pp_rank, NULL, err);
}

MT_DEF mt_status mt_ckpt_rank_numel(const mt_config* c, int64_t* numel, mt_error* err) {
    mt_buffer_layout B;
    mt_status st = mt_buffer_layout_build(&B, c, err);
    if (st != MT_OK) return st;
    *numel = B.canonical_size;
    mt_buffer_layout_free(&B);
    return MT_OK;
}

MT_DEF void mt_config_resume_padding(mt_config* c, const char* dir) {
    mt_ckpt saved;
    mt_error ignored;
    if (dir && mt_ckpt_open(&saved, dir, -1, &ignored) == MT_OK) c->resumed_padded_vocab_size = saved.header[MT_CK_VOCAB];
}

MT_DEF mt_status mt_ckpt_open(mt_ckpt* ck, const char* dir, int64_t iteration, mt_error* err) {
    memset(ck, 0, sizeof(*ck));
    mt_status st = iteration < 0 ? mt_checkpoint_read_tracker(dir, &iteration, err) : MT_OK;
    if (st != MT_OK) return st;
    ck->iteration = iteration;
    mt_checkpoint_iteration_dir(ck->iter_dir, sizeof(ck->iter_dir), dir, iteration);
    char path[4400];
    mt__ckpt_first_file(path, sizeof(path), ck->iter_dir);
    int64_t* h = ck->header;
    st = mt_ckpt_read_header(path, NULL, 0, 0, 0, 0, h, NULL, err);
    if (st == MT_OK && h[MT_CK_ITERATION] != iteration)
        st = mt_fail(err, MT_ERR_FORMAT, "%s holds iteration %lld, not %lld", path, (long long)h[MT_CK_ITERATION],
                     (long long)iteration);
    if (st == MT_OK && (h[MT_CK_TP_RANK] != 0 || h[MT_CK_PP_RANK] != 0 || h[MT_CK_DP_RANK] != 0))
        st = mt_fail(err, MT_ERR_FORMAT, "%s is not the file of rank 0", path);
    if (st == MT_OK && (h[MT_CK_TP] > 4096 || h[MT_CK_PP] > 4096 || h[MT_CK_SHARDED_DP] > 65536 || h[MT_CK_EP] > 4096))
        st = mt_fail(err, MT_ERR_FORMAT, "%s: a layout of %lld x %lld x %lld ranks (EP %lld) is beyond this reader", path,
                     (long long)h[MT_CK_TP], (long long)h[MT_CK_PP], (long long)h[MT_CK_SHARDED_DP], (long long)h[MT_CK_EP]);
    if (st != MT_OK) return st;
    ck->tp = (int)h[MT_CK_TP];
    ck->pp = (int)h[MT_CK_PP];
    ck->vp = h[MT_CK_PP] > 1 ? (int)h[MT_CK_VP] : 1;
    ck->sharded_dp = (int)h[MT_CK_SHARDED_DP];
    ck->ep = h[MT_CK_EP] > 1 ? (int)h[MT_CK_EP] : 1;
    return mt_ckpt_config(&ck->cfg, h, ck->tp, ck->pp, ck->vp, 0, NULL, 0, 0, err);
}

MT_DEF mt_status mt_ckpt_read_expert_bias(const mt_ckpt* ck, int every_file, float* out, mt_error* err) {
    const int64_t n = mt_checkpoint_expert_bias_numel(ck->header, NULL);
    if (n == 0)
        return mt_fail(err, MT_ERR_CONFIG, "%s holds no expert bias (saved without --moe-router-enable-expert-bias)",
                       ck->iter_dir);
    float* other = every_file ? (float*)malloc(sizeof(float) * (size_t)n) : NULL;
    mt_status st = every_file && !other ? mt_fail(err, MT_ERR_OOM, "out of memory reading %s", ck->iter_dir) : MT_OK;
    /* the first model file's (mp_rank_00[_000]), then with every_file the others' (every TP, PP and EP rank's) */
    for (int k = 0; k < (every_file ? ck->tp * ck->pp * ck->ep : 1) && st == MT_OK; k++) {
        const int t = k / (ck->pp * ck->ep), s = k / ck->ep % ck->pp, e = k % ck->ep;
        char rank_dir[4300], path[4400];
        mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), ck->iter_dir, ck->pp, ck->ep, t, s, e);
        mt_ckpt_file_path(path, sizeof(path), rank_dir, -1);
        int64_t h[MT_CK_HEADER_WORDS];
        int fd = -1;
        st = mt_ckpt_read_header(path, ck->header, 0, t, s, e, h, &fd, err); /* written by DP rank e */
        if (st == MT_OK) st = mt_checkpoint_read_expert_bias(fd, path, h, k ? other : out, err);
        if (fd >= 0) close(fd);
        if (st == MT_OK && k && memcmp(other, out, sizeof(float) * (size_t)n) != 0) {
            int64_t i = 0;
            while (!memcmp(&other[i], &out[i], sizeof(float))) i++;
            st = mt_fail(err, MT_ERR_FORMAT, "%s: the expert bias of MoE layer %lld, expert %lld is %.9g, but %.9g in "
                         "the first model file (every model file holds the same copy)", path,
                         (long long)(i / h[MT_CK_NUM_EXPERTS]), (long long)(i % h[MT_CK_NUM_EXPERTS]),
                         (double)other[i], (double)out[i]);
        }
    }
    free(other);
    return st;
}

MT_DEF mt_status mt_ckpt_read_floats(int fd, const char* path, int64_t at, float* out, int64_t n, mt_error* err) {
    if (mt__ckpt_read_at(fd, (int64_t)sizeof(int64_t) * MT_CK_HEADER_WORDS + at * (int64_t)sizeof(float), out,
                         sizeof(float) * (size_t)n) != 0)
        return mt_fail(err, MT_ERR_FORMAT, "%s is truncated", path);
    return MT_OK;
}

/* One saved model rank (tp, pp) as mt_ckpt_read_part reads it: its config and buffer layout (with
 * the distributed optimizer's buckets when the checkpoint has them), its model file, and the file
 * open now (one at a time), each file's header checked when first opened. */
typedef struct {
    int built;
    mt_config c;
    mt_buffer_layout B;
    int64_t numel;            /* one array of its model file */
    int64_t shard_numel;      /* one array of its distrib_optim files */
    int64_t* bucket_prefix;   /* per bucket: elements of the buckets before it in one DP shard */
} mt__ckpt_source;

typedef struct {
    const mt_ckpt* ck;
    const mt_ckpt_ddp* ddp;
    mt__ckpt_source* src;     /* [tp * pp] (every EP rank's buffer has the same layout) */
    unsigned char* checked;   /* [tp * pp * (EP + D)]: header checked (the EP model files, then the D shard files) */
    int fd;                   /* -1: none open */
    char open_path[4400];
} mt__ckpt_reader;

static mt_status mt__ckpt_source_get(mt__ckpt_reader* r, int t, int s, mt__ckpt_source** out, mt_error* err) {
    const mt_ckpt* ck = r->ck;
    mt__ckpt_source* q = &r->src[t * ck->pp + s];
    *out = q;
    if (q->built) return MT_OK;
    const int D = ck->sharded_dp;
    const mt_ckpt_ddp ddp = mt_ckpt_saved_ddp(ck, r->ddp);
    mt_status st = mt_ckpt_config(&q->c, ck->header, ck->tp, ck->pp, ck->vp, D, &ddp, t, s, err);
    if (st == MT_OK) st = mt_buffer_layout_build(&q->B, &q->c, err);
    if (st != MT_OK) return st;
    q->built = 1;
    q->numel = q->B.canonical_size;
    q->bucket_prefix = (int64_t*)calloc((size_t)q->B.num_buckets, sizeof(int64_t));
    if (!q->bucket_prefix) return mt_fail(err, MT_ERR_OOM, "out of memory reading %s", ck->iter_dir);
    for (int b = 0; b < q->B.num_buckets && D > 0; b++) {
        int64_t begin, end;
        mt_bucket_shard(&q->B.buckets[b], D, 0, &begin, &end);
        q->bucket_prefix[b] = q->shard_numel;
        q->shard_numel += end - begin;
    }
    return MT_OK;
}

/* Opens (the model file of EP rank e when dp_rank < 0, else distrib_optim_dp<dp_rank>, in EP rank
 * dp_rank % EP's directory) of saved rank (t, s), checking its header the first time. */
static mt_status mt__ckpt_reader_open(mt__ckpt_reader* r, int t, int s, int e, int dp_rank, mt_error* err) {
    const mt_ckpt* ck = r->ck;
    char rank_dir[4300], path[4400];
    if (dp_rank >= 0) e = dp_rank % ck->ep;
    mt_ckpt_rank_dir_ep(rank_dir, sizeof(rank_dir), ck->iter_dir, ck->pp, ck->ep, t, s, e);
    mt_ckpt_file_path(path, sizeof(path), rank_dir, dp_rank);
    if (r->fd >= 0 && !strcmp(path, r->open_path)) return MT_OK;
    if (r->fd >= 0) close(r->fd);
    r->fd = -1;
    mt__ckpt_source* q;
    mt_status st = mt__ckpt_source_get(r, t, s, &q, err);
    if (st != MT_OK) return st;
    unsigned char* checked = &r->checked[(t * ck->pp + s) * (ck->ep + ck->sharded_dp) + (dp_rank < 0 ? e : ck->ep + dp_rank)];
    int64_t h[MT_CK_HEADER_WORDS];
    if (!*checked) { /* a model file's writer: DP rank e */
        st = mt_ckpt_read_header(path, ck->header, dp_rank >= 0, t, s, dp_rank < 0 ? e : dp_rank, h, &r->fd, err);
        if (st == MT_OK && dp_rank < 0 && ck->pp > 1 && h[MT_CK_STAGE_NUMEL] != q->numel)
            st = mt_fail(err, MT_ERR_FORMAT, "%s holds %lld parameters, but an even split gives pipeline rank %d "
                         "%lld (uneven splits, --decoder-first/last-pipeline-num-layers, are not supported here)",
                         path, (long long)h[MT_CK_STAGE_NUMEL], s, (long long)q->numel);
        if (st == MT_OK && dp_rank >= 0 && h[MT_CK_SHARD_NUMEL] != q->shard_numel)
            st = mt_fail(err, MT_ERR_CONFIG, "%s holds shards of %lld elements, but the DDP buckets give %lld: pass the "
                         "--overlap-grad-reduce and --ddp-bucket-size of the run that saved it", path,
                         (long long)h[MT_CK_SHARD_NUMEL], (long long)q->shard_numel);
        if (st != MT_OK) {
            if (r->fd >= 0) close(r->fd);
            r->fd = -1;
            return st;
        }
        *checked = 1;
    } else if ((r->fd = mt_open_regular_file(path, err)) < 0) {
        return MT_ERR_IO;
    }
    snprintf(r->open_path, sizeof(r->open_path), "%s", path);
    return MT_OK;
}

/* Saved rank (t, s)'s (tensor, layer) of one array as EP rank e holds it, whole (q->B's numel of it) into buf. */
static mt_status mt__ckpt_read_piece(mt__ckpt_reader* r, int t, int s, int e, int tensor, int layer, int array, float* buf,
                                     mt_error* err) {
    const mt_ckpt* ck = r->ck;
    mt__ckpt_source* q;
    mt_status st = mt__ckpt_source_get(r, t, s, &q, err);
    if (st != MT_OK) return st;
    const int k = q->B.index[tensor * q->B.num_layers + layer];
    const mt_buffer_param* p = &q->B.params[k];
    if (ck->sharded_dp == 0 || array == MT_CKPT_MASTER) { /* the model file: master, m, v of the stage */
        st = mt__ckpt_reader_open(r, t, s, e, -1, err);
        return st == MT_OK ? mt_ckpt_read_floats(r->fd, r->open_path, array * q->numel + p->canonical, buf, p->numel, err)
                           : st;
    }
    /* the DP shards of the bucket that owns the parameter's buffer range (of an expert bucket, the shards of
     * the DP ranks holding EP rank e's experts: d % EP = e) */
    const mt_buffer_bucket* bucket = &q->B.buckets[p->bucket];
    for (int d = 0; d < ck->sharded_dp && st == MT_OK; d++) {
        if (bucket->ep > 1 && d % ck->ep != e) continue;
        int64_t begin, end;
        mt_bucket_shard(bucket, ck->sharded_dp, d, &begin, &end);
        const int64_t lo = begin > p->offset ? begin : p->offset;
        const int64_t hi = end < p->offset + p->numel ? end : p->offset + p->numel;
        if (lo >= hi) continue;
        st = mt__ckpt_reader_open(r, t, s, e, d, err);
        if (st == MT_OK)
            st = mt_ckpt_read_floats(r->fd, r->open_path, array * q->shard_numel + q->bucket_prefix[p->bucket] + (lo - begin),
                                     buf + (lo - p->offset), hi - lo, err);
    }
    return st;
}

MT_DEF mt_status mt_ckpt_read_part(const mt_ckpt* ck, const mt_ckpt_ddp* ddp, const mt_config* target, int array,
                                   float* out, mt_error* err) {
    if (array < 0 || array >= MT_CKPT_ARRAYS) return mt_fail(err, MT_ERR_ARG, "checkpoint array %d does not exist", array);
    const int D = ck->sharded_dp;
    mt__ckpt_reader r;
    memset(&r, 0, sizeof(r));
    r.fd = -1;
    r.ck = ck;
    r.ddp = ddp;
    r.src = (mt__ckpt_source*)calloc((size_t)ck->tp * (size_t)ck->pp, sizeof(mt__ckpt_source));
    r.checked = (unsigned char*)calloc((size_t)ck->tp * (size_t)ck->pp * (size_t)(ck->ep + D), 1);
    mt_buffer_layout TB;
    memset(&TB, 0, sizeof(TB));
    mt_status st = r.src && r.checked ? mt_buffer_layout_build(&TB, target, err)
                                      : mt_fail(err, MT_ERR_OOM, "out of memory reading %s", ck->iter_dir);
    /* the saved and the target model's full tensors: the same model but for the vocabulary's padding */
    mt_param_info from[MT_NUM_PARAM_TENSORS], to[MT_NUM_PARAM_TENSORS];
    mt_param_layout(&ck->cfg, from);
    mt_param_layout(target, to);
    const int tp = target->tensor_model_parallel_size > 0 ? target->tensor_model_parallel_size : 1;
    const int tp_rank = target->world_size > 0 ? mt_rank_coordinates(target, target->rank).tp : 0;
    /* the target's expert-parallel size and rank (its experts: mt_ep_outer) */
    const int ep = target->num_experts > 0 && target->expert_model_parallel_size > 1 ? target->expert_model_parallel_size : 1;
    const int ep_rank = target->world_size > 0 && ep > 1 ? mt_rank_coordinates(target, target->rank).ep : 0;
    if (st == MT_OK && ck->cfg.num_layers != target->num_layers)
        st = mt_fail(err, MT_ERR_CONFIG, "%s holds a model of %d layers, this run has %d", ck->iter_dir,
                     ck->cfg.num_layers, target->num_layers);
    for (int i = 0; i < MT_NUM_PARAM_TENSORS && st == MT_OK; i++) {
        const int vocab = i == MT_P_WORD_EMBEDDINGS || i == MT_P_OUTPUT_WEIGHT;
        if (from[i].split_outer != to[i].split_outer || from[i].split_inner != to[i].split_inner ||
            (!vocab && from[i].split_rows != to[i].split_rows) || (from[i].numel > 0) != (to[i].numel > 0))
            st = mt_fail(err, MT_ERR_CONFIG, "%s holds another model (its %s differs from this run's)", ck->iter_dir,
                         from[i].name);
    }
    /* the saved pipeline stages: which one saved each layer */
    mt_pp_stage* stages = st == MT_OK ? (mt_pp_stage*)calloc((size_t)ck->pp, sizeof(mt_pp_stage)) : NULL;
    if (st == MT_OK && !stages) st = mt_fail(err, MT_ERR_OOM, "out of memory reading %s", ck->iter_dir);
    for (int s = 0; s < ck->pp && st == MT_OK; s++) st = mt_pp_stage_of(&ck->cfg, s, &stages[s], err);
    float* buf = NULL;
    int64_t buf_cap = 0;
    for (int k = 0; k < TB.num_params && st == MT_OK; k++) {
        const mt_buffer_param* p = &TB.params[k];
        const mt_param_info* fi = &from[p->tensor];
        const mt_param_info* ti = &to[p->tensor];
        float* dst = out + p->canonical;
        memset(dst, 0, sizeof(float) * (size_t)p->numel);
        /* the stage that saved it: the first that holds it (the word embeddings' own stage, not the
         * copy a tied output layer keeps on the last) */
        int s = 0;
        while (s < ck->pp && !mt_pp_holds(&stages[s], p->tensor, p->layer)) s++;
        if (s == ck->pp) {
            st = mt_fail(err, MT_ERR_FORMAT, "%s: no pipeline stage holds %s of layer %d", ck->iter_dir, fi->name, p->layer);
            break;
        }
        int64_t rows_to, row0_to, outer_to, outer0_to;
        mt_tp_rows(ti, tp, tp_rank, &rows_to, &row0_to);
        mt_ep_outer(ti, ep, ep_rank, &outer_to, &outer0_to);
        const int64_t rows_kept = fi->split_rows < ti->split_rows ? fi->split_rows : ti->split_rows;
        const int64_t inner = ti->split_inner;
        /* each saved EP rank whose experts meet the target's (one, EP rank 0's files, for a tensor not cut
         * over EP), each saved TP shard whose rows meet the target's */
        for (int e = 0; e < (fi->ep_split ? ck->ep : 1) && st == MT_OK; e++) {
            int64_t outer_from, outer0_from;
            mt_ep_outer(fi, ck->ep, e, &outer_from, &outer0_from);
            const int64_t olo = outer0_to > outer0_from ? outer0_to : outer0_from;
            const int64_t ohi = outer0_to + outer_to < outer0_from + outer_from ? outer0_to + outer_to : outer0_from + outer_from;
            if (olo >= ohi) continue;
            for (int t = 0; t < ck->tp && st == MT_OK; t++) {
                int64_t rows_from, row0_from;
                mt_tp_rows(fi, ck->tp, t, &rows_from, &row0_from);
                int64_t lo = row0_to > row0_from ? row0_to : row0_from;
                int64_t hi = row0_to + rows_to < row0_from + rows_from ? row0_to + rows_to : row0_from + rows_from;
                if (hi > rows_kept) hi = rows_kept;
                if (lo >= hi) continue;
                const int64_t piece = outer_from * rows_from * inner;
                if (piece > buf_cap) {
                    free(buf);
                    buf = (float*)malloc(sizeof(float) * (size_t)piece);
                    buf_cap = buf ? piece : 0;
                    if (!buf) {
                        st = mt_fail(err, MT_ERR_OOM, "out of memory reading %s (%lld floats)", ck->iter_dir,
                                     (long long)piece);
                        break;
                    }
                }
                st = mt__ckpt_read_piece(&r, t, s, e, p->tensor, p->layer, array, buf, err);
                for (int64_t o = olo; o < ohi && st == MT_OK; o++)
                    memcpy(dst + ((o - outer0_to) * rows_to + lo - row0_to) * inner,
                           buf + ((o - outer0_from) * rows_from + lo - row0_from) * inner,
                           sizeof(float) * (size_t)((hi - lo) * inner));
            }
        }
    }
    free(buf);
    free(stages);
    if (r.fd >= 0) close(r.fd);
    for (int i = 0; r.src && i < ck->tp * ck->pp; i++) {
        if (r.src[i].built) mt_buffer_layout_free(&r.src[i].B);
        free(r.src[i].bucket_prefix);
    }
    free(r.src);
    free(r.checked);
    mt_buffer_layout_free(&TB);
    return st;
}

/* 15b. Generation: the host checks of the engine's settings (the engine is megatron.cu's) ------ */

MT_DEF mt_status mt_generator_supported(const mt_config* c, mt_error* err) {
    if (c->pipeline_model_parallel_size > 1)
        return mt_fail(err, MT_ERR_CONFIG, "generation needs the whole model on one GPU: pipeline parallelism (%d "
                       "stages) is not served", c->pipeline_model_parallel_size);
    if (c->tensor_model_parallel_size > 1)
        return mt_fail(err, MT_ERR_CONFIG, "generation runs on one GPU: tensor parallelism (%d) is not served yet",
                       c->tensor_model_parallel_size);
    if (c->context_parallel_size > 1)
        return mt_fail(err, MT_ERR_CONFIG, "generation runs on one GPU: context parallelism (%d) is not served",
                       c->context_parallel_size);
    if (c->num_experts > 0)
        return mt_fail(err, MT_ERR_CONFIG, "generation does not serve mixture-of-experts models (--num-experts %d) yet",
                       c->num_experts);
    if (c->fp8_param_gather)
        return mt_fail(err, MT_ERR_CONFIG, "generation reads the bf16 weights: --fp8-param-gather keeps only FP8 ones");
    if (c->num_query_groups <= 0 || c->num_attention_heads % c->num_query_groups != 0 ||
        c->num_attention_heads / c->num_query_groups > MT_GEN_MAX_QPG)
        return mt_fail(err, MT_ERR_CONFIG, "generation's decode attention takes at most %d query heads per group "
                       "(%d heads in %d groups)", MT_GEN_MAX_QPG, c->num_attention_heads, c->num_query_groups);
    if (c->kv_channels < 1 || c->kv_channels > 256)
        return mt_fail(err, MT_ERR_CONFIG, "generation's decode attention takes head dims 1 .. 256 (--kv-channels %d)",
                       c->kv_channels);
    return MT_OK;
}

MT_DEF mt_status mt_generator_config_check(const mt_generator_config* gc, const mt_config* c, mt_generator_config* out,
                                    mt_error* err) {
    mt_generator_config r = *gc;
    const int positions = c->max_position_embeddings > 0 ? c->max_position_embeddings : c->seq_length;
    if (r.max_batch < 1 || r.max_batch > MT_GEN_MAX_BATCH)
        return mt_fail(err, MT_ERR_ARG, "generator max_batch %d: must be in [1, %d]", r.max_batch, MT_GEN_MAX_BATCH);
    if (r.max_context < 2 || r.max_context > positions)
        return mt_fail(err, MT_ERR_ARG, "generator max_context %d: must be in [2, %d] (the model's positions; a "
                       "request holds at least one prompt token and one generated token)", r.max_context, positions);
    if (r.block_tokens == 0) r.block_tokens = 64;
    if (r.block_tokens < 16 || r.block_tokens > 1024 || (r.block_tokens & (r.block_tokens - 1)) != 0)
        return mt_fail(err, MT_ERR_ARG, "generator block_tokens %d: must be a power of two in [16, 1024]", r.block_tokens);
    const int64_t per_request = ((int64_t)r.max_context + r.block_tokens - 1) / r.block_tokens;
    if (r.num_blocks == 0) r.num_blocks = (int64_t)r.max_batch * per_request;
    if (r.num_blocks < per_request || r.num_blocks > ((int64_t)1 << 30))
        return mt_fail(err, MT_ERR_ARG, "generator num_blocks %lld: must be in [%lld, 2^30] (at least one request of "
                       "max_context %d in blocks of %d tokens)", (long long)r.num_blocks, (long long)per_request,
                       r.max_context, r.block_tokens);
    const int least = r.max_context + r.max_batch;
    if (r.max_step_tokens == 0) r.max_step_tokens = least > 8192 ? least : 8192;
    if (r.max_step_tokens < least || r.max_step_tokens > (1 << 20))
        return mt_fail(err, MT_ERR_ARG, "generator max_step_tokens %d: must be in [%d, 2^20] (max_context + max_batch: "
                       "a prompt of max_context - 1 tokens beside every other request decoding)", r.max_step_tokens, least);
    if (out) *out = r;
    return MT_OK;
}

MT_DEF mt_status mt_generator_request_check(const int32_t* prompt, int prompt_len, const mt_sampling* s, int max_context,
                                     int64_t vocab, mt_error* err) {
    if (!prompt || prompt_len < 1 || prompt_len > max_context - 1)
        return mt_fail(err, MT_ERR_ARG, "prompt of %d tokens: must be 1 .. %d (max_context %d less the token to "
                       "generate)", prompt_len, max_context - 1, max_context);
    for (int i = 0; i < prompt_len; i++)
        if (prompt[i] < 0 || prompt[i] >= vocab)
            return mt_fail(err, MT_ERR_ARG, "prompt token %d (at %d) is not in the vocabulary [0, %lld)", prompt[i], i,
                           (long long)vocab);
    if (!s) return mt_fail(err, MT_ERR_ARG, "a request needs its sampling settings");
    if (!(s->temperature >= 0.0f) || s->temperature > 3.0e38f)
        return mt_fail(err, MT_ERR_ARG, "temperature %g: must be 0 (greedy) or a finite positive number",
                       (double)s->temperature);
    if (s->top_k < 0) return mt_fail(err, MT_ERR_ARG, "top_k %d: must be >= 0 (0: off)", s->top_k);
    if (!(s->top_p >= 0.0f && s->top_p <= 1.0f))
        return mt_fail(err, MT_ERR_ARG, "top_p %g: must be in [0, 1] (0 or 1: off)", (double)s->top_p);
    if (s->max_new_tokens < 0) return mt_fail(err, MT_ERR_ARG, "max_new_tokens %d: must be >= 0", s->max_new_tokens);
    if (s->num_stop_tokens < 0 || s->num_stop_tokens > MT_GEN_MAX_STOP_TOKENS || (s->num_stop_tokens > 0 && !s->stop_tokens))
        return mt_fail(err, MT_ERR_ARG, "%d stop tokens: at most %d, given as an array", s->num_stop_tokens,
                       MT_GEN_MAX_STOP_TOKENS);
    for (int i = 0; i < s->num_stop_tokens; i++)
        if (s->stop_tokens[i] < 0 || s->stop_tokens[i] >= vocab)
            return mt_fail(err, MT_ERR_ARG, "stop token %d is not in the vocabulary [0, %lld)", s->stop_tokens[i],
                           (long long)vocab);
    if (s->prompt_logprobs != 0 && s->prompt_logprobs != 1)
        return mt_fail(err, MT_ERR_ARG, "prompt_logprobs %d: must be 0 or 1", s->prompt_logprobs);
    return MT_OK;
}

MT_DEF int64_t mt_generator_request_blocks(int prompt_len, int max_new_tokens, int max_context, int block_tokens) {
    int64_t total = (int64_t)prompt_len + (max_new_tokens > 0 ? max_new_tokens : 0);
    if (total > max_context) total = max_context;
    int64_t cached = total - 1 > prompt_len ? total - 1 : prompt_len;
    return (cached + block_tokens - 1) / block_tokens;
}

/* 16. TensorBoard event files ------------------------------------------------------------------ */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
/* the same register update as the loop below, eight bytes per instruction */
__attribute__((target("sse4.2"))) static uint32_t mt__crc32c_sse42(uint32_t crc, const unsigned char* p, size_t n) {
#if defined(__x86_64__)
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = _mm_crc32_u64(c, word);
    }
    crc = (uint32_t)c;
#endif
    for (; n > 0; n--, p++) crc = _mm_crc32_u8(crc, *p);
    return crc;
}
#endif

MT_DEF uint32_t mt_crc32c_extend(uint32_t crc, const void* data, size_t n) {
    const unsigned char* p = (const unsigned char*)data;
    crc = ~crc;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
    if (__builtin_cpu_supports("sse4.2")) return ~mt__crc32c_sse42(crc, p, n);
#endif
    for (size_t i = 0; i < n; i++) { /* bit by bit */
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

MT_DEF uint32_t mt_tb_crc32c(const void* data, size_t n) { return mt_crc32c_extend(0, data, n); }

MT_DEF uint32_t mt_tb_masked_crc32c(const void* data, size_t n) {
    uint32_t crc = mt_tb_crc32c(data, n);
    return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

struct mt_tb_writer {
    int fd;
    char* path;
    unsigned char* pending; /* framed records not yet written */
    size_t length, capacity;
    int pending_events, queue_size;
};

/* Protobuf's wire format, the parts an Event needs: a key is (field << 3 | wire type), wire type 0 a
 * varint, 1 eight little-endian bytes, 2 a varint length and that many bytes, 5 four bytes. */
enum { MT__PB_VARINT = 0, MT__PB_FIXED64 = 1, MT__PB_BYTES = 2, MT__PB_FIXED32 = 5 };
static size_t mt__pb_varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) { v >>= 7; n++; }
    return n;
}
static unsigned char* mt__pb_varint(unsigned char* p, uint64_t v) {
    while (v >= 0x80) { *p++ = (unsigned char)(v | 0x80); v >>= 7; }
    *p++ = (unsigned char)v;
    return p;
}
static unsigned char* mt__pb_key(unsigned char* p, int field, int wire) {
    return mt__pb_varint(p, (uint64_t)field << 3 | (uint64_t)wire);
}
/* A length-delimited field of n payload bytes: its size, and its key and length (the payload follows). */
static size_t mt__pb_bytes_size(int field, size_t n) { return mt__pb_varint_size((uint64_t)field << 3) + mt__pb_varint_size(n) + n; }
static unsigned char* mt__pb_bytes_head(unsigned char* p, int field, size_t n) {
    return mt__pb_varint(mt__pb_key(p, field, MT__PB_BYTES), n);
}
static unsigned char* mt__pb_bytes(unsigned char* p, int field, const void* data, size_t n) {
    p = mt__pb_bytes_head(p, field, n);
    memcpy(p, data, n);
    return p + n;
}

enum { MT__TB_FILE_VERSION, MT__TB_SCALAR, MT__TB_TEXT };
#define MT__TB_FILE_VERSION_STRING "brain.Event:2"

/* One Event's bytes into out, or only their count when out is NULL. kind: the file_version record,
 * a scalar (tag, value) or a text (tag as given, text). */
static size_t mt__tb_event(unsigned char* out, double wall_time, int64_t step, int kind, const char* tag, float value,
                           const char* text) {
    size_t tag_n = tag ? strlen(tag) : 0, text_n = text ? strlen(text) : 0;
    /* text: TensorProto { dtype DT_STRING (7), tensor_shape { dim { size 1 } }, string_val text } and
     * SummaryMetadata { plugin_data { plugin_name "text" } } (TextPluginData version 0 is empty) */
    const size_t dim_n = 2;                             /* Dim { size (1): 1 } */
    const size_t shape_n = mt__pb_bytes_size(2, dim_n); /* TensorShapeProto { dim (2) } */
    const size_t tensor_n = 2 + mt__pb_bytes_size(2, shape_n) + mt__pb_bytes_size(8, text_n);
    const size_t plugin_n = mt__pb_bytes_size(1, 4), meta_n = mt__pb_bytes_size(1, plugin_n);
    size_t value_n = mt__pb_bytes_size(1, tag_n);
    value_n += kind == MT__TB_SCALAR ? 1 + 4 : mt__pb_bytes_size(8, tensor_n) + mt__pb_bytes_size(9, meta_n);
    size_t summary_n = mt__pb_bytes_size(1, value_n);
    size_t n = 1 + 8 + (step ? 1 + mt__pb_varint_size((uint64_t)step) : 0);
    n += kind == MT__TB_FILE_VERSION ? mt__pb_bytes_size(3, strlen(MT__TB_FILE_VERSION_STRING))
                                     : mt__pb_bytes_size(5, summary_n);
    if (!out) return n;
    unsigned char* p = mt__pb_key(out, 1, MT__PB_FIXED64);
    memcpy(p, &wall_time, 8);
    p += 8;
    if (step) p = mt__pb_varint(mt__pb_key(p, 2, MT__PB_VARINT), (uint64_t)step);
    if (kind == MT__TB_FILE_VERSION) {
        p = mt__pb_bytes(p, 3, MT__TB_FILE_VERSION_STRING, strlen(MT__TB_FILE_VERSION_STRING));
        return (size_t)(p - out);
    }
    p = mt__pb_bytes_head(p, 5, summary_n);
    p = mt__pb_bytes_head(p, 1, value_n);
    p = mt__pb_bytes(p, 1, tag, tag_n);
    if (kind == MT__TB_SCALAR) {
        p = mt__pb_key(p, 2, MT__PB_FIXED32);
        memcpy(p, &value, 4);
        return (size_t)(p + 4 - out);
    }
    p = mt__pb_bytes_head(p, 8, tensor_n);
    p = mt__pb_varint(mt__pb_key(p, 1, MT__PB_VARINT), 7);      /* dtype: DT_STRING */
    p = mt__pb_bytes_head(p, 2, shape_n);                          /* tensor_shape */
    p = mt__pb_bytes_head(p, 2, dim_n);                            /* dim */
    p = mt__pb_varint(mt__pb_key(p, 1, MT__PB_VARINT), 1);      /* size: 1 */
    p = mt__pb_bytes(p, 8, text, text_n);                          /* string_val */
    p = mt__pb_bytes_head(p, 9, meta_n);                           /* metadata */
    p = mt__pb_bytes_head(p, 1, plugin_n);                         /* plugin_data */
    p = mt__pb_bytes(p, 1, "text", 4);                             /* plugin_name */
    return (size_t)(p - out);
}

/* Frames an event as a TFRecord at the end of the pending bytes; flushes when the queue is full. */
static mt_status mt__tb_append(mt_tb_writer* w, int kind, const char* tag, float value, const char* text, int64_t step,
                               mt_error* err) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    double wall_time = (double)tv.tv_sec + (double)tv.tv_usec * 1e-6;
    size_t n = mt__tb_event(NULL, wall_time, step, kind, tag, value, text), record = 8 + 4 + n + 4;
    if (w->length + record > w->capacity) {
        size_t capacity = w->capacity * 2 > w->length + record ? w->capacity * 2 : w->length + record + 4096;
        unsigned char* grown = (unsigned char*)realloc(w->pending, capacity);
        if (!grown) return mt_fail(err, MT_ERR_OOM, "cannot hold %zu bytes of TensorBoard events", capacity);
        w->pending = grown;
        w->capacity = capacity;
    }
    unsigned char* p = w->pending + w->length;
    uint64_t length = (uint64_t)n;
    memcpy(p, &length, 8);
    uint32_t crc = mt_tb_masked_crc32c(p, 8);
    memcpy(p + 8, &crc, 4);
    mt__tb_event(p + 12, wall_time, step, kind, tag, value, text);
    crc = mt_tb_masked_crc32c(p + 12, n);
    memcpy(p + 12 + n, &crc, 4);
    w->length += record;
    if (++w->pending_events >= w->queue_size) return mt_tb_flush(w, err);
    return MT_OK;
}

MT_DEF mt_status mt_tb_flush(mt_tb_writer* w, mt_error* err) {
    if (w->length && mt__write_all(w->fd, w->pending, w->length) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot write TensorBoard events to %s: %s", w->path, strerror(errno));
    w->length = 0;
    w->pending_events = 0;
    return MT_OK;
}

MT_DEF mt_status mt_tb_open(mt_tb_writer** out, const char* dir, int queue_size, mt_error* err) {
    *out = NULL;
    if (queue_size < 1) return mt_fail(err, MT_ERR_ARG, "TensorBoard queue size %d: must be >= 1", queue_size);
    if (!dir || !*dir) return mt_fail(err, MT_ERR_ARG, "no TensorBoard directory given");
    if (mt_make_directories(dir) != 0)
        return mt_fail(err, MT_ERR_IO, "cannot create the TensorBoard directory %s: %s", dir, strerror(errno));
    struct utsname host;
    if (uname(&host) != 0) snprintf(host.nodename, sizeof(host.nodename), "localhost");
    for (char* c = host.nodename; *c; c++) if (*c == '/') *c = '_';
    mt_tb_writer* w = (mt_tb_writer*)calloc(1, sizeof(mt_tb_writer));
    size_t path_n = strlen(dir) + strlen(host.nodename) + 96;
    if (w) w->path = (char*)malloc(path_n);
    if (!w || !w->path) {
        free(w);
        return mt_fail(err, MT_ERR_OOM, "out of memory");
    }
    w->fd = -1;
    w->queue_size = queue_size;
    long long now = (long long)time(NULL);
    for (int k = 0; k < 1000 && w->fd < 0; k++) {
        snprintf(w->path, path_n, "%s/events.out.tfevents.%010lld.%s.%ld.%d", dir, now, host.nodename,
                 (long)getpid(), k);
        w->fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL, 0644);
        if (w->fd < 0 && errno != EEXIST) break;
    }
    if (w->fd < 0) {
        mt_status st = mt_fail(err, MT_ERR_IO, "cannot create a TensorBoard event file %s: %s", w->path, strerror(errno));
        free(w->path);
        free(w);
        return st;
    }
    mt_status st = mt__tb_append(w, MT__TB_FILE_VERSION, NULL, 0.0f, NULL, 0, err);
    if (st == MT_OK) st = mt_tb_flush(w, err);
    if (st != MT_OK) {
        unlink(w->path); /* nothing half-written: the file holds not even its first record */
        mt_tb_close(w, NULL);
        return st;
    }
    *out = w;
    return MT_OK;
}

MT_DEF const char* mt_tb_path(const mt_tb_writer* w) { return w->path; }

MT_DEF mt_status mt_tb_scalar(mt_tb_writer* w, const char* tag, double value, int64_t step, mt_error* err) {
    return mt__tb_append(w, MT__TB_SCALAR, tag, (float)value, NULL, step, err);
}

MT_DEF mt_status mt_tb_scalar_pair(mt_tb_writer* w, const char* tag, double value, int64_t iteration,
                                   int64_t consumed_samples, mt_error* err) {
    mt_status st = mt_tb_scalar(w, tag, value, iteration, err);
    char* twin = st == MT_OK ? mt__concat(tag, " vs samples") : NULL;
    if (st == MT_OK && !twin) st = mt_fail(err, MT_ERR_OOM, "out of memory");
    if (st == MT_OK) st = mt_tb_scalar(w, twin, value, consumed_samples, err);
    free(twin);
    return st;
}

MT_DEF mt_status mt_tb_text(mt_tb_writer* w, const char* tag, const char* text, int64_t step, mt_error* err) {
    char* full = mt__concat(tag, "/text_summary");
    if (!full) return mt_fail(err, MT_ERR_OOM, "out of memory");
    mt_status st = mt__tb_append(w, MT__TB_TEXT, full, 0.0f, text, step, err);
    free(full);
    return st;
}

MT_DEF mt_status mt_tb_close(mt_tb_writer* w, mt_error* err) {
    if (!w) return MT_OK;
    mt_status st = w->fd >= 0 ? mt_tb_flush(w, err) : MT_OK;
    if (w->fd >= 0 && close(w->fd) != 0 && st == MT_OK)
        st = mt_fail(err, MT_ERR_IO, "cannot close %s: %s", w->path, strerror(errno));
    free(w->pending);
    free(w->path);
    free(w);
    return st;
}

#ifdef __cplusplus
}
#endif

#endif /* MEGATRON_IMPLEMENTATION */
