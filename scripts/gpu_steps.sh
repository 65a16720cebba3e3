# The step runner of the one-call device scripts (scripts/gpu_fp8.sh, gpu_pending.sh, gpu_train_small.sh), sourced
# after they set OUT, STEPS and cd to the repo root:
#   check_steps SCRIPT "NAME ..."   exits 2 naming a word of $STEPS that is not a step (a misspelt name would
#                                   otherwise run nothing and say nothing)
#   step NAME SECONDS COMMAND...    runs COMMAND (skipped unless NAME is in $STEPS) with its own time limit and
#                                   log $OUT/NAME.log, and appends "NAME rc=.. seconds=.." to $OUT/summary.txt, so
#                                   a step that hangs or fails costs only its own slot; a shell function (which
#                                   timeout(1) cannot run) is called directly and keeps its own limit

check_steps() {
  local script=$1 all=$2 name
  for name in $STEPS; do
    case " $all " in *" $name "*) ;;
      *) echo "$script: unknown step '$name' in STEPS" >&2; exit 2 ;; esac
  done
}

step() {
  local name=$1 limit=$2
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local start=$SECONDS rc
  if declare -F "$1" > /dev/null; then
    "$@" > "$OUT/$name.log" 2>&1
  else
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  fi
  rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - start))" | tee -a "$OUT/summary.txt"
}
