# dev/fuzz/fuzz.mk — included by the Makefile: the libFuzzer targets and the sanitized host tests.
#   make fuzz         every dev/fuzz/fuzz_*.c as a libFuzzer binary (clang; ASan + UBSan, UB aborts)
#   make fuzz-smoke   each target on its seed corpus for FUZZ_SECONDS (default 20) seconds
#   make asan-test    the host tests of test_megatron under ASan + UBSan (dev/fuzz/README.md says how)
#   make ci-test      what CI runs: make test, make asan-test, make fuzz-smoke

FUZZ_CC ?= clang
FUZZ_SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS := -I. -g -O1 -std=c11 -D_GNU_SOURCE -fsanitize=fuzzer $(FUZZ_SANITIZE) $(filter -DMT_HAVE_%,$(CFLAGS))
# fuzz_serve (the server's request parser, serve_api.h) needs cJSON: built only where it is found
FUZZ_SRCS := $(filter-out $(if $(HAVE_CJSON),,dev/fuzz/fuzz_serve.c),$(wildcard dev/fuzz/fuzz_*.c))
FUZZ_TARGETS := $(FUZZ_SRCS:.c=)
FUZZ_SECONDS ?= 20

.PHONY: fuzz fuzz-smoke asan-test ci-test
fuzz: $(FUZZ_TARGETS)

dev/fuzz/fuzz_%: dev/fuzz/fuzz_%.c dev/fuzz/fuzz_common.h train_gpt_flags.h $(HEADERS) $(HF_HEADERS) prepro/checkpoint_tool.h
	$(FUZZ_CC) $(FUZZ_CFLAGS) $< -o $@ $(HOST_LIBS)

dev/fuzz/fuzz_serve: dev/fuzz/fuzz_serve.c serve_api.h
	$(FUZZ_CC) $(FUZZ_CFLAGS) $(SERVE_CFLAGS) $< -o $@ $(SERVE_LDFLAGS) -lcjson $(HOST_LIBS)

fuzz-smoke: fuzz
	dev/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

ci-test: test asan-test fuzz-smoke

# The test suite's host tests under ASan + UBSan: nvcc compiles the host code with its host compiler
# (gcc), which takes the sanitizers through -Xcompiler and links their runtimes; the device code is
# not instrumented. Only the host.* groups run (ASan and the CUDA driver need protect_shadow_gap=0
# together; no GPU test runs here anyway).
ASAN_NVFLAGS := $(filter-out -O3,$(NVFLAGS)) -O1 -g \
  -Xcompiler -fsanitize=address,-fsanitize=undefined,-fno-sanitize-recover=undefined,-fno-omit-frame-pointer
test_megatron_asan: test_megatron.cu megatron.cu train_gpt_flags.h serve_api.h $(HEADERS) $(HF_HEADERS) prepro/checkpoint_tool.h $(wildcard tests/*.h)
	$(NVCC) $(ASAN_NVFLAGS) $(MPI_CFLAGS) $(TEST_SERVE_FLAGS) $< -o $@ $(CUDA_LIBS) $(MPI_LIBS) $(TEST_SERVE_LIBS) $(HOST_LIBS)

asan-test: test_megatron_asan $(if $(HAVE_SERVE),serve_gpt_fake)
	ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ./test_megatron_asan host.
