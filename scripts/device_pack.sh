#!/bin/bash
# Packs what a GPU machine without a package registry needs to build and test
# kvlab, here, before a session's few device calls (docs/cuda.md, "On a lent
# GPU machine"):
#
#   scripts/device_pack.sh [--dry-run] [--no-fmnist]
#
# - .device/deps.tar.xz: the Debian packages of scripts/deps.sh and the
#   libraries they need, unpacked and re-packed without static libraries and
#   documentation (about 20 MB; 50 MB with Fashion-MNIST's 31 MB of images,
#   which --no-fmnist leaves out: the ViT comparison then says it skipped).
#   Left out: what any machine with a CUDA toolkit has (the C library and
#   compilers, Python, Perl, dpkg), and the packages listed in EXCLUDE below.
#   scripts/device_check.sh unpacks it over / without replacing any file
#   that is already there, so the image's own libraries stay as they are.
# - data/: the data sets the tests read (scripts/get_data.sh, from the mirror).
#
# Then every device call names both in its carry list:
#   carry: [".device", "data"]
#   command: scripts/device_check.sh [STEP...]
# --dry-run prints the package list and changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
FMNIST=1
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1; shift ;;
        --no-fmnist) FMNIST=0; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $1 (hint: scripts/device_pack.sh --help)" >&2; exit 2 ;;
    esac
done

for tool in apt-cache apt-get dpkg-deb xz; do
    command -v "$tool" >/dev/null || { echo "error: $tool is missing (hint: run this on a Debian or Ubuntu machine with apt)" >&2; exit 1; }
done

# Present on every machine that has a CUDA toolkit and Python (the device image: Ubuntu with gcc, nvcc, a
# Python with PyTorch): the C and C++ runtimes and toolchains, Python, Perl, packaging and login tools.
EXCLUDE='^(libc6|libc6-dev|libc-dev-bin|linux-libc-dev|libcrypt1|libcrypt-dev|libgcc-s1|libgcc-[0-9]+-dev|gcc|gcc-[0-9]+|gcc-[0-9]+-base|cpp|cpp-[0-9]+|libstdc\+\+6|libstdc\+\+-[0-9]+-dev|binutils.*|libbinutils|libctf.*|libgprofng0|libasan[0-9]|liblsan0|libtsan[0-9]|libubsan1|libitm1|libatomic1|libquadmath0|libcc1-0|libisl23|libmpc3|libmpfr6|libgmp10|gfortran.*|libgfortran-[0-9]+-dev|flang-.*|libflang-.*|libllvm.*|libclang-.*|libmlir-.*|libz3-4|perl|perl-base|perl-modules-.*|libperl.*|python3|python3\.[0-9]+.*|libpython3.*|python3-numpy|python3-matplotlib|dpkg|debconf|cdebconf|debianutils|tar|passwd|adduser|install-info|libpam.*|libaudit.*|libselinux1|libsemanage.*|libsepol2|libcap-ng0|libdb5\.3|libgdbm.*|libtinfo6|libncursesw6|libreadline8|readline-common|libsqlite3-0|libexpat1|libffi8|liblzma5|libbz2-1\.0|libzstd1|zlib1g|libuuid1|libmd0|libbsd0|libpcre2-8-0|libdebian-installer4|libnewt0\.52|libslang2|libtextwrap1|autoconf|automake|autotools-dev|m4|openssh-client|libedit2|libfido2-1|libcbor0\.8|libx11-.*|libxau6|libxcb1|libxdmcp6|libxext6|libxnvctrl0|libjs-.*|mailcap|media-types|mime-support|libicu[0-9]+|libxml2|libssl3|libudev1|curl|ca-certificates|openssl)$'

mapfile -t top < <(scripts/deps.sh --list)
# numpy and matplotlib come from the image's Python (device_check.sh finds them); curl is for downloads,
# and the device reaches no network
mapfile -t top < <(printf '%s\n' "${top[@]}" | grep -v -E '^(python3-numpy|python3-matplotlib|curl|ca-certificates)$')
[ "$FMNIST" = 1 ] || mapfile -t top < <(printf '%s\n' "${top[@]}" | grep -v -x dataset-fashion-mnist)
mapfile -t pkgs < <(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances --no-pre-depends "${top[@]}" | grep -v '^[ <]' | sort -u | grep -v -E "$EXCLUDE")
all=$(printf '%s\n' "${pkgs[@]}")
for p in "${top[@]}"; do
    grep -q -x -F -- "$p" <<< "$all" ||
        { echo "error: package $p of scripts/deps.sh is unknown to apt (hint: apt-get update)" >&2; exit 1; }
done
if [ "$DRY" = 1 ]; then
    printf '%s\n' "${pkgs[@]}"
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "device_pack: downloading ${#pkgs[@]} packages"
# (as root apt may say it downloads unsandboxed: harmless, not shown)
(cd "$work" && apt-get download -q "${pkgs[@]}" 2>&1 >/dev/null | grep -v 'unsandboxed' >&2 || true)
n=$(ls "$work"/*.deb | wc -l)
[ "$n" -eq ${#pkgs[@]} ] || { echo "error: apt-get download got $n of ${#pkgs[@]} packages (hint: apt-get update, and check the network)" >&2; exit 1; }
mkdir -p "$work/root"
for f in "$work"/*.deb; do dpkg-deb -x "$f" "$work/root"; done
find "$work/root" -name '*.a' -delete
rm -rf "$work/root/usr/share/"{doc,man,info,locale,lintian}
# The links update-alternatives makes when a package is installed (dpkg-deb -x runs no maintainer script):
# mpirun, mpicc (which the MPI build asks for its flags), libblas.so.3, ... to files the pack holds.
links=$(for f in "$work"/*.deb; do dpkg-deb -I "$f" postinst 2>/dev/null || true; done | /usr/bin/python3 -c '
import os, re, sys
root, made = sys.argv[1], 0
for cmd in re.findall(r"update-alternatives\s+(.*)", sys.stdin.read().replace("\\\n", " ")):
    words, i = cmd.split(), 0
    while i < len(words):
        n = {"--install": 4, "--slave": 3}.get(words[i], 0)
        if not n or i + n >= len(words):
            i += 1
            continue
        link, path, i = words[i + 1], words[i + 3], i + n + 1
        if link.startswith("/") and os.path.lexists(root + path) and not os.path.lexists(root + link):
            os.makedirs(os.path.dirname(root + link), exist_ok=True)
            os.symlink(path, root + link)
            made += 1
print(made)
' "$work/root")
mkdir -p .device
printf '%s\n' "${pkgs[@]}" > .device/packages.txt
tar -C "$work/root" -cf - . | xz -T0 -6 > .device/deps.tar.xz.part
mv .device/deps.tar.xz.part .device/deps.tar.xz
echo "device_pack: .device/deps.tar.xz $(du -h .device/deps.tar.xz | cut -f1) (${#pkgs[@]} packages, .device/packages.txt; $links links of update-alternatives)"

scripts/get_data.sh tinyshakespeare gpt2-bpe mnist-test multi30k
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
carried=$(du -scb .device data | tail -1 | cut -f1)
total=$((tree + carried))
echo "device_pack: a device call with carry [\".device\", \"data\"] sends $((total / 1048576)) MiB (the limit is 64)"
[ "$total" -le $((64 * 1048576)) ] ||
    { echo "error: that is over the device tool's 64 MiB (hint: scripts/device_pack.sh --no-fmnist)" >&2; exit 1; }
