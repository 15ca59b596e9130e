#!/usr/bin/env bash
# On a GPU, in one call of at most 8 minutes (one H200): hydratrain's defaults side by side with the hand-written loop
# at the same precision (bf16), eager and compiled, for gpt_small (single, fsdp) and llama_1b (fsdp, seq 2048) at the
# batch the memory planner picks (bench/gpu_table.py: tokens/s, MFU, peak memory, compile seconds, the targets), and
# llama_1b's precision=fp8 against bf16 (tokens/s, the loss at step 100; alone with TABLE_ROWS=fp8 in one call), and
# hydratrain model=hf_causal_lm against transformers.Trainer on a Llama of about 1B (alone with TABLE_ROWS=hf_trainer),
# and llama_1b's step that saves a checkpoint, asynchronous against synchronous (alone with TABLE_ROWS=save), and
# torchtitan's Llama-3 trainer against hydratrain on llama_1b's shape (alone with TABLE_ROWS=torchtitan; torchtitan's
# wheels carried in bench/wheels: bash bench/torchtitan_deps.sh wheels);
# with --smoke instead, the paths no CPU test reaches, each as one train.py launch (about 3-5 minutes on one H200).
#
#   bench/gpu.sh                               # the table (bench/gpu_table.py --budget-s 420: 7 minutes at most)
#   bench/gpu.sh --smoke                       # the smoke cases below on 1 GPU; with 2+ GPUs also fsdp +
#                                              #   checkpoint/resume on all of them (torchrun, NCCL)
#   bench/gpu.sh --dry-run [--smoke]           # the same sequence on CPU, tiny (+debug=fast_gpt, gloo); also DRY_RUN=1
#   bench/gpu.sh --out DIR                     # results dir (default bench/out/gpu-<date>-<time>[-dry])
#   CASES=fsdp_bf16,compile bench/gpu.sh --smoke    # only these smoke cases (names below)
#   bench/gpu.sh --smoke -- logger.peak_flops=9.9e14   # extra overrides for every smoke launch (PEAK_FLOPS too)
#   TABLE_BUDGET=300 bench/gpu.sh              # the table's budget in seconds (default 420; dry run 1800)
#   TABLE_ROWS=fp8 bench/gpu.sh                # only these row sets of the table (vs_hand, fp8, hf_trainer, save,
#                                              #   torchtitan; default all): fp8 = llama_1b precision=fp8 against
#                                              #   bf16, 100 steps each; hf_trainer = hydratrain against
#                                              #   transformers.Trainer, 4 x 2048; save = llama_1b's save step, async
#                                              #   against synchronous; torchtitan = torchtitan's trainer against
#                                              #   hydratrain, compile and full activation checkpointing on both
#
# Smoke cases (data=synthetic; on GPU gpt_small runs batch 8 x 1024 tokens per rank; FSDP is kept on one GPU with
# strategy.shard_on_one_rank=true, where the default would train as single):
#   fsdp_bf16      strategy=fsdp precision=bf16 model=gpt_small
#   fp16_scaler    strategy=fsdp precision=fp16 model=gpt_small              (GradScaler; not every step skipped)
#   cpu_offload    ... strategy.cpu_offload=true                              (FSDP2 CPUOffloadPolicy, pinned)
#   meta_llama_1b  model=llama_1b, batch 2 x 512                              (built on meta, sharded, materialised)
#   compile        ... trainer.compile=true                                   (torch.compile of every block)
#   ac             ... activation_checkpointing=true                          (recompute each block in backward)
#   compile_ac     ... trainer.compile=true activation_checkpointing=true
#   ckpt_save      ... hydra.run.dir=DIR/runs/ckpt checkpoint.every_n_steps=N trainer.max_steps=N
#   ckpt_resume    the same run dir relaunched with trainer.max_steps=2N: resumes at N, trains N more
#   adamw8bit      ... optim=adamw8bit (torchao's 8-bit AdamW on FSDP2 shards; needs pip install -e ".[lowbit]")
#   *_x<R>         with R >= 2 GPUs (2 CPU ranks in the dry run): fsdp_bf16, ckpt_save, ckpt_resume on R ranks
#   hsdp_x<R>      strategy=hsdp strategy.shard_size=R/2 on R ranks (2 replicas of R/2-way shards)
#   vs_hand        bench/overhead.py: hydratrain (its defaults, and bf16 against bf16) against a hand-written loop
#                  on gpt_small, 1 GPU (single) and all of them (fsdp), 2 interleaved rounds; its table is appended
#
# results.md also holds the gpt_small bf16 fsdp matrix of compile off/on x activation checkpointing off/on (tokens/s,
# MFU, peak memory) from fsdp_bf16, compile, ac and compile_ac.
#
# Each smoke case PASSes when train.py exits 0 and its results.json has the expected steps, finite train and eval loss,
# tokens/s > 0, peak memory > 0 and an MFU in (0, 1] (on a GPU in hydratrain's peak table an MFU is required).
# Printed per case and written to DIR/results.jsonl (one JSON object per case) and DIR/results.md (a table), with
# DIR/env.json (torch, GPUs), DIR/logs/<case>.log and DIR/runs/<case>/ (run dirs). Exit status 0 when all passed.
# The table writes DIR/results.jsonl, DIR/results.md and DIR/profile-*.txt (see bench/gpu_table.py's docstring);
# exit status 0 when every row that ran passed.
#
# Env: PYTHON (default python), CASES, STEPS (steps per smoke case, >= 4), CASE_TIMEOUT (s per launch), MAX_NPROC
# (default 8), PEAK_FLOPS (logger.peak_flops), HYDRATRAIN_CACHE (where the CPU peak and corpora are cached),
# TABLE_BUDGET (the table's seconds), TABLE_ROWS (the table's row sets), TORCHTITAN_SITE (where torchtitan is
# unpacked; default: bench/wheels unpacked into $TMPDIR/torchtitan-site when it holds them).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
DRY="${DRY_RUN:-0}"
SMOKE=0
OUT=""
EXTRA=()
while (($#)); do
  case "$1" in
    --dry-run) DRY=1 ;;
    --smoke) SMOKE=1 ;;
    --out) OUT="${2:?--out needs a directory}"; shift ;;
    --out=*) OUT="${1#--out=}" ;;
    --) shift; EXTRA=("$@"); break ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "bench/gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$DRY" in 0|""|false|no) DRY=0 ;; *) DRY=1 ;; esac
