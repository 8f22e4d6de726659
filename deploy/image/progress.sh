#!/usr/bin/env bash
# Step progress for deploy/image/build.sh (sourced), on a terminal only:
#
#   [2/5] wheels — 41 s elapsed, ETA ~1 min 10 s (from the last run's timings)
#
# Quiet (prints nothing) when stderr is not a terminal or CI is set; CTXMEM_PROGRESS=0
# or 1 overrides. The timings of each step are kept in a file (one "STEP SECONDS" line
# per step), rewritten at the end of every run, so the next run's ETA is the sum of the
# last run's times for the steps still to come.
#
#   progress_init TIMINGS_FILE STEP...   the steps, in order
#   progress_step STEP                   STEP starts (the previous one ends)
#   progress_finish                      the last step ends; the timings file is written

_progress_on() {
  case "${CTXMEM_PROGRESS:-}" in 1) return 0 ;; 0) return 1 ;; esac
  [ -z "${CI:-}" ] && [ -t 2 ]
}

_progress_fmt() {  # SECONDS -> "1 min 5 s" / "40 s"
  if [ "$1" -ge 60 ]; then printf '%d min %d s' $(($1 / 60)) $(($1 % 60)); else printf '%d s' "$1"; fi
}

progress_init() {
  PROGRESS_FILE=$1; shift
  PROGRESS_STEPS=("$@")
  PROGRESS_T0=$(date +%s)
  PROGRESS_CUR=""
  PROGRESS_CUR_T0=0
  declare -gA PROGRESS_LAST=() PROGRESS_NOW=()
  local step secs
  if [ -f "$PROGRESS_FILE" ]; then
    while read -r step secs; do
      [[ "$secs" =~ ^[0-9]+$ ]] && PROGRESS_LAST[$step]=$secs
    done < "$PROGRESS_FILE"
  fi
}

_progress_end_current() {
  [ -n "$PROGRESS_CUR" ] || return 0
  PROGRESS_NOW[$PROGRESS_CUR]=$(( $(date +%s) - PROGRESS_CUR_T0 ))
}

progress_step() {
  _progress_end_current
  PROGRESS_CUR=$1
  PROGRESS_CUR_T0=$(date +%s)
  _progress_on || return 0
  local i n=${#PROGRESS_STEPS[@]} idx=0 eta=0 known=1 s
  for i in "${!PROGRESS_STEPS[@]}"; do
    s=${PROGRESS_STEPS[$i]}
    [ "$s" = "$1" ] && idx=$((i + 1))
    if [ "$idx" -gt 0 ]; then
      if [ -n "${PROGRESS_LAST[$s]:-}" ]; then eta=$((eta + PROGRESS_LAST[$s])); else known=0; fi
    fi
  done
  local msg
  msg="[$idx/$n] $1 — $(_progress_fmt $(( $(date +%s) - PROGRESS_T0 ))) elapsed"
  if [ "$known" -eq 1 ]; then
    msg+=", ETA ~$(_progress_fmt "$eta") (from the last run's timings)"
  else
    msg+=", no ETA yet (no timings from a previous run)"
  fi
  printf '%s\n' "$msg" >&2
}

progress_finish() {
  _progress_end_current
  PROGRESS_CUR=""
  local s tmp
  mkdir -p "$(dirname "$PROGRESS_FILE")"
  tmp="$PROGRESS_FILE.$$"
  : > "$tmp"
  for s in "${PROGRESS_STEPS[@]}"; do
    [ -n "${PROGRESS_NOW[$s]:-}" ] && echo "$s ${PROGRESS_NOW[$s]}" >> "$tmp"
  done
  mv "$tmp" "$PROGRESS_FILE"
  if _progress_on; then
    printf '[%d/%d] done in %s\n' "${#PROGRESS_STEPS[@]}" "${#PROGRESS_STEPS[@]}" \
      "$(_progress_fmt $(( $(date +%s) - PROGRESS_T0 )))" >&2
  fi
}
