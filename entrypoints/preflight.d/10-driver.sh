# shellcheck shell=sh
# Driver check: the host driver must reach GPUFEED_MIN_DRIVER (exit 3 when older, 4 when no
# driver answers). Asks nvidia-smi once, bounded by a timeout; reads the kernel module's
# version file when nvidia-smi is missing or fails.

pf_nvidia_smi() {
    if command -v timeout >/dev/null 2>&1; then
        timeout "$pf_smi_wait" nvidia-smi --query-gpu=driver_version,name --format=csv,noheader
    else
        nvidia-smi --query-gpu=driver_version,name --format=csv,noheader
    fi
}

# Sets pf_drv (lowest driver of all GPUs), pf_drivers (distinct ones), pf_gpu_count,
# pf_gpu_names (one per line); pf_smi_problem says why when nothing came back.
pf_driver_from_smi() {
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        pf_smi_problem='nvidia-smi is not on PATH'
        return 1
    fi
    pf_smi_wait=${GPUFEED_NVIDIA_SMI_TIMEOUT:-10}
    pf_smi_out=$(pf_nvidia_smi 2>&1)
    pf_smi_rc=$?
    if [ "$pf_smi_rc" -eq 124 ]; then
        pf_smi_problem="nvidia-smi did not answer within ${pf_smi_wait}s"
        return 1
    elif [ "$pf_smi_rc" -ne 0 ]; then
        pf_smi_problem="nvidia-smi failed (exit $pf_smi_rc): $(printf '%s\n' "$pf_smi_out" | sed -n '/./{p;q;}')"
        return 1
    fi
    while IFS= read -r pf_line; do
        pf_v=${pf_line%%,*}
        pf_v=$(printf '%s' "$pf_v" | tr -d ' ')
        pf_is_version "$pf_v" || continue
        pf_name=${pf_line#*,}
        pf_name=${pf_name# }
        pf_gpu_count=$((pf_gpu_count + 1))
        pf_gpu_names="$pf_gpu_names$pf_name
"
        case " $pf_drivers " in
            *" $pf_v "*) ;;
            *) pf_drivers="${pf_drivers:+$pf_drivers }$pf_v" ;;
        esac
        if [ -z "$pf_drv" ] || pf_version_lt "$pf_v" "$pf_drv"; then
            pf_drv=$pf_v
        fi
    done <<PF_EOF
$pf_smi_out
PF_EOF
    if [ -z "$pf_drv" ]; then
        pf_smi_problem="nvidia-smi listed no GPU: $(printf '%s\n' "$pf_smi_out" | sed -n '/./{p;q;}')"
        return 1
    fi
}

pf_driver_from_proc() {
    pf_proc=${GPUFEED_PROC_DRIVER_VERSION:-/proc/driver/nvidia/version}
    if [ ! -r "$pf_proc" ]; then
        pf_proc_problem="$pf_proc does not exist"
        return 1
    fi
    pf_drv=$(awk '/NVRM version/ {
        for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+(\.[0-9]+)+$/) { print $i; exit }
    }' "$pf_proc")
    if [ -z "$pf_drv" ]; then
        pf_proc_problem="$pf_proc has no NVRM version line"
        return 1
    fi
}

# "2x NVIDIA H100 80GB HBM3" when all GPUs match, else the names joined by commas.
pf_gpu_list() {
    printf '%s' "$pf_gpu_names" | awk -v n="$pf_gpu_count" '
        NF { names[++k] = $0; if (!($0 in seen)) { seen[$0] = 1; u++ } }
        END {
            if (u == 1) { if (n > 1) printf "%dx ", n; print names[1]; exit }
            for (i = 1; i <= k; i++) printf "%s%s", (i > 1 ? ", " : ""), names[i]
            print ""
        }'
}

# "CUDA 12.8" from the CUDA_VERSION that nvidia/cuda images set; empty when unset.
pf_cuda_mm() {
    printf '%s' "${CUDA_VERSION:-}" | awk -F. 'NF >= 2 { print $1 "." $2; next } { print }'
}

