# shellcheck shell=sh
# /dev/shm check (warning only): DataLoader workers hand batches to the main process through
# shared memory, and Docker's default of 64 MiB makes them die with "bus error". The floor
# and the fix come from the thresholds file (GPUFEED_MIN_SHM_MB, GPUFEED_SHM_FIX); the rule
# for a loader's own batches is gpufeed.system.shm.

pf_check_shm() {
    pf_shm=${GPUFEED_SHM_PATH:-/dev/shm}
    if [ ! -d "$pf_shm" ]; then
        pf_warn "$pf_shm does not exist, so DataLoader workers (num_workers > 0) cannot share batches" \
            ${GPUFEED_SHM_FIX:+"$GPUFEED_SHM_FIX"}
        return
    fi
    pf_shm_kb=$(df -Pk "$pf_shm" 2>/dev/null | awk 'NR == 2 { print $2 }')
    case $pf_shm_kb in
        '' | *[!0-9]*)
            pf_warn "could not measure $pf_shm with df -Pk; it should hold at least $GPUFEED_MIN_SHM_MB MiB"
            return
            ;;
    esac
    pf_shm_mb=$((pf_shm_kb / 1024))
    if [ "$pf_shm_mb" -lt "$GPUFEED_MIN_SHM_MB" ]; then
        pf_warn "$pf_shm is $pf_shm_mb MiB, less than $GPUFEED_MIN_SHM_MB MiB (GPUFEED_MIN_SHM_MB); DataLoader workers fail with \"bus error\" or \"No space left on device\" when it fills" \
            ${GPUFEED_SHM_FIX:+"$GPUFEED_SHM_FIX"}
        return
    fi
    pf_ok "$pf_shm $pf_shm_mb MiB"
}

pf_check_shm
