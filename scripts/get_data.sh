#!/bin/bash
# Fetches and verifies kvlab's data sets.
#
#   scripts/get_data.sh [--mirror DIR] [--data DIR] [--tokenizer BIN] NAME...
#
# NAME: tinyshakespeare, gpt2-bpe, tinyshakespeare-bpe (GPT-2 BPE token shards
# of tiny Shakespeare, made with the C tokenizer given by --tokenizer), mnist
# (mnist-test: its test set only), multi30k, cifar10, cifar100. (Fashion-MNIST
# is Debian's dataset-fashion-mnist.)
# Each file is taken from the mirror folder (--mirror, else $KVLAB_DATA_MIRROR,
# else ../shared/data when it exists; --mirror "" downloads) or downloaded from
# its canonical public URL; its size (and md5 where copies are byte-identical)
# is checked either way, and it is moved into place only when it matches.
# Paths given in options or $KVLAB_DATA_MIRROR are the caller's (relative to where it runs); the defaults (data,
# ../shared/data) the repository's.
set -euo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
callers() { case "$1" in "" | /*) printf '%s' "$1" ;; *) printf '%s/%s' "$CALLER" "$1" ;; esac; }

DATA=data
MIRROR="$(callers "${KVLAB_DATA_MIRROR:-}")"
[ -z "$MIRROR" ] && [ -d ../shared/data ] && MIRROR=../shared/data
TOKENIZER=""
names=()
while [ $# -gt 0 ]; do
    case "$1" in
        --mirror | --data | --tokenizer)
            if [ $# -lt 2 ]; then
                echo "error: $1 needs a value (hint: $1 DIR, or --mirror \"\" to download; scripts/get_data.sh --help)" >&2
                exit 2
            fi ;;&
        --mirror) MIRROR="$(callers "$2")"; shift 2 ;;
        --data) DATA="$(callers "$2")"; shift 2 ;;
        --tokenizer) TOKENIZER="$(callers "$2")"; shift 2 ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        -*) echo "error: unknown option $1 (hint: scripts/get_data.sh --help)" >&2; exit 2 ;;
        *) names+=("$1"); shift ;;
    esac
done
KNOWN="tinyshakespeare gpt2-bpe tinyshakespeare-bpe mnist mnist-test multi30k cifar10 cifar100"
for name in "${names[@]+"${names[@]}"}"; do # all names checked before anything is fetched
    case " $KNOWN " in
        *" $name "*) ;;
        *) echo "error: unknown data set '$name' (hint: ${KNOWN// /, })" >&2; exit 2 ;;
    esac
done
if [ -n "$MIRROR" ] && [ ! -d "$MIRROR" ]; then
    echo "error: the data mirror $MIRROR is not a folder (hint: pass --mirror with an existing folder, or --mirror \"\" to download)" >&2
    exit 2
fi

# path | size | md5 | canonical URL
FILES_tinyshakespeare=(
    "tinyshakespeare/input.txt|1115394|6fb458f1232090904fb40fe944165e91|https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
FILES_gpt2_bpe=(
    "gpt2-bpe/encoder.json|1042301|dffec25a898b1f5e569bec4dffd7e5c0|https://openaipublic.blob.core.windows.net/gpt-2/models/124M/encoder.json"
    "gpt2-bpe/vocab.bpe|456318|75a37753dd7a28a2c5df80c28bf06e4e|https://openaipublic.blob.core.windows.net/gpt-2/models/124M/vocab.bpe"
)

# MNIST files are checked by their size after decompression (copies are
# re-gzipped, so the .gz bytes differ between sources); kvlab's IDX loader
# then checks magic, dimensions and labels.
FILES_mnist_test=(
    "mnist/t10k-images-idx3-ubyte.gz|gz:7840016|-|https://ossci-datasets.s3.amazonaws.com/mnist/t10k-images-idx3-ubyte.gz"
    "mnist/t10k-labels-idx1-ubyte.gz|gz:10008|-|https://ossci-datasets.s3.amazonaws.com/mnist/t10k-labels-idx1-ubyte.gz"
)
FILES_mnist=(
    "${FILES_mnist_test[@]}"
    "mnist/train-labels-idx1-ubyte.gz|gz:60008|-|https://ossci-datasets.s3.amazonaws.com/mnist/train-labels-idx1-ubyte.gz"
    "mnist/train-images-idx3-ubyte.gz|gz:47040016|-|https://ossci-datasets.s3.amazonaws.com/mnist/train-images-idx3-ubyte.gz"
)

# Multi30k task 1 (multi30k/dataset, data/task1/raw), checked by size after gunzip.
M30K=https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw
FILES_multi30k=(
    "multi30k/train.de.gz|gz:2110398|-|$M30K/train.de.gz"
    "multi30k/train.en.gz|gz:1801238|-|$M30K/train.en.gz"
    "multi30k/val.de.gz|gz:75981|-|$M30K/val.de.gz"
    "multi30k/val.en.gz|gz:63297|-|$M30K/val.en.gz"
    "multi30k/test_2016_flickr.de.gz|gz:70649|-|$M30K/test_2016_flickr.de.gz"
    "multi30k/test_2016_flickr.en.gz|gz:62076|-|$M30K/test_2016_flickr.en.gz"
)

verify() { # file size md5 -> 0 when both match; size "gz:N" = N bytes after gunzip, md5 "-" = not checked
    [ -f "$1" ] || return 1
    case "$2" in
        gz:*) [ "$(gzip -dc < "$1" 2>/dev/null | wc -c)" = "${2#gz:}" ] || return 1 ;;
        *) [ "$(stat -c %s "$1")" = "$2" ] || return 1 ;;
    esac
    [ "$3" = "-" ] || [ "$(md5sum < "$1" | cut -d' ' -f1)" = "$3" ]
}

stamp() { # file md5: records the size and CRC-32 of a file whose md5 matched, in <file>.verified, where the
    # binaries check it (gpt2/data.c, data_file_verified), so a file changed later is not taken for the real one
    [ "$2" = "-" ] && return 0
    local crc
    crc=$(/usr/bin/python3 -c 'import sys, zlib; print("%08x" % zlib.crc32(open(sys.argv[1], "rb").read()))' "$1")
    printf 'size %s crc32 %s md5 %s\n' "$(stat -c %s "$1")" "$crc" "$2" > "$1.verified.$$"
    mv "$1.verified.$$" "$1.verified"
}

fetch() { # "path|size|md5|url"
    IFS='|' read -r path size md5 url <<< "$1"
    local dest="$DATA/$path"
    if verify "$dest" "$size" "$md5"; then stamp "$dest" "$md5"; return 0; fi
    if [ -e "$dest" ]; then
        echo "error: $dest exists but is not the expected file (size $(stat -c %s "$dest"), expected $size bytes, md5 $md5; gz:N means N bytes after gunzip) (hint: delete it and run this script again)" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$dest")"
    local tmp="$dest.part.$$"
    trap 'rm -f "$tmp"' EXIT
    if [ -n "$MIRROR" ] && [ -f "$MIRROR/$path" ]; then
        echo "data: $path from mirror $MIRROR"
        cp "$MIRROR/$path" "$tmp"
    else
        echo "data: downloading $path from $url"
        if ! curl -fsSL --retry 3 --retry-delay 2 --connect-timeout 20 -o "$tmp" "$url"; then
            echo "error: download of $url failed (hint: check the network, or pass --mirror DIR with a local copy at DIR/$path)" >&2
            exit 1
        fi
    fi
    if ! verify "$tmp" "$size" "$md5"; then
        echo "error: $path from ${MIRROR:+the mirror or }$url has size $(stat -c %s "$tmp") and md5 $(md5sum < "$tmp" | cut -d' ' -f1), expected $size and $md5 (gz:N = N bytes after gunzip, - = not checked) (hint: the source changed or the transfer was damaged; try again or use another mirror)" >&2
        exit 1
    fi
    mv "$tmp" "$dest"
    trap - EXIT
    stamp "$dest" "$md5"
}

cifar() { # cifar10 | cifar100: the binary version from its author's page, checked by the extracted sizes
    local name=$1 url dir files
    if [ "$name" = cifar10 ]; then
        url=https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz dir=cifar-10-batches-bin
        files="data_batch_1.bin:30730000 data_batch_2.bin:30730000 data_batch_3.bin:30730000 data_batch_4.bin:30730000 data_batch_5.bin:30730000 test_batch.bin:30730000"
    else
        url=https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz dir=cifar-100-binary
        files="train.bin:153700000 test.bin:30740000"
    fi
    local ok=1 f
    for f in $files; do
        [ "$(stat -c %s "$DATA/$name/$dir/${f%%:*}" 2>/dev/null)" = "${f#*:}" ] || ok=0
    done
    [ $ok = 1 ] && return 0
    mkdir -p "$DATA/$name"
    local tmp="$DATA/$name/.download.$$"
    rm -rf "$tmp" && mkdir -p "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    local archive="${url##*/}"
    if [ -n "$MIRROR" ] && [ -f "$MIRROR/$name/$archive" ]; then
        echo "data: $name from mirror $MIRROR"
        cp "$MIRROR/$name/$archive" "$tmp/"
    else
        echo "data: downloading $url (about 170 MB)"
        curl -fsSL --retry 3 --retry-delay 2 --connect-timeout 20 -o "$tmp/$archive" "$url" || {
            echo "error: download of $url failed (hint: check the network, or put $archive in a mirror folder: --mirror DIR with DIR/$name/$archive)" >&2
            exit 1; }
    fi
    tar -xzf "$tmp/$archive" -C "$tmp" || { echo "error: $archive is not a valid tar.gz archive (hint: delete it from the mirror and download again)" >&2; exit 1; }
    for f in $files; do
        if [ "$(stat -c %s "$tmp/$dir/${f%%:*}" 2>/dev/null)" != "${f#*:}" ]; then
            echo "error: $archive: $dir/${f%%:*} is missing or not ${f#*:} bytes (hint: the download is damaged; try again)" >&2
            exit 1
        fi
    done
    rm -rf "$DATA/$name/$dir" && mv "$tmp/$dir" "$DATA/$name/$dir"
    rm -rf "$tmp"
    trap - EXIT
}

