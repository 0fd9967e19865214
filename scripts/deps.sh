#!/bin/bash
# Makes sure the Debian packages kvlab needs are installed. As root (CI, a
# fresh machine) it installs what is missing; otherwise it stops and prints
# the exact command to run. Called by make before anything that needs them.
# scripts/deps.sh --list prints the packages, one per line, and installs
# nothing (scripts/device_pack.sh reads it).
set -euo pipefail

PACKAGES=(
    python3-kconfiglib      # Kconfig: menuconfig, defconfigs, autoconf.h
    libopenblas-openmp-dev  # sgemm; the OpenMP build shares our thread pool
    libcjson-dev            # safetensors headers, metrics, configs
    libcurl4-openssl-dev    # Weights & Biases uploads (wandb/)
    libunistring-dev        # Unicode classes for the GPT-2 BPE pre-tokeniser
    zlib1g-dev              # gzip-compressed IDX image files
    libopenmpi-dev          # MPI data parallel (train/dist_mpi.c, Kconfig "Distributed")
    openmpi-bin             # mpirun, which make uses to launch a distributed step
    dataset-fashion-mnist   # Fashion-MNIST for the ViT family (/usr/share/datasets/fashion-mnist)
    python3-matplotlib      # training-curve plots
    python3-numpy           # independent checks in the tests
    curl                    # data downloads when no local mirror exists
    ca-certificates
)
if [ "${1:-}" = "--list" ]; then
    printf '%s\n' "${PACKAGES[@]}"
    exit 0
fi
# KVLAB_DEPS=skip: the packages are there but not through dpkg (unpacked .debs on a machine without a package
# registry, a module system); the build then finds out for itself if one is missing.
[ "${KVLAB_DEPS:-}" = "skip" ] && exit 0

missing=()
for p in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed"; then
        missing+=("$p")
    fi
done
# the tools the build runs itself: not in --list (every machine with a CUDA toolkit has them, so
# scripts/device_pack.sh leaves them out), but a fresh Debian may lack them
for tool in gcc g++ make; do command -v "$tool" >/dev/null || { missing+=(build-essential); break; }; done
command -v python3 >/dev/null || missing+=(python3)
[ ${#missing[@]} -eq 0 ] && exit 0

echo "kvlab: installing missing Debian packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo)
else
    echo "error: missing Debian packages: ${missing[*]} (hint: run: sudo apt-get update && sudo apt-get install -y ${missing[*]})" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "kvlab: installed ${missing[*]}"
