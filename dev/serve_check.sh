#!/usr/bin/env bash
# dev/serve_check.sh — the text generation server with the real engine, on a GPU machine: builds
# serve_gpt and train_gpt, trains the built-in model for a few steps into a checkpoint, then checks
#   - bad startup input: flags of another model than the checkpoint, a tokenizer of another vocabulary,
#     a port in use: one line each and a non-zero exit before serving;
#   - generate: greedy twice gives the same text; a seed twice the same text;
#   - the server (python3's standard library as the client): /api and /v1/completions shapes, greedy
#     equal to generate's, 16 concurrent requests on 8 slots, bad requests (4xx with a JSON error, the
#     server still up), a stream (SSE events adding up to the non-stream text, then [DONE]), clients that
#     go away, SIGTERM with a request in flight (it completes, exit 0).
# Prints one PASS/FAIL line per check and ends with "serve_check: N passed, M failed" (exit 1 on any
# failure). Where libmicrohttpd-dev/libcjson-dev cannot be installed, run dev/serve_deps.sh on a machine
# with apt first and carry dev/serve_deps with the tree.
#   dev/serve_check.sh [WORKDIR]     (default /tmp/serve_check)
set -uo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/serve_check}
rm -rf "$work"
mkdir -p "$work"
pass=0
fail=0
ok() { echo "PASS $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; fail=$((fail + 1)); }
check() { if eval "$2"; then ok "$1"; else bad "$1"; fi; }

if ! ldconfig -p 2>/dev/null | grep -q 'libgnutls.so.30'; then echo "FAIL libgnutls.so.30 is missing (libmicrohttpd.a needs it)"; exit 1; fi
make -j"$(nproc)" serve_gpt train_gpt > "$work/build.log" 2>&1 || { tail -20 "$work/build.log"; echo "FAIL build"; exit 1; }
ok "build serve_gpt"

ckpt="$work/ckpt"
./train_gpt --train-iters 40 --save "$ckpt" --save-interval 40 --eval-interval 1000 --sample-tokens 0 \
  > "$work/train.log" 2>&1 || { tail -20 "$work/train.log"; echo "FAIL train a checkpoint"; exit 1; }
ok "train the built-in model 40 steps into $ckpt"

# ---- bad startup input: one line, non-zero exit, before serving
port=$((20000 + RANDOM % 20000))
startup() { # name, expected part of the line, args...
  local name=$1 part=$2
  shift 2
  timeout 120 ./serve_gpt "$@" > "$work/startup.out" 2> "$work/startup.err"
  local rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(wc -l < "$work/startup.err")" -le 2 ] && grep -q "$part" "$work/startup.err" \
     && ! grep -q "serving on" "$work/startup.out"; then ok "$name (exit $rc: $(head -c 160 "$work/startup.err"))"
  else bad "$name (exit $rc): $(cat "$work/startup.err" | head -5)"; fi
}
startup "another model's flags refused" "serve_gpt:" serve --load "$ckpt" --num-layers 3 --port $port
startup "another flavour refused" "serve_gpt:" serve --load "$ckpt" --swiglu --normalization RMSNorm --port $port
startup "a tokenizer of another vocabulary refused" "vocabulary" serve --load "$ckpt" \
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model dev/data/tokenizers/qwen2 --port $port
python3 -c "import socket,time; s=socket.socket(); s.bind(('0.0.0.0',$port)); s.listen(1); time.sleep(60)" &
holder=$!
sleep 1
startup "a port in use refused" "cannot listen on port $port" serve --load "$ckpt" --port $port
kill $holder 2>/dev/null; wait $holder 2>/dev/null

# ---- generate
g1=$(./serve_gpt generate --load "$ckpt" --prompt "ROMEO:" --tokens-to-generate 24 --temperature 0 2>"$work/gen.err")
g2=$(./serve_gpt generate --load "$ckpt" --prompt "ROMEO:" --tokens-to-generate 24 --temperature 0 2>>"$work/gen.err")
s1=$(./serve_gpt generate --load "$ckpt" --prompt "ROMEO:" --tokens-to-generate 24 --temperature 0.9 --seed 7 2>>"$work/gen.err")
s2=$(./serve_gpt generate --load "$ckpt" --prompt "ROMEO:" --tokens-to-generate 24 --temperature 0.9 --seed 7 2>>"$work/gen.err")
check "generate greedy twice: the same text" '[ -n "$g1" ] && [ "$g1" = "$g2" ]'
check "generate seed 7 twice: the same text" '[ -n "$s1" ] && [ "$s1" = "$s2" ]'
printf '%s' "$g1" > "$work/greedy.txt"

# ---- the server
port=$((20000 + RANDOM % 20000))
./serve_gpt serve --load "$ckpt" --port $port --max-batch 8 > "$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 600); do grep -q "serving on port" "$work/server.log" && break; sleep 0.2; done
check "server up" 'grep -q "serving on port" "$work/server.log"'

python3 - "$port" "$work" <<'PY'
import json, sys, threading, time, http.client, urllib.request, os
port, work = int(sys.argv[1]), sys.argv[2]
results = []
def report(name, cond, detail=""):
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)[:400]), flush=True)
def call(method, path, body, timeout=300):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    c.request(method, path, body=data, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    out = r.read()
    c.close()
    return r.status, out

st, out = call("PUT", "/api", {"prompts": ["ROMEO:", "JULIET:"], "tokens_to_generate": 16, "logprobs": True, "top_k": 1})
j = json.loads(out) if st == 200 else {}
shape = st == 200 and len(j.get("text", [])) == 2 and all(len(j["logprobs"][i]) == len(j["tokens"][i]) - 1 and
        len(j["segments"][i]) == len(j["tokens"][i]) for i in range(2)) and j["text"][0].startswith("ROMEO:")
report("PUT /api: text, segments, logprobs, tokens in Megatron's shapes", shape, out)
greedy = open(os.path.join(work, "greedy.txt")).read().rstrip("\n")
st, out = call("POST", "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0})
txt = json.loads(out)["choices"][0]["text"] if st == 200 else None
report("POST /v1/completions greedy = generate's greedy", st == 200 and ("ROMEO:" + txt).rstrip("\n") == greedy, (txt, greedy))

# 16 concurrent requests on 8 slots: each answered, greedy ones equal to the single request's text
outs = [None] * 16
def worker(i):
    try:
        outs[i] = call("POST", "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0} if i % 2 == 0 else
                       {"prompt": "Some other prompt %d" % i, "max_tokens": 8 + i, "seed": i})
    except Exception as e:
        outs[i] = (0, str(e).encode())
ts = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
t0 = time.time()
[t.start() for t in ts]; [t.join() for t in ts]
ok = all(o and o[0] == 200 for o in outs)
same = ok and all(json.loads(outs[i][1])["choices"][0]["text"] == txt for i in range(0, 16, 2))
report("16 concurrent requests answered (%.2f s)" % (time.time() - t0), ok, [o[:1] for o in outs])
report("greedy text under batching = alone", same, [json.loads(outs[i][1])["choices"][0]["text"] for i in range(0, 4, 2)] if ok else "")

# bad requests: 4xx with a JSON error, the server still serves
bads = [("PUT", "/api", b'{"prompts": ["a"', 400), ("PUT", "/api", {"prompts": "a"}, 400),
        ("PUT", "/api", {"prompts": ["a"], "temperature": -1}, 400), ("PUT", "/api", {"prompts": ["a"] * 129}, 400),
        ("PUT", "/api", {"prompts": ["a"], "tokens_to_generate": 10**9}, 400),
        ("PUT", "/api", {"prompts": ["word " * 5000], "tokens_to_generate": 1}, 400),
        ("POST", "/v1/completions", {"prompt": "a", "n": 4}, 400), ("PUT", "/api", b" " * (2 << 20), 413),
        ("GET", "/api", b"", 405), ("POST", "/nope", b"{}", 404)]
for m, p, b, want in bads:
    try:
        st, out = call(m, p, b)
        good = st == want and "error" in json.loads(out)
    except Exception as e:
        st, out, good = 0, str(e), False
    report("bad request %s %s -> %d" % (m, p, want), good, (st, out))
st, out = call("PUT", "/api", {"prompts": ["ROMEO:"], "tokens_to_generate": 4})
report("still serving after bad requests", st == 200, out)

# a stream: events that add up to the non-stream text, then [DONE]
c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
c.request("POST", "/v1/completions", body=json.dumps({"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0, "stream": True}))
r = c.getresponse()
raw = r.read().decode()
events = [e[6:] for e in raw.split("\n\n") if e.startswith("data: ")]
texts = [json.loads(e)["choices"][0]["text"] for e in events if e != "[DONE]"]
report("stream: %d events, [DONE] last, text = non-stream's" % len(events),
       r.status == 200 and r.getheader("Content-Type", "").startswith("text/event-stream") and events[-1] == "[DONE]" and
       len(events) > 2 and "".join(texts) == txt, raw[-400:])

# clients that go away mid-request: the server stays up and answers the next one
for _ in range(8):
    try:
        call("POST", "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 200}, timeout=0.05)
    except Exception:
        pass
st, out = call("POST", "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4})
report("clients that went away: the next request answered", st == 200, out)
PY

# SIGTERM with a request in flight: it completes, the server exits 0
python3 - "$port" "$work" <<'PY' &
import json, sys, http.client
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=300)
c.request("PUT", "/api", body=json.dumps({"prompts": ["ROMEO:"] * 4, "tokens_to_generate": 200, "top_k": 1}))
r = c.getresponse()
j = json.loads(r.read())
open(sys.argv[2] + "/inflight.txt", "w").write("%d %d\n" % (r.status, min(len(t) for t in j["tokens"])))
PY
client=$!
sleep 0.5
kill -TERM $server
wait $server
rc=$?
wait $client
check "SIGTERM mid-request: exit 0" '[ $rc -eq 0 ]'
check "SIGTERM mid-request: the request in flight completed ($(cat "$work/inflight.txt" 2>/dev/null))" \
  'read code n < "$work/inflight.txt" && [ "$code" = 200 ] && [ "$n" -ge 3 ]'

echo "serve_check: $pass passed, $fail failed"
[ $fail -eq 0 ]
