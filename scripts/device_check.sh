#!/bin/bash
# The GPU checks of docs/cuda.md in one call on a lent GPU machine that
# reaches no network (docs/cuda.md, "On a lent GPU machine"):
#
#   scripts/device_check.sh [--budget S] [--prepare CMD] [--peer CMD] [--peer-bf16 CMD] [--allow-no-gpu] [--plan]
#                           [STEP...]
#
# STEPs run in the order given (default: image programs bench bench-bf16 training nccl configs):
#   image      what the machine has: GPU, driver, nvcc, Python, PyTorch, MPI, NCCL, cuDNN
#   programs   tests/run_tests.py -k cuda-programs: every op and variant on the GPU against float64
#              references and finite differences, fp32, TF32 and bf16 builds
#   bench      scripts/bench.py: every variant at GPT-2 124M's shape (B 8, T 1024), TF32, one round,
#              with the kernel-by-kernel profile; tok/s, MFU, GPU memory; PyTorch eager beside it
#   bench-bf16 the same in bf16 mixed precision (CUDA_BF16: bf16 activations and products), with the profile,
#              PyTorch eager with bf16 autocast beside it
#   vocab-ab   QKV in bf16 at B 16, T 1024 with GPT-2's vocabulary as it is (50257) and padded to 50304 (what
#              GPT2_VOCAB_MULTIPLE=128 makes it, as llm.c does), alternating, two rounds each: what the head's row
#              alignment costs; and each run's causal attention alone with the scores in registers and with the
#              WMMA kernels (attention_set_mma_path)
#   training   tests/run_tests.py -k cuda-training: CPU against GPU training of every family, checkpoints across
#              targets, TF32 and bf16 against fp32, bf16 against fp32 over 500 steps
#   nccl       tests/run_tests.py -k cuda-nccl: the NCCL transport under mpirun, every family against one process
#   configs    tests/run_tests.py -k cuda-configs: the architecture and precision choices, a tiny benchmark of
#              every variant with its profile and PyTorch beside it, cached decoding
#   sanitizer  compute-sanitizer's racecheck, synccheck and memcheck on test_kernels in three builds: QKV in fp32
#              (the scalar kernels), K in bf16 mixed precision (the mma.sync kernels, the symmetric backward) and
#              KV tying + GQA + Pos in TF32 (the WMMA kernels): shared-memory races, barriers not every thread
#              reaches and accesses outside a buffer, on the GPU itself (the emulation cannot see those)
#   gpt2-124m  GPT-2 124M V0 (QKV) on tiny Shakespeare BPE, B 8, T 1024, 40 steps, TF32, no dropout, twice;
#              writes its checkpoint in llm.c's format to .device/work/gpt2_124M.bin after the first round, and
#              runs --peer CMD (say llm.c's train_gpt2fp32cu on that file) after each round, so the two alternate
#   gpt2-124m-bf16  the same in bf16 mixed precision at B 16 (issue 17's shape), --peer-bf16 CMD (say llm.c's
#              train_gpt2cu without and with cuDNN attention) after each round
#   ablation-bf16  the 124M V0/V1 ablation in bf16 (defconfigs/gpt2-124m-kv-tying-ablation-cuda-bf16) end to end,
#              each step's training capped (GPT2_MAX_TIME) so that both fit what is left of the budget; its
#              summary (tok/s, GPU memory, val loss of V0 and V1) comes last in the log
#
# --prepare CMD runs in the background from the start (its output in $OUT/prepare.log), beside the steps: say,
# building a peer from source carried under .device/; a peer waits for it (at most 240 s) before its first round.
# Before the steps it unpacks .device/deps.tar.xz (scripts/device_pack.sh, run beforehand on a machine with
# apt) over / without replacing any file already there, and finds a Python with numpy for the tests.
# Each step runs under what is left of --budget (seconds, default 570: one device call is at most 600), is
# skipped when less is left than it needs to start, and writes its whole output to $OUT/STEP.log (.device/out
# without $OUT); the last lines of each step, then a table of the steps, come last.
# --plan prints the steps and their minimum times; --allow-no-gpu runs without a visible GPU (a dry run of
# this script: the CUDA code is compiled, nothing runs on a GPU). Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

