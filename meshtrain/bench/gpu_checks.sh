#!/usr/bin/env bash
# meshtrain on a GPU machine, in one call: install, the README's command, GPT-2 124M in bf16,
# the GPU memory of offload and recompute, one GPU's eager and compiled speed against plain
# PyTorch (`meshtrain bench single`), and the CUDA test tier. Every step's log and the
# runs' summaries go to $OUT (default ./gpu-checks); $OUT/results.txt lists each step's exit
# status and $OUT/figures.json each run's GPU memory (allocated, peak) and step time.
#
#     bash meshtrain/bench/gpu_checks.sh                 # every step, from the repository root
#     bash meshtrain/bench/gpu_checks.sh env tier        # only these steps
#
# Steps: install env default gpt2 offload recompute single train8 compile profile tier calibrate
# verify verify-gpt2 verify-llama recipe recipe-fp8. A step that fails, or outlasts $STEP_TIMEOUT seconds (default 600), is recorded and the
# next one runs. ROUNDS=N repeats calibrate's and verify's runs N times (their default: 3).
# TARBALL=PATH packs $OUT into one file after every step (a machine that hands back only a
# few files, or is taken back mid-way, still returns the steps done). Runs train in a
# scratch folder (checkpoints stay out of $OUT). The timing steps
# (single, train8, compile, profile, calibrate, verify*, recipe*) want the GPU to themselves; the others can
# share it, e.g. in one call of about four minutes on an H100 (docs/gpu.md was measured this way):
#
#     export STEP_TIMEOUT=150; S=meshtrain/bench/gpu_checks.sh
#     OUT=/tmp/gc/setup bash $S install env
#     OUT=/tmp/gc/tier TIER_WORKERS=8 bash $S tier > /dev/null &
#     OUT=/tmp/gc/runs bash $S default gpt2 offload recompute; wait
#     OUT=/tmp/gc/quiet bash $S single profile calibrate verify
#     tar czf gpu-checks.tgz -C /tmp/gc .
set -u
cd "$(dirname "$0")/../.."   # the repository root (this file is meshtrain/bench/gpu_checks.sh)
ALL="install env default gpt2 offload recompute single train8 compile profile tier calibrate"
ALL="$ALL verify verify-gpt2 verify-llama recipe recipe-fp8"
STEPS=${*:-$ALL}
for s in $STEPS; do
    case " $ALL " in *" $s "*) ;; *) echo "unknown step $s (steps: $ALL)" >&2; exit 2 ;; esac
done
OUT=${OUT:-$PWD/gpu-checks}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/meshtrain-gpu-checks.XXXXXX")
PY=${PYTHON:-python3}
STEP_TIMEOUT=${STEP_TIMEOUT:-600}
ROUNDS_ARG=${ROUNDS:+--rounds $ROUNDS}
mkdir -p "$OUT/runs"
: > "$OUT/results.txt"

step() {   # step NAME COMMAND...: run it, log to $OUT/NAME.log, record its exit status
    local name=$1; shift
    echo "== $name: $*" | tee -a "$OUT/results.txt"
    local start=$SECONDS
    timeout -k 10 "$STEP_TIMEOUT" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/results.txt"
    if [ -n "${TARBALL:-}" ]; then tar czf "$TARBALL" -C "$OUT" .; fi
}

train() {   # train NAME ARGS...: meshtrain train in the scratch folder; keep what it reports
    local name=$1; shift
    step "train-$name" "$PY" -m meshtrain train --no-progress --run-dir "$SCRATCH/$name" "$@"
    keep "$name" "$SCRATCH/$name"
}

keep() {    # keep NAME RUN_DIR: the run's summary, metrics, config and report into $OUT/runs
    mkdir -p "$OUT/runs/$1"
    cp "$2"/{summary.json,metrics.jsonl,config.json,failure.log,report*.png} "$OUT/runs/$1/" \
        2>/dev/null || true
}


for s in $STEPS; do
    case $s in
    install) step install "$PY" -m pip install --no-deps --no-build-isolation -e . ;;
    env) step env bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, \
torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), \
torch.cuda.nccl.version() if torch.cuda.is_available() else None)'" ;;
    default)   # the README's command, exactly: no flags, its own runs/<date-time> folder
        step train-default bash -c "cd '$SCRATCH' && meshtrain train"
        keep default "$(ls -d "$SCRATCH"/runs/* 2>/dev/null | tail -n 1)" ;;
    gpt2) train gpt2-bf16 --model gpt2-124m --precision bf16 --steps 50 ;;
    offload)   # GPU peak without and with the optimizer states on the host (one rank)
        for o in none cpu; do
            train "offload-$o" --model gpt2-124m --precision bf16 --steps 5 --batch 8 \
                --nproc 1 --zero 1 --offload "$o" --eval-every 1000
        done ;;
    recompute)   # GPU peak without and with full recomputation (one rank)
        for r in none full; do
            train "recompute-$r" --model gpt2-124m --precision bf16 --steps 5 --batch 8 \
                --nproc 1 --recompute "$r" --eval-every 1000
        done ;;
    single)   # GPT-2 124M, B=8, bf16, one GPU: torch and meshtrain, eager and compiled
        step bench-single "$PY" -m meshtrain bench single --device cuda --model gpt2-124m \
            --batch 8 --precision bf16 --steps 5 --reps 20 --warmup 3 \
            --json "$OUT/bench-single.json" ;;
    train8)   # the command's own step on bench single's case: its median step beside Plan()'s
        train gpt2-b8 --model gpt2-124m --precision bf16 --batch 8 --nproc 1 --steps 40 \
            --eval-every 1000 --ckpt-every 1000 ;;
    profile)   # where bench single's steps spend their time, eager and compiled
        step profile "$PY" -m meshtrain.bench.profile_step --model gpt2-124m --batch 8 \
            --precision bf16 ;;
    compile) train gpt2-bf16-compile --model gpt2-124m --precision bf16 --steps 50 --compile ;;
    tier) step tier "$PY" -m pytest -m cuda tests/gpu -v -rs -p no:cacheprovider -o addopts= \
            -n "${TIER_WORKERS:-4}" --dist load --junitxml "$OUT/tier.xml" ;;
    calibrate)   # the planner's profile of this GPU, kept beside the logs
        step calibrate "$PY" -m meshtrain plan --calibrate $ROUNDS_ARG
        cp ~/.cache/meshtrain/profiles/*.json "$OUT/" 2>/dev/null || true ;;
    verify) step verify "$PY" -m meshtrain plan --verify --json $ROUNDS_ARG ;;
    verify-gpt2)   # the same plans on GPT-2 124M, the model bench single and train8 time
        step verify-gpt2 "$PY" -m meshtrain plan --verify --model gpt2-124m --json $ROUNDS_ARG ;;
    recipe)   # Llama 3.2 1B's shape at 4096 tokens, bf16: meshtrain vs the torchtitan recipe
        step bench-recipe "$PY" -m meshtrain bench recipe --device cuda --size 1b \
            --precision bf16 --json "$OUT/bench-recipe.json" ;;
    recipe-fp8)   # the same in float8 (both sides eager); needs torchao: pip install '.[fp8]'
        step bench-recipe-fp8 "$PY" -m meshtrain bench recipe --device cuda --size 1b \
            --precision fp8 --json "$OUT/bench-recipe-fp8.json" ;;
    verify-llama)   # a transformers Llama, priced from its trace (measure/traced.py)
        step verify-llama "$PY" -m meshtrain plan --verify --model llama-tiny --json \
            $ROUNDS_ARG ;;
    esac
done

"$PY" - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
figures = {}
for summary in sorted(out.glob("runs/*/summary.json")):
    s = json.loads(summary.read_text())
    figures[summary.parent.name] = {
        "plan": s["plan"], "median_step_s": s["median_step_s"],
        "tokens_per_s": s["tokens_per_s"],
        "memory_per_rank": [{k: m.get(k) for k in ("device_allocated", "device_peak",
                                                   "host_pinned", "activations", "offloaded")}
                            for m in s["memory_per_rank"]]}
(out / "figures.json").write_text(json.dumps(figures, indent=1))
print(json.dumps(figures, indent=1))
EOF
rm -rf "$SCRATCH"
if [ -n "${TARBALL:-}" ]; then tar czf "$TARBALL" -C "$OUT" .; fi
echo "logs and figures in $OUT"
