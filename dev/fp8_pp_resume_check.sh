#!/usr/bin/env bash
# dev/fp8_pp_resume_check.sh — FP8 (delayed) at PP = 2 on 2 GPUs: 20 steps straight against 10 + save +
# load + 10 (the log lines of steps 11-20 and the final checkpoints' md5 must be equal), checkpoint_tool
# verify of the PP = 2 checkpoint, a reshard to PP = 1 (the FP8 state dropped, as for any other
# layout) and two steps trained from it on one GPU. Run from the repository root after make.
set -u
export NCCL_NVLS_ENABLE=0
M="mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2"
F="--train-iters 20 --lr-warmup-iters 5 --log-interval 1 --eval-interval 100 --eval-iters 1 --sample-tokens 0 --num-layers 4 --hidden-size 512 --num-attention-heads 4 --group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights --bf16 --fp8-format hybrid --fp8-recipe delayed --pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 16"
norm() { grep -E ' iteration +[0-9]+/' "$1" | sed -E -e 's/^ *\[[^]]*\]//' -e 's/elapsed time per iteration \(ms\): [0-9.]+ \|//' -e 's/throughput per GPU \(TFLOP\/s\/GPU\): [0-9.]+ \|//' -e 's/MFU: [0-9.]+% \|//' | grep -E 'iteration +(1[1-9]|20)/'; }
rm -rf /tmp/c1 /tmp/c2
$M ./train_gpt $F --save /tmp/c1 --save-interval 100 > /tmp/straight.log 2>&1; echo "straight rc $?"
$M ./train_gpt $F --save /tmp/c2 --save-interval 10 --exit-interval 10 > /tmp/first.log 2>&1; echo "first half rc $?"
$M ./train_gpt $F --save /tmp/c2 --save-interval 10 --load /tmp/c2 > /tmp/second.log 2>&1; echo "resume rc $?"
grep -i "load\|warn" /tmp/second.log | head -3
n=$(norm /tmp/straight.log | wc -l); if [ "$n" = 10 ] && diff <(norm /tmp/straight.log) <(norm /tmp/second.log) > /tmp/d.txt; then echo "RESUME BITWISE: iterations 11-20 identical ($(norm /tmp/straight.log | wc -l) lines)"; else echo "RESUME DIFFERS"; head -4 /tmp/d.txt; fi
a=$(find /tmp/c1/iter_0000020 -type f ! -name manifest.txt | sort | xargs cat | md5sum | cut -c1-12); b=$(find /tmp/c2/iter_0000020 -type f ! -name manifest.txt | sort | xargs cat | md5sum | cut -c1-12); echo "final checkpoints: straight $a resumed $b"
prepro/checkpoint_tool verify /tmp/c2 2>&1 | tail -3; echo "verify rc $?"
prepro/checkpoint_tool reshard /tmp/c2 /tmp/c3 --target-tp 1 --target-pp 1 2>&1 | tail -2; echo "reshard rc $?"
./train_gpt $F --pipeline-model-parallel-size 1 --train-iters 22 --lr-decay-iters 20 --load /tmp/c3 2>&1 | grep -E "iteration +2[12]/|error|warn" | sed -E 's/elapsed[^|]*\|//' | head -4