BUDGET=570
PEER=""
PEER_BF16=""
PREPARE=""
PREPARE_WAIT=240
ALLOW_NO_GPU=0
PLAN=0
steps=()
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET="$2"; shift 2 ;;
        --peer) PEER="$2"; shift 2 ;;
        --allow-no-gpu) ALLOW_NO_GPU=1; shift ;;
        --plan) PLAN=1; shift ;;
        --prepare) PREPARE="$2"; shift 2 ;;
        --peer-bf16) PEER_BF16="$2"; shift 2 ;;
        -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
        -*) echo "error: unknown option $1 (hint: scripts/device_check.sh --help)" >&2; exit 2 ;;
        *) steps+=("$1"); shift ;;
    esac
done
[ ${#steps[@]} -gt 0 ] || steps=(image programs bench bench-bf16 training nccl configs)
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "error: --budget $BUDGET is not a number of seconds (hint: --budget 570)" >&2; exit 2; }

# seconds a step needs at least to be worth starting
min_seconds() {
    case "$1" in
        image) echo 5 ;; programs) echo 150 ;; bench | bench-bf16) echo 120 ;; training) echo 150 ;;
        nccl) echo 90 ;; configs) echo 120 ;; vocab-ab) echo 60 ;;
        gpt2-124m | gpt2-124m-bf16) echo 90 ;; ablation-bf16) echo 365 ;; sanitizer) echo 120 ;;
        *) echo "" ;;
    esac
}
for s in "${steps[@]}"; do
    [ -n "$(min_seconds "$s")" ] ||
        { echo "error: unknown step '$s' (hint: image, programs, bench, bench-bf16, vocab-ab, training, nccl, configs, sanitizer," \
            "gpt2-124m, gpt2-124m-bf16, ablation-bf16)" >&2; exit 2; }
done
if [ "$PLAN" = 1 ]; then
    echo "device_check: budget ${BUDGET} s"
    [ -z "$PREPARE" ] || echo "  prepare        in the background from the start: $PREPARE"
    for s in "${steps[@]}"; do printf '  %-14s starts with at least %s s left\n' "$s" "$(min_seconds "$s")"; done
    exit 0
fi

START=$SECONDS
OUTDIR="${OUT:-.device/out}"
export OUTDIR PEER PEER_BF16 PREPARE PREPARE_WAIT
mkdir -p "$OUTDIR" .device/work
gpus=$(nvidia-smi -L 2>/dev/null)
if [[ "$gpus" != *GPU* ]]; then
    if [ "$ALLOW_NO_GPU" = 0 ]; then
        echo "error: no GPU visible (nvidia-smi -L lists none) (hint: run this on the lent GPU machine, or pass --allow-no-gpu for a dry run)" >&2
        exit 2
    fi
    echo "device_check: no GPU visible; --allow-no-gpu: a dry run"
fi

# ---- setup: the carried Debian packages, a Python with numpy, no package installs
if [ -f .device/deps.tar.xz ] && [ "$ALLOW_NO_GPU" = 0 ]; then
    stamp="/var/tmp/kvlab-deps.$(cksum < .device/deps.tar.xz | cut -d' ' -f1)"
    if [ ! -e "$stamp" ] && [ -w / ]; then
        # GNU tar: keep files that exist (the image's libraries win) and directory links (/lib -> usr/lib)
        if xz -dc .device/deps.tar.xz | tar -C / --skip-old-files --keep-directory-symlink -xf -; then
            ldconfig
            touch "$stamp"
            echo "device_check: unpacked .device/deps.tar.xz ($(wc -l < .device/packages.txt) packages)"
        else
            echo "device_check: warning: unpacking .device/deps.tar.xz failed; the build may miss libraries"
        fi
    fi
elif [ ! -f .device/deps.tar.xz ]; then
    echo "device_check: warning: no .device/deps.tar.xz (hint: scripts/device_pack.sh here first, then carry .device and data)"