shards() { # tiny Shakespeare as GPT-2 BPE shards in llm.c's format
    local prefix="$DATA/tinyshakespeare/tiny_shakespeare"
    # sizes of the two shards the tokenizer makes (1024-byte header + 2 bytes per token)
    if [ "$(stat -c %s "${prefix}_val_000000.bin" 2>/dev/null)" = 66560 ] &&
       [ "$(stat -c %s "${prefix}_train_000001.bin" 2>/dev/null)" = 611540 ]; then
        return 0
    fi
    if [ -z "$TOKENIZER" ] || [ ! -x "$TOKENIZER" ]; then
        echo "error: making BPE shards needs the tokenizer binary (hint: pass --tokenizer build/<run>/<step>/gpt2/tokenize; make does this)" >&2
        exit 1
    fi
    echo "data: tokenizing tiny Shakespeare into GPT-2 BPE shards"
    "$TOKENIZER" --encoder "$DATA/gpt2-bpe/encoder.json" --vocab "$DATA/gpt2-bpe/vocab.bpe" \
        --input "$DATA/tinyshakespeare/input.txt" --out-prefix "$prefix" --val-tokens 32768
}

[ ${#names[@]} -gt 0 ] || { echo "usage: scripts/get_data.sh [--mirror DIR] [--data DIR] [--tokenizer BIN] NAME..." >&2; exit 2; }
for name in "${names[@]}"; do
    case "$name" in
        tinyshakespeare) for f in "${FILES_tinyshakespeare[@]}"; do fetch "$f"; done ;;
        gpt2-bpe) for f in "${FILES_gpt2_bpe[@]}"; do fetch "$f"; done ;;
        tinyshakespeare-bpe)
            for f in "${FILES_tinyshakespeare[@]}" "${FILES_gpt2_bpe[@]}"; do fetch "$f"; done
            shards ;;
        mnist) for f in "${FILES_mnist[@]}"; do fetch "$f"; done ;;
        mnist-test) for f in "${FILES_mnist_test[@]}"; do fetch "$f"; done ;;
        multi30k) for f in "${FILES_multi30k[@]}"; do fetch "$f"; done ;;
        cifar10|cifar100) cifar "$name" ;;
    esac
done
