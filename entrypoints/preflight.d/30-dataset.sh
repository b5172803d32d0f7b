# shellcheck shell=sh
# Dataset mount check (warning only): the dataset is bind-mounted read-only at
# GPUFEED_DATA_DIR (default /data); a notebook can still start without it.

pf_data_hint() {
    printf '%s' "mount it: DATASET_DIR=/path/to/dataset docker compose up, or docker run -v /path/to/dataset:$pf_data:ro"
}

pf_dir_is_empty() {
    for pf_entry in "$1"/* "$1"/.[!.]* "$1"/..?*; do
        if [ -e "$pf_entry" ] || [ -L "$pf_entry" ]; then
            return 1
        fi
    done
}

pf_check_dataset() {
    pf_data=${GPUFEED_DATA_DIR:-/data}
    if [ ! -e "$pf_data" ]; then
        pf_warn "dataset directory $pf_data does not exist; $(pf_data_hint)"
    elif [ ! -d "$pf_data" ]; then
        pf_warn "dataset path $pf_data is not a directory; $(pf_data_hint)"
    elif [ ! -r "$pf_data" ] || [ ! -x "$pf_data" ]; then
        pf_warn "dataset directory $pf_data is not readable by uid $(id -u); make it readable" \
            "on the host (chmod -R a+rX) or run the container as its owner (docker run --user)"
    elif pf_dir_is_empty "$pf_data"; then
        # Docker creates a missing bind-mount source as an empty directory.
        pf_warn "dataset directory $pf_data is empty; check the host path, then $(pf_data_hint)"
    else
        pf_ok "dataset $pf_data readable"
    fi
}

pf_check_dataset