fi
export KVLAB_DEPS=skip PYTHONUNBUFFERED=1
# the scripts run /usr/bin/python3; give it kconfiglib (Debian's, unpacked above) and numpy (the image's)
[ -x /usr/bin/python3 ] || { [ -w /usr/bin ] && ln -s "$(command -v python3)" /usr/bin/python3; }
pypath=()
/usr/bin/python3 -c 'import kconfiglib' 2>/dev/null || pypath+=(/usr/lib/python3/dist-packages)
if ! /usr/bin/python3 -c 'import numpy' 2>/dev/null; then
    for py in $(type -ap python3); do
        site=$("$py" -c 'import numpy, os, sys; print(os.path.dirname(os.path.dirname(numpy.__file__)), "%d.%d" % sys.version_info[:2])' 2>/dev/null) || continue
        [ "${site#* }" = "$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" ] || continue
        pypath+=("${site% *}")
        break
    done
fi
if [ ${#pypath[@]} -gt 0 ]; then
    PYTHONPATH="$(IFS=:; echo "${pypath[*]}")${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi

# ---- the steps
step_image() {
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap,clocks.max.sm --format=csv
    echo "--- nvcc"; (nvcc --version || /usr/local/cuda/bin/nvcc --version) 2>&1 | tail -2
    echo "--- python"; /usr/bin/python3 -c 'import sys, numpy, kconfiglib; print(sys.version.split()[0], "numpy", numpy.__version__)'
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "compile", hasattr(torch, "compile"))' 2>&1 | tail -1
    echo "--- tools"; for t in cc make mpirun nvidia-smi ncu compute-sanitizer xz; do printf '%-18s %s\n' "$t" "$(command -v $t || echo MISSING)"; done
    mpirun --version 2>&1 | head -1
    echo "--- libraries"; ldconfig -p | grep -E 'libnccl\.|libcudnn\.|libcublas\.|libopenblas|libcjson\.|libcurl\.|libmpi\.' | sed 's/ (.*=>/ =>/'
    echo "--- data"; ls data/tinyshakespeare data/gpt2-bpe /usr/share/datasets/fashion-mnist 2>&1 | tr '\n' ' '; echo
    local miss=()
    /usr/bin/python3 -c 'import kconfiglib' 2>/dev/null || miss+=(kconfiglib)
    /usr/bin/python3 -c 'import numpy' 2>/dev/null || miss+=(numpy)
    command -v mpirun >/dev/null || miss+=(mpirun)
    [ -f data/gpt2-bpe/encoder.json ] || miss+=(data)
    local gpu
    gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
    echo "image: ${gpu:-no GPU}, $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'no nvcc'), $(python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null || echo 'no torch')${miss[*]:+; MISSING: ${miss[*]}}"
    [ ${#miss[@]} -eq 0 ]
}
step_programs() { /usr/bin/python3 tests/run_tests.py -k cuda-programs; }
step_training() { /usr/bin/python3 tests/run_tests.py -k cuda-training; }
step_nccl() { /usr/bin/python3 tests/run_tests.py -k cuda-nccl; }
step_configs() { /usr/bin/python3 tests/run_tests.py -k cuda-configs; }
# bench_at PRECISION TARBALL [ARGS...]: every variant at GPT-2 124M's shape in that precision, one round
bench_at() {
    local precision="$1" tarball="$2" peer=()
    shift 2
    # PyTorch eager beside every variant where the image has a CUDA PyTorch (torch.compile takes minutes per
    # variant: a call of its own, scripts/bench.py --peer-compile)
    python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null && peer=(--peer torch)
    rm -rf output/bench
    # the vocabulary as the GPU forms of the 124M study pad it (GPT2_VOCAB_MULTIPLE=128)
    /usr/bin/python3 scripts/bench.py --only variants --target cuda --precision "$precision" \
        --shape 12 12 768 1024 8 50304 --rounds 1 "$@" "${peer[@]}" || return
    tar -C output/bench -czf "$OUTDIR/$tarball" . && echo "device_check: output/bench -> $tarball"
}
step_bench() { bench_at tf32 bench.tgz --profile; }
step_bench-bf16() { bench_at bf16 bench-bf16.tgz --profile; }
# QKV's bench_step in bf16 (built as scripts/bench.py builds it) at both vocabularies, alternating
step_vocab-ab() {
    local bin round v
    bin=$(/usr/bin/python3 -c 'import sys; sys.path.insert(0, "scripts"); import bench
print(bench.build("qkv", "QKV", target="cuda", precision="bf16"))') || return
    for round in 1 2; do
        for v in 50257 50304; do
            "$bin" 12 12 768 1024 16 "$v" 10 | /usr/bin/python3 -c "import json, sys; d = json.load(sys.stdin)
print('round $round: vocabulary', d['shape']['V'], '|', d['ms_per_step'], 'ms/step |', d['tokens_per_s'], 'tok/s |',
      'causal attention', d['causal_attention_ms'], 'ms, WMMA kernels', d['causal_attention_ms_wmma'], 'ms')" || return
        done
    done
}
# compute-sanitizer on test_kernels of three builds for the GPU that is there, racecheck first (what the emulation
# is least able to see), each tool over every build before the next tool; a hazard exits 86, a failed check of
# the program itself (under the sanitizer's slowdown) its own status
step_sanitizer() {
    local cs w=.device/work/sanitizer name frags bin tool rc=0 t0 st
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    [ -x "$cs" ] || { echo "device_check: no compute-sanitizer on this image (PATH, /usr/local/cuda/bin)"; return 1; }
    mkdir -p "$w"
    printf 'CONFIG_TARGET_CUDA=y\nCONFIG_CUDA_NATIVE=y\n' > "$w/native.frag"
    printf 'CONFIG_CUDA_BF16=y\n' > "$w/bf16act.frag"
    printf 'CONFIG_CUDA_TF32=y\n' > "$w/tf32.frag"
    printf '\n' > "$w/fp32.frag"
    # name:step fragments:precision fragment (after the target's, on which the precision choice depends)
    local builds=("qkv-fp32:defconfigs/steps/QKV:fp32"
                  "k-bf16act:defconfigs/steps/K:bf16act"
                  "kv_tying_gqa_pos-tf32:defconfigs/steps/KV_TYING tests/configs/pos_m7 tests/configs/kv_heads_gqa:tf32")
    local made=() prec
    for b in "${builds[@]}"; do
        IFS=: read -r name frags prec <<< "$b"
        # shellcheck disable=SC2086,SC2015  # the fragments are words; either command failing skips the build
        /usr/bin/python3 scripts/kconfig.py step "$w/$name" tests/configs/base $frags tests/configs/cuda \
            "$w/native.frag" "$w/$prec.frag" &&
        make -s -j"$(nproc)" -f scripts/Makefile.build B="$w/$name" VARIANT_TESTS=y "$w/$name/tests/test_kernels" ||
            { echo "device_check: the build of $name failed"; rc=1; continue; }
        made+=("$name")
    done
    for tool in racecheck synccheck memcheck; do
        for name in "${made[@]}"; do
            bin="$w/$name/tests/test_kernels" t0=$SECONDS
            "$cs" --tool "$tool" --error-exitcode 86 --print-limit 20 "$bin" > "$w/$name.$tool.log" 2>&1
            st=$?
            case $st in
                0) echo "sanitizer $tool $name: ok ($((SECONDS - t0)) s) $(grep -h 'ERROR SUMMARY\|RACECHECK SUMMARY' "$w/$name.$tool.log" | tail -1)" ;;
                86) echo "sanitizer $tool $name: HAZARDS ($((SECONDS - t0)) s):"; grep -m 20 -E '^========= (Error|Warning|Race|Barrier|Invalid)|^=========     at ' "$w/$name.$tool.log"; rc=1 ;;
                *) echo "sanitizer $tool $name: test_kernels itself failed under it (exit $st, $((SECONDS - t0)) s):"; { grep -m 10 '^FAIL' "$w/$name.$tool.log"; tail -n 2 "$w/$name.$tool.log"; }; rc=1 ;;
            esac
            cp "$w/$name.$tool.log" "$OUTDIR/sanitizer-$name-$tool.log" 2>/dev/null
        done
    done
    echo "sanitizer: ${#made[@]} of ${#builds[@]} builds, $((${#made[@]} * 3)) runs, $([ "$rc" = 0 ] && echo "all clean" || echo "FAILURES above")"
    return "$rc"
}
# wait_prepare: returns once --prepare has finished (at once without one); fails when it failed or is still
# running after PREPARE_WAIT seconds of waiting (a hung build must not take the call's remaining steps with it)
wait_prepare() {
    [ -n "$PREPARE" ] || return 0
    local waited=0
    [ -e .device/work/prepare.rc ] || echo "=== waiting for --prepare to finish (at most ${PREPARE_WAIT} s)"
    while [ ! -e .device/work/prepare.rc ]; do
        [ "$waited" -lt "$PREPARE_WAIT" ] ||
            { echo "device_check: --prepare still running after ${PREPARE_WAIT} s of waiting: no peer round"; return 1; }
        sleep 2
        waited=$((waited + 2))
    done
    read -r prc _ < .device/work/prepare.rc
    [ "$prc" = 0 ] || { echo "device_check: --prepare failed (exit $prc; $OUTDIR/prepare.log): no peer round"; return 1; }
}
# gpt2_rounds TAG DEFCONFIG PEER [NAME=VALUE...]: GPT-2 124M V0 (DEFCONFIG, one of the 124M ablation's GPU forms,
# at 40 steps, no dropout, the settings given on top) twice in .device/work/TAG, PEER (when given) after each kvlab round, so the two
# alternate; PEER sees KVLAB_ROUND (1, 2). Its checkpoint goes to .device/work/gpt2_124M.bin in llm.c's format
# after the first round of TAG gpt2-124m (train_gpt2fp32cu starts from it).
gpt2_rounds() {
    local tag="$1" defconfig="$2" peer_cmd="$3" w=".device/work/$1" round rc=0
    shift 3
    mkdir -p "$w"
    /usr/bin/python3 scripts/kconfig.py defconfig "defconfigs/$defconfig" "$w/.config" &&
    /usr/bin/python3 scripts/kconfig.py set "$w/.config" CUDA_NATIVE=y GPT2_MAX_ITERS=40 GPT2_DROPOUT=0 \
        GPT2_EVAL_INTERVAL=40 GPT2_EVAL_ITERS=2 GPT2_LOG_INTERVAL=10 ABLATION_STEPS=V0 \
        "OUTPUT_DIR=$PWD/$w/output" "$@" || return
    for round in 1 2; do
        echo "=== round $round: kvlab ($tag)"
        rm -rf "$w/output"
        make O="$w" || return
        grep -h 'ms/step' "$w"/output/*/train_stepV0.log | tail -2
        if [ "$round" = 1 ] && [ "$tag" = gpt2-124m ]; then
            /usr/bin/python3 scripts/export_llmc.py --ckpt "$(ls "$w"/output/*/final_model_stepV0.safetensors)" \
                --out .device/work/gpt2_124M.bin || return
        fi
        if [ -n "$peer_cmd" ]; then
            if wait_prepare; then  # a peer's pipeline fails when any part of it does
                echo "=== round $round: peer: $peer_cmd"
                KVLAB_ROUND=$round bash -o pipefail -c "$peer_cmd" || rc=$?
            else  # kvlab's rounds still run; the step fails
                peer_cmd=""
                rc=1
            fi
        fi
    done
    echo "kvlab, round 2: $(grep -h 'ms/step' "$w"/output/*/train_stepV0.log | tail -1 |
        sed -E 's/.*\| *([0-9.]+ ms\/step) \| *([0-9]+ tok\/s).*/\1, \2/')"
    return $rc
}
step_gpt2-124m() { gpt2_rounds gpt2-124m gpt2-124m-kv-tying-ablation-cuda "$PEER"; }
step_gpt2-124m-bf16() { gpt2_rounds gpt2-124m-bf16 gpt2-124m-kv-tying-ablation-cuda-bf16 "$PEER_BF16" GPT2_BATCH_SIZE=16; }
# the ablation end to end: both steps' training capped alike so that the whole fits the step's time (two builds,
# the evaluations and checkpoints of two steps and the summary take the rest, about 240 s)
step_ablation-bf16() {
    local w=.device/work/ablation-bf16 each=$(((KVLAB_STEP_SECONDS - 240) / 2))
    [ "$each" -ge 60 ] || { echo "device_check: ablation-bf16 needs at least 360 s, has $KVLAB_STEP_SECONDS"; return 1; }
    mkdir -p "$w"
    echo "=== the 124M ablation in bf16, each step's training capped at $each s (GPT2_MAX_TIME)"
    /usr/bin/python3 scripts/kconfig.py defconfig defconfigs/gpt2-124m-kv-tying-ablation-cuda-bf16 "$w/.config" &&
    /usr/bin/python3 scripts/kconfig.py set "$w/.config" CUDA_NATIVE=y "GPT2_MAX_TIME=$each" \
        "OUTPUT_DIR=$PWD/$w/output" || return
    make O="$w"
}

