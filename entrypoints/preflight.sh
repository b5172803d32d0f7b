#!/bin/sh
# gpufeed preflight: checks the host before a container's service starts.
#
# Usage: preflight.sh            (no arguments; every container runs it, and so can you)
#
# The checks are the numbered files in the checks folder (preflight.d/NN-name.sh), sourced
# in order, so a new check is a new file. They share the helpers below: pf_ok (a fragment
# of the one-line OK summary), pf_warn (never changes the exit status), pf_fail (records
# an exit status; later checks still run so every problem shows in one start).
#
# Exit status
#   0  all checks passed, possibly with warnings (or GPUFEED_SKIP_PREFLIGHT=1)
#   2  preflight itself is misconfigured: arguments given, checks folder missing,
#      thresholds missing or not a version/number
#   3  NVIDIA driver older than GPUFEED_MIN_DRIVER (GPUFEED_ALLOW_CPU=1 does not excuse it)
#   4  no NVIDIA driver answered and GPUFEED_ALLOW_CPU is not 1
#
# Settings (environment wins over the thresholds file; see pf_load_thresholds)
#   GPUFEED_THRESHOLDS        thresholds file (default /etc/gpufeed/thresholds.env, the file
#                             of the image's CUDA major; in a checkout of the repository
#                             app/src/gpufeed/system/thresholds-cuda12.env beside this script)
#   GPUFEED_MIN_DRIVER, GPUFEED_CUDA_FULL_DRIVER, GPUFEED_MIN_SHM_MB, GPUFEED_SHM_FIX
#                             the thresholds, to override the file's (the image sets none)
#   GPUFEED_PREFLIGHT_D       checks folder (default: preflight.d beside this script, then
#                             ../lib/gpufeed/preflight.d for an install in /usr/local/bin)
#   GPUFEED_ALLOW_CPU=1       no driver is a warning, not an error
#   GPUFEED_SKIP_PREFLIGHT=1  skip every check (one warning line)
#   GPUFEED_PREFLIGHT_QUIET=1 no OK line; warnings and errors still print
#   GPUFEED_NVIDIA_SMI_TIMEOUT  seconds nvidia-smi may take (default 10)
#   GPUFEED_PROC_DRIVER_VERSION, GPUFEED_SHM_PATH, GPUFEED_DATA_DIR  paths the checks read
#
# Sourcing this file with "--lib" as its first argument only defines the helpers
# (set -- --lib; . preflight.sh), which is how the tests reach pf_version_cmp.

set -u

PF_PREFIX='gpufeed preflight:'
pf_status=0
pf_warnings=0
pf_summary=''

pf_is_true() {
    case ${1:-} in
        1 | [Tt]rue | [Yy]es | [Oo]n) return 0 ;;
        *) return 1 ;;
    esac
}

# pf_say LEVEL LINE [MORE_LINES...]: every line carries the prefix, so a mixed container
# log still tells where it came from.
pf_say() {
    pf_level=$1
    shift
    printf '%s %s%s\n' "$PF_PREFIX" "$pf_level" "$1" >&2
    shift
    for pf_say_line in "$@"; do
        printf '%s   %s\n' "$PF_PREFIX" "$pf_say_line" >&2
    done
}

pf_warn() {
    pf_warnings=$((pf_warnings + 1))
    pf_say 'warning: ' "$@"
}

# pf_fail CODE LINE [MORE_LINES...]: the first failure decides the exit status.
pf_fail() {
    pf_code=$1
    shift
    [ "$pf_status" -eq 0 ] && pf_status=$pf_code
    pf_say 'error: ' "$@"
}

pf_ok() {
    if [ -n "$pf_summary" ]; then
        pf_summary="$pf_summary; $1"
    else
        pf_summary=$1
    fi
}

pf_is_version() {
    case ${1:-} in
        '' | .* | *. | *..* | *[!0-9.]*) return 1 ;;
        *) return 0 ;;
    esac
}

# pf_version_cmp A B: prints -1, 0 or 1 as A is older than, equal to or newer than B.
# Every dot-separated field compares as a number, a missing field counts as 0
# (524.99 < 525 = 525.0 < 525.60.2 < 525.60.13 < 535.1). Status 2 when either is not a version.
pf_version_cmp() {
    pf_is_version "${1:-}" && pf_is_version "${2:-}" || return 2
    awk -v a="$1" -v b="$2" 'BEGIN {
        na = split(a, x, "."); nb = split(b, y, ".")
        n = (na > nb) ? na : nb
        for (i = 1; i <= n; i++) {
            p = (i <= na) ? x[i] + 0 : 0
            q = (i <= nb) ? y[i] + 0 : 0
            if (p < q) { print -1; exit }
            if (p > q) { print 1; exit }
        }
        print 0
    }'
}

# pf_version_lt A B: true when A is older than B.
pf_version_lt() {
    [ "$(pf_version_cmp "$1" "$2")" = "-1" ]
}

pf_script_dir() {
    pf_self=$0
    if command -v readlink >/dev/null 2>&1; then
        pf_self=$(readlink -f -- "$0" 2>/dev/null) || pf_self=$0
    fi
    CDPATH='' cd -P -- "$(dirname -- "$pf_self")" 2>/dev/null && pwd -P
}

