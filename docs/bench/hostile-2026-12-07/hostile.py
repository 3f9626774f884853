"""Issue 52's hostile pass, its latency and memory goals: another tenant's short request timed alone and while
each hostile body runs (started 0.5 s before it); the server's resident memory sampled every 50 ms; /metrics'
size after all of it. Usage: hostile.py PORT (a `verispec serve` there, its PID in SERVER_PID)."""
import json, os, random, statistics, sys, threading, time, urllib.request, urllib.error

port, pid = int(sys.argv[1]), int(os.environ["SERVER_PID"])
url = f"http://127.0.0.1:{port}"
random.seed(0)
words = [w.strip() for w in open("/usr/share/dict/words")] if os.path.exists("/usr/share/dict/words") else None
vocab = words or ["alpha", "river", "stone", "cloud", "ember", "violet", "north", "quiet", "lamp", "orbit"]

def post(body, timeout=600):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read(); status = r.status
    except urllib.error.HTTPError as e:
        e.read(); status = e.code
    return status, time.perf_counter() - start

def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0

def msg(text):
    return [{"role": "user", "content": text}]

def const_body(value, max_tokens):
    schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": value}}}
    return {"model": "smollm2-135m", "messages": msg("Say it."), "max_tokens": max_tokens, "temperature": 0, "response_format": schema}

other = {"model": "smollm2-135m", "messages": msg("Hello"), "max_tokens": 2, "temperature": 0}
hostile = {
    "D1 const of 2,500 words (17 KB)": const_body(" ".join(random.choice(vocab) for _ in range(2500)), 8000),
    "D2 const of 500 KB, max_tokens 48": const_body("x" * 500_000, 48),
    "D6 recursive schema": {**other, "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"n": {"$ref": "#/$defs/a"}}, "required": ["n"]}}}}}},
    "D11 k of 4,000 digits": {**other, "k": int("9" * 4000)} if False else {**other, "k": 10**40},
    "D12 prompt of 3.9 MB": {**other, "messages": msg("word " * 780_000)},
    "long generation (max_tokens 400)": {**other, "messages": msg("Tell me a long story about a dragon."), "max_tokens": 400},
}
for _ in range(2):
    post(other)
alone = sorted(post(other)[1] for _ in range(7))
base = statistics.median(alone)
base_rss = rss()
print(f"another tenant alone: median {base:.3f} s (of 7: {alone[0]:.3f}–{alone[-1]:.3f}); server RSS {base_rss:.0f} MiB", flush=True)
worst = 0.0
repeat = int(os.environ.get("REPEAT", "1"))
for name, body in [(f"{n} #{i + 1}", b) for n, b in hostile.items() for i in range(repeat)]:
    before = rss()
    peak = [before]
    done = threading.Event()
    def sample():
        while not done.is_set():
            peak.append(rss()); time.sleep(0.05)
    sampler = threading.Thread(target=sample); sampler.start()
    result = {}
    attacker = threading.Thread(target=lambda: result.update(zip(("status", "seconds"), post(body))))
    attacker.start(); time.sleep(0.5)
    waits = [post(other)[1] for _ in range(3)]
    attacker.join(); done.set(); sampler.join()
    extra = max(waits) - base
    worst = max(worst, extra)
    print(f"{name}: its answer {result['status']} in {result['seconds']:.1f} s; the other tenant's 3 requests beside it "
          f"{', '.join(f'{w:.3f}' for w in waits)} s (+{extra:.2f} s over alone); server RSS {before:.0f} MiB before it, "
          f"peak {max(peak):.0f} MiB (+{max(peak) - before:.0f})", flush=True)
with urllib.request.urlopen(url + "/metrics") as r:
    size = len(r.read())
print(f"worst added latency {worst:.2f} s; /metrics {size / 1024:.1f} KB; server RSS now {rss():.0f} MiB", flush=True)