results=()
failed=0
# --prepare in the background, marked like a step (stopped at the end if still running); it leaves its exit status
# and end time in .device/work/prepare.rc for wait_prepare and the table
rm -f .device/work/prepare.rc .device/work/prepare.rc.part
if [ -n "$PREPARE" ]; then
    prep_t0=$(date +%s)
    (KVLAB_DEVICE_STEP="prepare.$$" bash -c "$PREPARE" > "$OUTDIR/prepare.log" 2>&1
     echo "$? $(date +%s)" > .device/work/prepare.rc.part && mv .device/work/prepare.rc.part .device/work/prepare.rc) &
    echo "=== device_check: prepare in the background: $PREPARE"
fi
# stop_marked MARK WHAT: kill every process that carries MARK in its environment
stop_marked() {
    local env pid
    for env in /proc/[0-9]*/environ; do
        if grep -q -z -x -F "KVLAB_DEVICE_STEP=$1" "$env" 2>/dev/null; then
            pid=${env#/proc/}
            kill -9 "${pid%/environ}" 2>/dev/null && echo "device_check: stopped process ${pid%/environ}, left by $2"
        fi
    done
}
for s in "${steps[@]}"; do
    left=$((BUDGET - (SECONDS - START)))
    need=$(min_seconds "$s")
    log="$OUTDIR/$s.log"
    if [ "$left" -lt "$need" ]; then
        results+=("$s|skipped|0|$left s left, needs $need")
        failed=1
        continue
    fi
    t0=$SECONDS
    echo "=== device_check: $s (${left} s left)"
    # the step in a shell of its own, stopped when the budget runs out (timeout signals its process group), and
    # then whatever it started in sessions of their own (mpirun, the test runner's trainers): every process
    # that carries this step's mark in its environment
    mark="$s.$$.$SECONDS"
    limit=$((left > 10 ? left - 5 : 5))
    KVLAB_DEVICE_STEP="$mark" KVLAB_STEP_SECONDS="$limit" timeout --kill-after=10 "$limit" \
        bash -c "$(declare -f bench_at wait_prepare gpt2_rounds "step_$s"); step_$s" > "$log" 2>&1
    rc=$?
    stop_marked "$mark" "$s"
    dt=$((SECONDS - t0))
    tail -n 12 "$log"
    summary=$(grep -E '[0-9]+ passed, [0-9]+ failed' "$log" | tail -1)
    [ -n "$summary" ] || summary=$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-70)
    case $rc in
        0) status=ok ;; 124|137) status="timed out"; failed=1 ;; *) status="FAILED ($rc)"; failed=1 ;;
    esac
    results+=("$s|$status|$dt|$summary")
