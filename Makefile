# megatron.c build.
#   make            every binary: train_gpt, eval_hellaswag, test_megatron, prepro tools
#   make test       build and run the test suite (GPU tests skip without a GPU)
#   make GPU_ARCH=80 ...    override the CUDA target (default: the visible GPU, else Hopper; 90 builds sm_90a)
#   make fuzz, make asan-test, make ci-test   fuzzing and sanitizers (dev/fuzz/fuzz.mk)

NVCC    ?= nvcc
CC      ?= cc
CFLAGS  ?= -I. -O3 -Wall -Wextra -Wno-unused-parameter -std=c11 -D_GNU_SOURCE
NVFLAGS ?= -I. -O3 -std=c++17 -Xcompiler -Wall,-Wno-unused-parameter,-Wno-unused-function

# CUDA target: the compute capability of the first visible GPU, else Hopper (sm_90), e.g. in CI.
GPU_ARCH ?= $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d '.[:space:]')
ifeq ($(strip $(GPU_ARCH)),)
  GPU_ARCH := 90
endif
# Hopper (90) builds sm_90a, which runs on every compute capability 9.0 GPU (H100, H200, GH200): the
# experts' grouped GEMM (megatron.cu section 13.1) needs wgmma and setmaxnreg, which exist only in the
# "a" target. Other targets build that kernel as a stub that is never launched (cuBLAS instead).
GPU_CODE := $(if $(filter 90,$(GPU_ARCH)),90a,$(GPU_ARCH))
NVFLAGS += -gencode=arch=compute_$(GPU_CODE),code=sm_$(GPU_CODE)

# MPI is used when mpicc is on the PATH (set USE_MPI=0 to build without it); make says which, since a
# build without MPI trains on one GPU only (train_gpt then refuses to start under a multi-process launcher).
USE_MPI ?= $(if $(shell command -v mpicc 2>/dev/null),1,0)
ifeq ($(USE_MPI),1)
  MPI_CFLAGS := $(shell mpicc --showme:compile 2>/dev/null) -DMT_USE_MPI
  MPI_LIBS   := $(shell mpicc --showme:link 2>/dev/null)
  MPI_NOTE   := MPI found ($(shell command -v mpicc 2>/dev/null)): multi-GPU jobs run under mpirun or srun
else
  MPI_NOTE   := building WITHOUT MPI (no mpicc on the PATH, or USE_MPI=0): one process, one GPU; for multi-GPU jobs install an MPI (e.g. OpenMPI) and rebuild (make clean && make)
endif
ifeq ($(filter clean,$(MAKECMDGOALS)),)
  $(info megatron.c: $(MPI_NOTE))
endif

CUDA_LIBS := -lcublas -lcublasLt -lnccl
HOST_LIBS := -lpthread -lm

# Compressed input for preprocess_data (.gz, .zst): zlib and zstd, each used when its header and
# library are found (prepro/tokenizer.h refuses such files in one line otherwise).
have_lib = $(shell printf '\043include <$(1)>\nint main(void){return 0;}\n' | $(CC) -x c - -x none -o /dev/null $(2) 2>/dev/null && echo 1)
ifeq ($(call have_lib,zlib.h,-lz),1)
  CFLAGS += -DMT_HAVE_ZLIB
  NVFLAGS += -DMT_HAVE_ZLIB
  HOST_LIBS += -lz
endif
ifeq ($(call have_lib,zstd.h,-lzstd),1)
  CFLAGS += -DMT_HAVE_ZSTD
  NVFLAGS += -DMT_HAVE_ZSTD
  HOST_LIBS += -lzstd
endif

