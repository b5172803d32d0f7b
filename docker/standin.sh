#!/bin/sh
# Build a stand-in for the nvidia/cuda base image where no registry can be reached (CI here):
# a minimal Debian rootfs imported with the environment nvidia/cuda images set, so the real
# Dockerfile builds unchanged with BASE_IMAGE pointing at it. Usage: standin.sh IMAGE:TAG
set -eu

image=${1:?usage: standin.sh IMAGE:TAG}
suite=${STANDIN_SUITE:-bookworm}
cuda_version=${STANDIN_CUDA_VERSION:-12.8.1}
# The value nvidia/cuda:12.8.1 images carry; the Dockerfile must replace it (tested).
require_cuda='cuda>=12.8 brand=unknown,driver>=470,driver<471 brand=grid,driver>=470,driver<471 brand=tesla,driver>=470,driver<471 brand=nvidia,driver>=470,driver<471 brand=quadro,driver>=470,driver<471 brand=quadrortx,driver>=470,driver<471 brand=nvidiartx,driver>=470,driver<471 brand=vapps,driver>=470,driver<471 brand=vpc,driver>=470,driver<471 brand=vcs,driver>=470,driver<471 brand=vws,driver>=470,driver<471 brand=cloudgaming,driver>=470,driver<471 brand=unknown,driver>=535,driver<536 brand=grid,driver>=535,driver<536 brand=tesla,driver>=535,driver<536 brand=nvidia,driver>=535,driver<536 brand=quadro,driver>=535,driver<536 brand=quadrortx,driver>=535,driver<536 brand=nvidiartx,driver>=535,driver<536 brand=vapps,driver>=535,driver<536 brand=vpc,driver>=535,driver<536 brand=vcs,driver>=535,driver<536 brand=vws,driver>=535,driver<536 brand=cloudgaming,driver>=535,driver<536'

if docker image inspect "$image" >/dev/null 2>&1; then
    echo "standin: $image exists" >&2
    exit 0
fi
command -v mmdebstrap >/dev/null 2>&1 || {
    echo "standin: mmdebstrap is missing: apt-get install mmdebstrap (or run .ci/setup-docker.sh)" >&2
    exit 1
}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mmdebstrap --quiet --variant=minbase --include=ca-certificates "$suite" "$tmp/rootfs.tar"
docker import \
    --change "ENV PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64" \
    --change "ENV NVIDIA_VISIBLE_DEVICES=all" \
    --change "ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility" \
    --change "ENV NVIDIA_REQUIRE_CUDA=\"$require_cuda\"" \
    --change "ENV CUDA_VERSION=$cuda_version" \
    --change "LABEL io.gpufeed.standin=true" \
    --change 'CMD ["bash"]' \
    "$tmp/rootfs.tar" "$image" >/dev/null
echo "standin: built $image from Debian $suite" >&2