done
if [ -n "$PREPARE" ]; then
    # part of the call's work: waited for while the budget lasts, then stopped
    while [ ! -e .device/work/prepare.rc ] && [ $((SECONDS - START)) -lt "$BUDGET" ]; do sleep 1; done
    if [ -e .device/work/prepare.rc ]; then
        read -r prc pend < .device/work/prepare.rc
        if [ "$prc" = 0 ]; then status=ok; else status="FAILED ($prc)"; failed=1; fi
        results+=("prepare|$status|$((pend - prep_t0))|$(grep -v '^\s*$' "$OUTDIR/prepare.log" | tail -1 | cut -c1-70)")
    else
        stop_marked "prepare.$$" prepare
        results+=("prepare|not finished|$(($(date +%s) - prep_t0))|stopped at the end of the steps")
        failed=1
    fi
fi

{
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    echo "device_check: ${gpu:-no GPU}, commit $(git rev-parse --short HEAD 2>/dev/null), $((SECONDS - START)) s"
    printf '%-14s | %-12s | %5s | %s\n' step status s result
    for r in "${results[@]}"; do
        IFS='|' read -r a b c d <<< "$r"
        printf '%-14s | %-12s | %5s | %s\n' "$a" "$b" "$c" "$d"
    done
} | tee "$OUTDIR/summary.txt"
exit $failed