# serve_gpt (the text generation server) needs libmicrohttpd (HTTP) and cJSON (JSON): Debian's
# libmicrohttpd-dev and libcjson-dev, from the system or, where they cannot be installed (the GPU
# machine), unpacked into SERVE_DEPS by dev/serve_deps.sh (a directory that travels with the tree).
# libmicrohttpd is linked statically (its .a; it needs the system's libgnutls.so.30), cJSON from its
# .so (found at run time through the rpath). Without them serve_gpt is not built, and the suite's
# serve tests skip. serve_gpt_fake: serve_gpt.c with its CPU fake engine only, no CUDA (the host tests).
SERVE_DEPS ?= dev/serve_deps
SERVE_DEPS_LIB := $(firstword $(wildcard $(SERVE_DEPS)/usr/lib/*-linux-gnu))
ifneq ($(wildcard $(SERVE_DEPS)/usr/include/microhttpd.h),)
  SERVE_CFLAGS := -I$(SERVE_DEPS)/usr/include
  SERVE_LDFLAGS := -L$(SERVE_DEPS_LIB) -Xlinker -rpath -Xlinker $(abspath $(SERVE_DEPS_LIB))
endif
MHD_A := $(firstword $(wildcard $(SERVE_DEPS_LIB)/libmicrohttpd.a /usr/lib/*-linux-gnu/libmicrohttpd.a))
SERVE_LIBS := $(if $(MHD_A),$(MHD_A) -Xlinker -l:libgnutls.so.30,-lmicrohttpd) -lcjson
# (gcc takes nvcc's -Xlinker too, so one spelling serves both links)
HAVE_CJSON := $(call have_lib,cjson/cJSON.h,$(SERVE_CFLAGS) $(SERVE_LDFLAGS) -lcjson)
HAVE_SERVE := $(if $(HAVE_CJSON),$(call have_lib,microhttpd.h,$(SERVE_CFLAGS) $(SERVE_LDFLAGS) $(SERVE_LIBS)))
# the suite's serve tests (serve_api.h) and the parser's fuzz target need cJSON
ifeq ($(HAVE_CJSON),1)
  TEST_SERVE_FLAGS := -DMT_HAVE_CJSON $(SERVE_CFLAGS)
  TEST_SERVE_LIBS := $(SERVE_LDFLAGS) -lcjson
endif
# serve_gpt links megatron.cu's generation engine (mt_generator_*, megatron.h 15b)
SERVE_BINS := $(if $(HAVE_SERVE),serve_gpt_fake serve_gpt)

PREPRO := prepro/preprocess_data prepro/merge_datasets prepro/dataset_info prepro/convert_hf prepro/checkpoint_tool
HEADERS := megatron.h prepro/tokenizer.h prepro/safetensors.h prepro/unicode_tables.h

.PHONY: all test clean moe-vectors
# the MoE GPU tests' reference vectors (tests/test_moe.h; not in the repository): python with torch
moe-vectors:
	python3 dev/ref_moe.py
all: train_gpt eval_hellaswag test_megatron $(PREPRO) $(SERVE_BINS) dev/data/hellaswag_val_full.txt

megatron.o: megatron.cu $(HEADERS)
	$(NVCC) $(NVFLAGS) -c $< -o $@

train_gpt.o: train_gpt.c train_gpt_flags.h $(HEADERS)
	$(CC) $(CFLAGS) $(MPI_CFLAGS) -c $< -o $@

train_gpt: train_gpt.o megatron.o
	$(NVCC) $(NVFLAGS) $^ -o $@ $(CUDA_LIBS) $(MPI_LIBS) $(HOST_LIBS)

# eval_hellaswag: HellaSwag accuracy of a checkpoint (its data: make dev/data/hellaswag_val_full.txt)
eval_hellaswag.o: eval_hellaswag.c $(HEADERS)
	$(CC) $(CFLAGS) -c $< -o $@

eval_hellaswag: eval_hellaswag.o megatron.o
	$(NVCC) $(NVFLAGS) $^ -o $@ $(CUDA_LIBS) $(HOST_LIBS)

dev/data/hellaswag_val_full.txt: dev/data/hellaswag_val_full.txt.bz2
	bzip2 -dc $< > $@.tmp && mv $@.tmp $@

# serve_gpt: the server over the generation engine (megatron.h 15b); never part of train_gpt.
serve_gpt.o: serve_gpt.c serve_api.h train_gpt_flags.h $(HEADERS)
	$(CC) $(CFLAGS) $(SERVE_CFLAGS) -c $< -o $@

serve_gpt: serve_gpt.o megatron.o
	$(NVCC) $(NVFLAGS) $^ -o $@ $(CUDA_LIBS) $(SERVE_LDFLAGS) $(SERVE_LIBS) $(HOST_LIBS)

serve_gpt_fake: serve_gpt.c serve_api.h train_gpt_flags.h $(HEADERS)
	$(CC) $(CFLAGS) -DMT_SERVE_FAKE_ONLY $(SERVE_CFLAGS) $< -o $@ $(SERVE_LDFLAGS) $(SERVE_LIBS) $(HOST_LIBS)

# The test suite includes megatron.cu whole, so it can reach the kernels behind the API.
test_megatron: test_megatron.cu megatron.cu train_gpt_flags.h serve_api.h $(HEADERS) $(wildcard tests/*.h)
	$(NVCC) $(NVFLAGS) $(MPI_CFLAGS) $(TEST_SERVE_FLAGS) $< -o $@ $(CUDA_LIBS) $(MPI_LIBS) $(TEST_SERVE_LIBS) $(HOST_LIBS)

prepro/%: prepro/%.c prepro/args.h $(HEADERS)
	$(CC) $(CFLAGS) $< -o $@ $(HOST_LIBS)
HF_HEADERS := prepro/safetensors.h prepro/hf_checkpoint.h prepro/hf_gpt2.h prepro/hf_llama.h prepro/hf_moe.h
prepro/convert_hf: $(HF_HEADERS)
prepro/checkpoint_tool: prepro/checkpoint_tool.h
test_megatron: prepro/checkpoint_tool.h
test_megatron: $(HF_HEADERS)
eval_hellaswag.o: $(HF_HEADERS)

# dev/hf_logits: a checkpoint's logits for a token file (used by dev/hf_check.py on a GPU machine)
dev/hf_logits: dev/hf_logits.c megatron.o $(HEADERS)
	$(CC) $(CFLAGS) -c $< -o dev/hf_logits.o
	$(NVCC) $(NVFLAGS) dev/hf_logits.o megatron.o -o $@ $(CUDA_LIBS) $(HOST_LIBS)

# dev/generate_bench: the generation engine's decode speed (dev/bench/generate_bench.sh runs it on a GPU)
dev/generate_bench: dev/generate_bench.c megatron.o $(HEADERS)
	$(CC) $(CFLAGS) -c $< -o dev/generate_bench.o
	$(NVCC) $(NVFLAGS) dev/generate_bench.o megatron.o -o $@ $(CUDA_LIBS) $(HOST_LIBS)

test: test_megatron $(PREPRO) $(if $(HAVE_SERVE),serve_gpt_fake)
	./test_megatron

clean:
	rm -f *.o train_gpt eval_hellaswag test_megatron serve_gpt serve_gpt_fake dev/hf_logits dev/generate_bench dev/generate_bench.o $(PREPRO) $(FUZZ_TARGETS) test_megatron_asan

include dev/fuzz/fuzz.mk
