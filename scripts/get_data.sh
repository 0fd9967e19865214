#!/bin/bash
# Fetches and verifies kvlab's data sets.
#
#   scripts/get_data.sh [--mirror DIR] [--data DIR] [--tokenizer BIN] NAME...
#
# NAME: tinyshakespeare, gpt2-bpe, tinyshakespeare-bpe (GPT-2 BPE token shards
# of tiny Shakespeare, made with the C tokenizer given by --tokenizer).
# Each file is taken from the mirror folder (--mirror, else $KVLAB_DATA_MIRROR,
# else ../shared/data when it exists) or downloaded from its canonical public
# URL; its size and md5 are checked either way, and it is moved into place
# only when they match.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=data
MIRROR="${KVLAB_DATA_MIRROR:-}"
[ -z "$MIRROR" ] && [ -d ../shared/data ] && MIRROR=../shared/data
TOKENIZER=""
names=()
while [ $# -gt 0 ]; do
    case "$1" in
        --mirror) MIRROR="$2"; shift 2 ;;
        --data) DATA="$2"; shift 2 ;;
        --tokenizer) TOKENIZER="$2"; shift 2 ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        -*) echo "error: unknown option $1 (hint: scripts/get_data.sh --help)" >&2; exit 2 ;;
        *) names+=("$1"); shift ;;
    esac
done

# path | size | md5 | canonical URL
FILES_tinyshakespeare=(
    "tinyshakespeare/input.txt|1115394|6fb458f1232090904fb40fe944165e91|https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
FILES_gpt2_bpe=(
    "gpt2-bpe/encoder.json|1042301|dffec25a898b1f5e569bec4dffd7e5c0|https://openaipublic.blob.core.windows.net/gpt-2/models/124M/encoder.json"
    "gpt2-bpe/vocab.bpe|456318|75a37753dd7a28a2c5df80c28bf06e4e|https://openaipublic.blob.core.windows.net/gpt-2/models/124M/vocab.bpe"
)

verify() { # file size md5 -> 0 when both match
    [ -f "$1" ] && [ "$(stat -c %s "$1")" = "$2" ] && [ "$(md5sum < "$1" | cut -d' ' -f1)" = "$3" ]
}

fetch() { # "path|size|md5|url"
    IFS='|' read -r path size md5 url <<< "$1"
    local dest="$DATA/$path"
    if verify "$dest" "$size" "$md5"; then return 0; fi
    if [ -e "$dest" ]; then
        echo "error: $dest exists but is not the expected file (size $(stat -c %s "$dest"), expected $size bytes, md5 $md5) (hint: delete it and run this script again)" >&2
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
        echo "error: $path from ${MIRROR:+the mirror or }$url has size $(stat -c %s "$tmp") and md5 $(md5sum < "$tmp" | cut -d' ' -f1), expected $size and $md5 (hint: the source changed or the transfer was damaged; try again or use another mirror)" >&2
        exit 1
    fi
    mv "$tmp" "$dest"
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
        *) echo "error: unknown data set '$name' (hint: tinyshakespeare, gpt2-bpe or tinyshakespeare-bpe)" >&2; exit 2 ;;
    esac
done
