#!/bin/bash
# issue 52's first-run goal: generate --target gemma3-270m on a fresh cache (model file present: no download), with and without a CPU-bound process beside it
V=/work/main/.venv/bin/verispec
fresh() { F=$(mktemp -d /tmp/fresh.XXXX); mkdir -p $F/models/gemma3-270m; ln -s ~/.cache/verispec/models/gemma3-270m/model.gguf $F/models/gemma3-270m/model.gguf; ln -s ~/.cache/verispec/kernels $F/kernels; echo $F; }
run() { local s=$(date +%s.%N); VERISPEC_CACHE=$1 $V generate --target gemma3-270m "The three primary colors are" --max-new-tokens 40 > /tmp/gen.out 2> /tmp/gen.err; local rc=$?; local e=$(date +%s.%N); printf "%s rc=%s %.1f s | %s\n" "$2" $rc $(echo "$e - $s" | bc) "$(grep -E '^\[' /tmp/gen.err | tail -1)"; grep -v '^\[' /tmp/gen.err | head -3 | sed 's/^/    /'; }
echo "load before: $(cat /proc/loadavg)"
F=$(fresh); run $F "idle, first run (fresh cache)"; run $F "idle, second run"
python3 -c "while True: pass" & HOG=$!
sleep 2
F=$(fresh); run $F "beside a CPU-bound process, first run"; run $F "beside a CPU-bound process, second run"
kill $HOG