pf_trim() {
    pf_t=${1#"${1%%[! 	]*}"}
    printf '%s' "${pf_t%"${pf_t##*[! 	]}"}"
}

pf_unquote() {
    case $1 in
        \"*\" | \'*\') pf_t=${1#?} && printf '%s' "${pf_t%?}" ;;
        *) printf '%s' "$1" ;;
    esac
}

# pf_load_thresholds DIR: sets each GPUFEED_* key of the thresholds file that the
# environment leaves unset or empty (the file is parsed, not sourced: it runs no code), then
# GPUFEED_CUDA_FULL_DRIVER, when neither sets it, from the file's table row of its
# GPUFEED_CUDA_RELEASE; gpufeed.system.thresholds.load reads it the same way.
pf_load_thresholds() {
    if [ -n "${GPUFEED_THRESHOLDS:-}" ]; then
        pf_file=$GPUFEED_THRESHOLDS
        if [ ! -r "$pf_file" ]; then
            pf_fail 2 "GPUFEED_THRESHOLDS=$pf_file is not a readable file"
            return
        fi
    else
        pf_file=/etc/gpufeed/thresholds.env
        # in a checkout: the default variant's (gpufeed.system.thresholds.DEFAULT_CUDA_MAJOR)
        [ -r "$pf_file" ] || pf_file="$1/../app/src/gpufeed/system/thresholds-cuda12.env"
        [ -r "$pf_file" ] || pf_file=''
    fi
    if [ -n "$pf_file" ]; then
        # Same syntax as gpufeed.thresholds: [export ]KEY=VALUE, optionally quoted, # comments.
        while IFS= read -r pf_line || [ -n "$pf_line" ]; do
            pf_line=$(pf_trim "$pf_line")
            pf_line=${pf_line#export }
            case $pf_line in
                GPUFEED_*=*) ;;
                *) continue ;;
            esac
            pf_key=${pf_line%%=*}
            pf_value=$(pf_unquote "$(pf_trim "${pf_line#*=}")")
            case $pf_key in
                *[!A-Z0-9_]*) continue ;;
            esac
            eval "pf_current=\${$pf_key:-}"
            [ -n "$pf_current" ] || eval "$pf_key=\$pf_value"
        done <"$pf_file"
    fi
    pf_full_driver_from_table
    for pf_key in GPUFEED_MIN_DRIVER GPUFEED_CUDA_FULL_DRIVER GPUFEED_MIN_SHM_MB; do
        eval "pf_value=\${$pf_key:-}"
        if [ -z "$pf_value" ]; then
            pf_fail 2 "$pf_key is not set: neither the environment nor a thresholds file" \
                "(GPUFEED_THRESHOLDS, /etc/gpufeed/thresholds.env) gives it"
        elif ! pf_is_version "$pf_value"; then
            pf_fail 2 "$pf_key=$pf_value is not a number or dotted version"
        fi
    done
    case ${GPUFEED_MIN_SHM_MB:-0} in
        *.*) pf_fail 2 "GPUFEED_MIN_SHM_MB=$GPUFEED_MIN_SHM_MB must be a whole number of MiB" ;;
    esac
}

# pf_full_driver_from_table: GPUFEED_CUDA_FULL_DRIVER, unless set, is the table row
# GPUFEED_CUDA_<major>_<minor>_FULL_DRIVER of GPUFEED_CUDA_RELEASE (both from the file).
pf_full_driver_from_table() {
    [ -z "${GPUFEED_CUDA_FULL_DRIVER:-}" ] && pf_is_version "${GPUFEED_CUDA_RELEASE:-}" || return 0
    pf_key=GPUFEED_CUDA_$(printf '%s' "$GPUFEED_CUDA_RELEASE" | tr . _)_FULL_DRIVER
    eval "GPUFEED_CUDA_FULL_DRIVER=\${$pf_key:-}"
}

pf_checks_dir() {
    if [ -n "${GPUFEED_PREFLIGHT_D:-}" ]; then
        printf '%s\n' "$GPUFEED_PREFLIGHT_D"
    elif [ -d "$1/preflight.d" ]; then
        printf '%s\n' "$1/preflight.d"
    else
        printf '%s\n' "$1/../lib/gpufeed/preflight.d"
    fi
}

pf_main() {
    if [ "$#" -gt 0 ]; then
        pf_say 'error: ' "takes no arguments (got: $*); settings come from GPUFEED_* variables"
        return 2
    fi
    if pf_is_true "${GPUFEED_SKIP_PREFLIGHT:-}"; then
        pf_say 'warning: ' 'skipped (GPUFEED_SKIP_PREFLIGHT=1): driver, GPU, /dev/shm and dataset were not checked'
        return 0
    fi
    pf_dir=$(pf_script_dir) || pf_dir=.
    pf_load_thresholds "$pf_dir"
    [ "$pf_status" -eq 0 ] || return "$pf_status"

    pf_checks=$(pf_checks_dir "$pf_dir")
    if [ ! -d "$pf_checks" ]; then
        pf_fail 2 "checks folder $pf_checks not found; set GPUFEED_PREFLIGHT_D"
        return "$pf_status"
    fi
    pf_ran=0
    for pf_check in "$pf_checks"/[0-9]*.sh; do
        [ -f "$pf_check" ] || continue
        pf_ran=$((pf_ran + 1))
        # shellcheck source=/dev/null
        . "$pf_check"
    done
    [ "$pf_ran" -gt 0 ] || pf_warn "no checks found in $pf_checks"

    if [ "$pf_status" -eq 0 ] && ! pf_is_true "${GPUFEED_PREFLIGHT_QUIET:-}"; then
        pf_tail=''
        [ "$pf_warnings" -eq 0 ] || pf_tail=" ($pf_warnings warning(s) above)"
        printf '%s OK: %s%s\n' "$PF_PREFIX" "${pf_summary:-no checks ran}" "$pf_tail" >&2
    fi
    return "$pf_status"
}

if [ "${1:-}" = "--lib" ]; then
    shift
else
    pf_main "$@"
    exit $?
fi