[[ -n "${PEAK_FLOPS:-}" ]] && EXTRA+=("logger.peak_flops=$PEAK_FLOPS")
KNOWN=" fsdp_bf16 fp16_scaler cpu_offload meta_llama_1b compile ac compile_ac ckpt_save ckpt_resume adamw8bit vs_hand "
for c in ${CASES:+${CASES//,/ }}; do
  if [[ "$KNOWN" != *" $c "* && ! "$c" =~ ^(fsdp_bf16|ckpt_save|ckpt_resume|hsdp)_x[0-9]+$ ]]; then
    echo "bench/gpu.sh: CASES: unknown case '$c'; cases:$KNOWN(and fsdp_bf16_xR, ckpt_save_xR, ckpt_resume_xR," \
      "hsdp_xR on R GPUs)" >&2
    exit 2
  fi
done

OUT="${OUT:-$ROOT/bench/out/gpu-$(date +%Y%m%d-%H%M%S)$( ((DRY)) && echo -dry)}"
mkdir -p "$OUT/logs" "$OUT/runs" || exit 2
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/results.jsonl"
REPORT=("$PY" "$ROOT/bench/gpu_report.py")

if ((!SMOKE)); then  # the side-by-side table: bench/gpu_table.py keeps its own budget
  if ((DRY)); then
    "${REPORT[@]}" env --out "$OUT" --dry-run > /dev/null || exit 2
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    TABLE=(--dry-run)
  else
    NGPU="$("${REPORT[@]}" env --out "$OUT")" || exit 2
    if ((NGPU < 1)); then
      echo "bench/gpu.sh: torch sees no CUDA GPU; run 'bench/gpu.sh --dry-run' to test this script on CPU" >&2
      exit 2
    fi
    TABLE=(--max-nproc "${MAX_NPROC:-8}")
  fi
  echo "bench/gpu.sh: the side-by-side table$( ((DRY)) && echo " (CPU dry run)"), results in $OUT"
  [[ -n "${TABLE_BUDGET:-}" ]] && TABLE+=(--budget-s "$TABLE_BUDGET")
  [[ -n "${TABLE_ROWS:-}" ]] && TABLE+=(--rows "$TABLE_ROWS")
  if [[ -z "${TORCHTITAN_SITE:-}" ]] && compgen -G "$ROOT/bench/wheels/torchtitan-*.whl" > /dev/null; then
    export TORCHTITAN_SITE="${TMPDIR:-/tmp}/torchtitan-site"  # the carried wheels (bench/torchtitan_deps.sh)
    PYTHON="$PY" bash "$ROOT/bench/torchtitan_deps.sh" install "$TORCHTITAN_SITE" "$ROOT/bench/wheels" || exit 2
  fi
  (cd "$ROOT" && PYTHONUNBUFFERED=1 "$PY" bench/gpu_table.py "${TABLE[@]}" --out "$OUT") 2>&1 | tee "$OUT/logs/table.log"
  exit "${PIPESTATUS[0]}"
fi

if ((DRY)); then
  NGPU=0
  "${REPORT[@]}" env --out "$OUT" --dry-run > /dev/null || exit 2
  STEPS="${STEPS:-8}"
  TIMEOUT="${CASE_TIMEOUT:-240}"
  MULTI=2
  # +debug=fast_gpt: synthetic data, d_model 64, 2 layers, batch 4 x 64, log every step, no sample, no weights
  COMMON=(+debug=fast_gpt device=cpu trainer.eval_every_n_steps=0 trainer.eval_samples=8)
  BF16=precision=auto          # bf16 where this CPU computes it natively, else fp32
  LLAMA=(model=llama_1b model.n_kv_head=1 model.d_ff=128)
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
else
  NGPU="$("${REPORT[@]}" env --out "$OUT")" || exit 2
  if ((NGPU < 1)); then
    echo "bench/gpu.sh: torch sees no CUDA GPU; run 'bench/gpu.sh --dry-run' to test this script on CPU" >&2
    exit 2
  fi
  STEPS="${STEPS:-20}"
  TIMEOUT="${CASE_TIMEOUT:-300}"
  MAX_NPROC="${MAX_NPROC:-8}"
  MULTI=$((NGPU < MAX_NPROC ? NGPU : MAX_NPROC))
  COMMON=(data=synthetic device=cuda data.seq_len=1024 data.batch_size=8 trainer.eval_every_n_steps=0
          trainer.eval_samples=8 trainer.log_every_n_steps=5 trainer.sample_tokens=0 trainer.save_weights=false
          trainer.progress_bar=false)
  BF16=precision=bf16
  LLAMA=(model=llama_1b data.seq_len=512 data.batch_size=2)
fi
HALF=$((STEPS / 2))
if ! [[ "$STEPS" =~ ^[0-9]+$ ]] || ((STEPS < 4)); then
  echo "bench/gpu.sh: STEPS=$STEPS: need at least 4 (the checkpoint cases save at STEPS/2 and resume to STEPS)" >&2
  exit 2
fi

selected() {  # is case $1 in $CASES (comma-separated; empty = all)?
  [[ -z "${CASES:-}" ]] && return 0
  [[ ",${CASES}," == *",$1,"* ]]
}

# run_case NAME RUN_DIR_NAME NPROC STEPS THIS_LAUNCH CHECK OVERRIDE...
#   STEPS: the step results.json must end at; THIS_LAUNCH: steps this launch must train; CHECK: none | fp16 (the
#   scaler skipped fewer than STEPS steps) | resume (keep the run dir's checkpoints: relaunch in it)
run_case() {
  local name=$1 run_dir="$OUT/runs/$2" nproc=$3 steps=$4 this_launch=$5 check=$6
  shift 6
  selected "$name" || return 0
  if [[ "$check" == resume ]]; then
    rm -f "$run_dir/results.json"  # judge this launch, not the one before
  else
    rm -rf "$run_dir"  # a fresh run dir: no checkpoint of an earlier bench/gpu.sh --out DIR to resume from
  fi
  local log="$OUT/logs/$name.log" cmd=("$PY")
  if ((nproc > 1)); then
    cmd+=(-m torch.distributed.run --standalone --nproc_per_node "$nproc")
  fi
  cmd+=("$ROOT/train.py" "${COMMON[@]}" "$@" "hydra.run.dir=$run_dir" ${EXTRA[@]+"${EXTRA[@]}"})
  echo "== $name: ${cmd[*]}"
  local t0=$SECONDS
  (cd "$ROOT" && HYDRA_FULL_ERROR=1 PYTHONUNBUFFERED=1 timeout --kill-after=30 "$TIMEOUT" "${cmd[@]}") > "$log" 2>&1
  local rc=$?
  "${REPORT[@]}" record --out "$OUT" --case "$name" --nproc "$nproc" --rc "$rc" --seconds $((SECONDS - t0)) \
    --run-dir "$run_dir" --log "$log" --steps "$steps" --this-launch "$this_launch" --check "$check" \
    -- "$@" ${EXTRA[@]+"${EXTRA[@]}"}
}

echo "bench/gpu.sh: $( ((DRY)) && echo "CPU dry run" || echo "$NGPU GPU(s)"), $STEPS steps per case, results in $OUT"
FSDP=(strategy=fsdp strategy.shard_on_one_rank=true "$BF16" model=gpt_small)
run_case fsdp_bf16 fsdp_bf16 1 "$STEPS" "$STEPS" none "${FSDP[@]}" trainer.max_steps="$STEPS"
run_case fp16_scaler fp16_scaler 1 "$STEPS" "$STEPS" fp16 strategy=fsdp strategy.shard_on_one_rank=true \
  precision=fp16 model=gpt_small \
  trainer.max_steps="$STEPS"
run_case cpu_offload cpu_offload 1 "$STEPS" "$STEPS" none "${FSDP[@]}" strategy.cpu_offload=true \
  trainer.max_steps="$STEPS"
run_case meta_llama_1b meta_llama_1b 1 "$HALF" "$HALF" none strategy=fsdp strategy.shard_on_one_rank=true "$BF16" \
  "${LLAMA[@]}" \
  trainer.max_steps="$HALF"
run_case compile compile 1 "$STEPS" "$STEPS" none "${FSDP[@]}" trainer.compile=true trainer.max_steps="$STEPS"
run_case ac ac 1 "$STEPS" "$STEPS" none "${FSDP[@]}" activation_checkpointing=true trainer.max_steps="$STEPS"
run_case compile_ac compile_ac 1 "$STEPS" "$STEPS" none "${FSDP[@]}" trainer.compile=true \
  activation_checkpointing=true trainer.max_steps="$STEPS"
run_case ckpt_save ckpt 1 "$HALF" "$HALF" none "${FSDP[@]}" checkpoint.every_n_steps="$HALF" \
  trainer.max_steps="$HALF"
run_case ckpt_resume ckpt 1 "$STEPS" "$((STEPS - HALF))" resume "${FSDP[@]}" checkpoint.every_n_steps="$HALF" \
  trainer.max_steps="$STEPS"
run_case adamw8bit adamw8bit 1 "$STEPS" "$STEPS" none "${FSDP[@]}" optim=adamw8bit trainer.max_steps="$STEPS"
if ((MULTI >= 2)); then
  run_case "fsdp_bf16_x$MULTI" "fsdp_bf16_x$MULTI" "$MULTI" "$STEPS" "$STEPS" none "${FSDP[@]}" \
    trainer.max_steps="$STEPS"
  run_case "ckpt_save_x$MULTI" "ckpt_x$MULTI" "$MULTI" "$HALF" "$HALF" none "${FSDP[@]}" \
    checkpoint.every_n_steps="$HALF" trainer.max_steps="$HALF"
  run_case "ckpt_resume_x$MULTI" "ckpt_x$MULTI" "$MULTI" "$STEPS" "$((STEPS - HALF))" resume "${FSDP[@]}" \
    checkpoint.every_n_steps="$HALF" trainer.max_steps="$STEPS"
  if ((MULTI % 2 == 0)); then
    run_case "hsdp_x$MULTI" "hsdp_x$MULTI" "$MULTI" "$STEPS" "$STEPS" none strategy=hsdp \
      strategy.shard_size="$((MULTI / 2))" "$BF16" model=gpt_small trainer.max_steps="$STEPS"
  fi
fi
VS_HAND=0
if selected vs_hand; then
  if ((DRY)); then
    VS=(--model gpt_tiny --batch 4 --seq 64 --steps 6 --warm 2 --rounds 1 --strategies single --device cpu)
  else
    # bf16 only: the overhead row (bf16 both sides) and the defaults row (hydratrain's defaults vs fp32 eager)
    VS=(--model gpt_small --batch 8 --seq 1024 --steps 30 --warm 10 --rounds 2 --device cuda --nproc "$MULTI"
        --precisions bf16)
    ((MULTI >= 2)) && VS+=(--strategies single,fsdp) || VS+=(--strategies single)
  fi
  echo "== vs_hand: $PY bench/overhead.py ${VS[*]}"
  (cd "$ROOT" && PYTHONUNBUFFERED=1 timeout --kill-after=30 $((TIMEOUT * 8)) "$PY" bench/overhead.py "${VS[@]}" \
    --out "$OUT/vs_hand") > "$OUT/logs/vs_hand.log" 2>&1
  VS_HAND=$?
  ((VS_HAND == 0)) && echo "PASS vs_hand (table in $OUT/vs_hand/results.md)" \
    || echo "FAIL vs_hand: exit status $VS_HAND (log $OUT/logs/vs_hand.log)"
fi
echo
"${REPORT[@]}" table --out "$OUT" --append "$OUT/vs_hand/results.md"
STATUS=$?
((VS_HAND == 0 && STATUS == 0))