pf_cuda_name() {
    pf_cuda=$(pf_cuda_mm)
    if [ -n "$pf_cuda" ]; then printf 'CUDA %s' "$pf_cuda"; else printf "this image's CUDA"; fi
}

pf_cuda_image() {
    pf_cuda=$(pf_cuda_mm)
    if [ -n "$pf_cuda" ]; then printf 'this CUDA %s image' "$pf_cuda"; else printf 'this image'; fi
}

pf_no_driver() {
    if pf_is_true "${GPUFEED_ALLOW_CPU:-}"; then
        pf_warn 'no NVIDIA driver answered; continuing without a GPU because GPUFEED_ALLOW_CPU=1' \
            "$pf_smi_problem" "$pf_proc_problem"
        pf_ok 'no GPU (GPUFEED_ALLOW_CPU=1)'
        return
    fi
    pf_fail 4 'no NVIDIA driver answered:' "$pf_smi_problem" "$pf_proc_problem" \
        'Expose the GPU to the container: docker run --gpus all ..., or in compose under the service: deploy.resources.reservations.devices: [{driver: nvidia, count: all, capabilities: [gpu]}]' \
        'The host needs a working NVIDIA driver (nvidia-smi answers on the host) and the NVIDIA Container Toolkit installed and configured (nvidia-ctk runtime configure --runtime=docker, then restart dockerd)' \
        'To run on the CPU on purpose, set GPUFEED_ALLOW_CPU=1'
}

pf_check_driver() {
    pf_drv='' pf_drivers='' pf_gpu_count=0 pf_gpu_names='' pf_smi_problem='' pf_proc_problem=''
    pf_drv_from=nvidia-smi
    if ! pf_driver_from_smi; then
        pf_driver_from_proc || { pf_no_driver; return; }
        pf_drv_from=$pf_proc
    fi

    if pf_version_lt "$pf_drv" "$GPUFEED_MIN_DRIVER"; then
        pf_fail 3 "NVIDIA driver $pf_drv is older than $GPUFEED_MIN_DRIVER, the minimum for $(pf_cuda_image); update the host driver or use an image built for an older CUDA"
        return
    fi
    case $pf_drivers in
        *' '*) pf_warn "the GPUs report different drivers ($(printf '%s' "$pf_drivers" | sed 's/ /, /g')); checked the lowest, $pf_drv" ;;
    esac
    if pf_version_lt "$pf_drv" "$GPUFEED_CUDA_FULL_DRIVER"; then
        pf_warn "NVIDIA driver $pf_drv is older than $GPUFEED_CUDA_FULL_DRIVER, which $(pf_cuda_name) needs for full support, so CUDA minor-version compatibility mode applies:" \
            'compiled GPU code runs, but PTX newer than the driver cannot be JIT-compiled (cudaErrorUnsupportedPtxVersion) and some newer APIs fail (cudaErrorCallRequiresNewerDriver)' \
            "Update the host driver to $GPUFEED_CUDA_FULL_DRIVER or newer for full support"
    fi
    if [ "$pf_drv_from" = nvidia-smi ]; then
        pf_s=s
        [ "$pf_gpu_count" -eq 1 ] && pf_s=''
        pf_ok "NVIDIA driver $pf_drv (minimum $GPUFEED_MIN_DRIVER), $pf_gpu_count GPU$pf_s: $(pf_gpu_list)"
    else
        pf_warn "$pf_smi_problem; read the driver version from $pf_proc instead, so no GPU was listed" \
            'If this container should see a GPU, start it with docker run --gpus all (compose: deploy.resources.reservations.devices) on a host with the NVIDIA Container Toolkit'
        pf_ok "NVIDIA driver $pf_drv (minimum $GPUFEED_MIN_DRIVER, from $pf_proc), GPUs not listed"
    fi
}

pf_check_driver
