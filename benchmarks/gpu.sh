#!/usr/bin/env bash
# The GPU figures of issue 13, on one lent device, in one prepared run (about 8 minutes on an H200).
#
#     bash benchmarks/gpu.sh [OUT_DIR]        # the device tool: bash benchmarks/gpu.sh "$OUT"
#
# Each part has its own time limit, so one that hangs or fails costs its limit and the rest still
# run; every part's full output is in OUT_DIR/<part>.log and its last lines are printed here:
#   gpu_check      the device, its peak and source, bench-model tokens/s and MFU, timers on a GPU
#   gpt_eager      the ~1.3B GPT (configs/gpu_gpt_1_3b.toml) in bf16: tokens/s and MFU, eager ops
#   gpt_fused      the same with model.fused_ops (Triton kernels)
#   gpt_compile    the same with train.compile (each block compiled)
#   llama_eager    the Llama-style 1.3B (RMSNorm, SwiGLU, rotary), eager, then fused
#   attention      sliding-window (flex_attention, block mask) vs full causal (SDPA) as s grows
#   generate       600 tokens of sliding-window generation: how many graphs flex attention compiled
#   tp2            a 2-process NCCL tensor-parallel run on this one GPU (NCCL may refuse it)
#   tp2_compile    the same, sequence parallel and train.compile: the tp collectives as custom ops on NCCL
#   plan           `megascale plan --calibrate` here, then the planner's step time for the 1.3B run
# On a machine without CUDA it says so and exits 0.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-runs/gpu}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA device here: nothing to measure"
    exit 0
fi
"$PY" -m pip install -q -e . >/dev/null 2>&1 || true  # a bare device machine: the package itself

part() {  # part NAME SECONDS COMMAND...: run it under a limit, keep its log, show its last lines
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    grep -E "^(done|gpu_check|attention|generate|plan|tp2|  start-up|tp[0-9])|tok/s|MFU|error" "$OUT/$name.log" \
        | tail -n 8
    echo "-- $name: exit $rc after $((SECONDS - t0)) s"
}

TRAIN=("$PY" -m megascale train --config configs/gpu_gpt_1_3b.toml train.steps=10 checkpoint.resume=false)
LLAMA=(model.style=llama model.bias=false model.tie_embeddings=false)

part gpu_check 90 "$PY" benchmarks/gpu_check.py --steps 20 --rounds 2
part gpt_eager 75 "${TRAIN[@]}" "train.run_dir=$OUT/gpt_eager"
part gpt_fused 90 "${TRAIN[@]}" model.fused_ops=true "train.run_dir=$OUT/gpt_fused"
part gpt_compile 120 "${TRAIN[@]}" train.compile=true "train.run_dir=$OUT/gpt_compile"
part llama_eager 75 "${TRAIN[@]}" "${LLAMA[@]}" "train.run_dir=$OUT/llama_eager"
part llama_fused 90 "${TRAIN[@]}" "${LLAMA[@]}" model.fused_ops=true "train.run_dir=$OUT/llama_fused"
part attention 45 "$PY" - <<'PY'
import time, torch
from megascale.ops.attention import causal_attention, sliding_window_attention
torch.manual_seed(0)
def ms(fn, q, k, v, n=5):
    fn(q, k, v).sum().backward(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(q, k, v).sum().backward()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n
window = 1024
for s in (2048, 4096, 8192, 16384):
    q, k, v = (torch.randn(1, 16, s, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    full = ms(causal_attention, q, k, v)
    slide = ms(lambda a, b, c: sliding_window_attention(a, b, c, window), q, k, v)
    print(f"attention s={s} window={window}: full {full:.2f} ms, sliding {slide:.2f} ms fwd+bwd "
          f"(sliding/full {slide / full:.2f}; per token {1e3 * slide / s:.3f} us)", flush=True)
PY
part generate 60 "$PY" - <<'PY'
# sliding-window generation on the GPU: compiled flex-attention graphs as the context grows past the
# window (context_bucket pads it to a few lengths; one compile per length would hit the recompile limit)
import time, torch, torch._dynamo
from megascale.config import ModelConfig
from megascale.model import GPT
torch.manual_seed(0)
cfg = ModelConfig(vocab_size=50304, seq_len=2048, n_layers=4, d_model=1024, n_heads=16, attention="sliding",
                  window=256)
model = GPT(cfg).cuda().to(torch.bfloat16).eval()
torch._dynamo.utils.counters.clear()
t = time.perf_counter()
out = model.generate(torch.zeros(1, 1, dtype=torch.long, device="cuda"), 600, temperature=0)
torch.cuda.synchronize()
frames = sum(torch._dynamo.utils.counters["frames"].values()) if "frames" in torch._dynamo.utils.counters else -1
print(f"generate sliding window=256: {out.shape[1] - 1} tokens in {time.perf_counter() - t:.1f} s; dynamo "
      f"counters {dict(torch._dynamo.utils.counters['stats'])}; frames {frames}", flush=True)
PY
part tp2 60 "$PY" -m megascale train --nproc 2 --config configs/bench_gpt_19m.toml parallel.tp=2 train.steps=10 \
    train.dtype=bf16 checkpoint.resume=false "train.run_dir=$OUT/tp2"
part tp2_compile 60 "$PY" -m megascale train --nproc 2 --config configs/bench_gpt_19m.toml parallel.tp=2 \
    parallel.sequence_parallel=true train.compile=true train.steps=10 train.dtype=bf16 checkpoint.resume=false \
    "train.run_dir=$OUT/tp2_compile"
part plan 120 bash -c "'$PY' -m megascale plan --cluster h200 --calibrate && \
    '$PY' -m megascale plan --config configs/gpu_gpt_1_3b.toml --cluster h200 --gpus 1 --settings config"
echo "gpu.sh: logs in $OUT"
