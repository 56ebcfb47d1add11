# megatron.c build.
#   make            every binary: train_gpt, eval_hellaswag, test_megatron, prepro tools
#   make test       build and run the test suite (GPU tests skip without a GPU)
#   make GPU_ARCH=90a ...   override the CUDA target (default: the visible GPU, else sm_90)
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
NVFLAGS += -gencode=arch=compute_$(GPU_ARCH),code=sm_$(GPU_ARCH)

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
have_lib = $(shell printf '\043include <$(1)>\nint main(void){return 0;}\n' | $(CC) -x c - -o /dev/null $(2) 2>/dev/null && echo 1)
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

PREPRO := prepro/preprocess_data prepro/merge_datasets prepro/dataset_info prepro/convert_hf prepro/checkpoint_tool
HEADERS := megatron.h prepro/tokenizer.h prepro/safetensors.h prepro/unicode_tables.h

.PHONY: all test clean
all: train_gpt eval_hellaswag test_megatron $(PREPRO) dev/data/hellaswag_val_full.txt

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

# The test suite includes megatron.cu whole, so it can reach the kernels behind the API.
test_megatron: test_megatron.cu megatron.cu train_gpt_flags.h $(HEADERS) $(wildcard tests/*.h)
	$(NVCC) $(NVFLAGS) $(MPI_CFLAGS) $< -o $@ $(CUDA_LIBS) $(MPI_LIBS) $(HOST_LIBS)

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

test: test_megatron $(PREPRO)
	./test_megatron

clean:
	rm -f *.o train_gpt eval_hellaswag test_megatron dev/hf_logits dev/generate_bench dev/generate_bench.o $(PREPRO) $(FUZZ_TARGETS) test_megatron_asan

include dev/fuzz/fuzz.mk
