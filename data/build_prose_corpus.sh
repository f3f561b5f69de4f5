#!/usr/bin/env bash
# Build the English prose corpus (data/prose_corpus.py has the whole story):
#   1. download the Debian documentation packages it reads (`apt-get download`, into data/prose/debs/) and
#      unpack them (`dpkg-deb -x`, into data/prose/root/<package>/): nothing is installed, no root needed,
#      debs and unpacked packages already there are reused;
#   2. python3 data/prose_corpus.py "$@": documents, filter, seeded shuffle and split, BPE tokenizer(s)
#      trained on the train split, shards in data/prose<V>/.
#
#   bash data/build_prose_corpus.sh                                  # V = 8192
#   bash data/build_prose_corpus.sh --vocab_sizes 2048,8192,32768    # the V/D study
#
# Needs: Debian or Ubuntu (apt-get, dpkg-deb), man (man-db) to render man pages, and the tokenizers library
# (pip install -r experiments/requirements.txt). Exit 1 with a one-line message when one is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=data/prose

die() { echo "error: $*" >&2; exit 1; }

for tool in apt-get apt-cache dpkg-deb; do
    command -v "$tool" >/dev/null || die "$tool not found: this builder reads Debian packages (Debian or Ubuntu)"
done
command -v man >/dev/null || die "man not found: apt-get install man-db (it renders the man pages)"
python3 -c "import tokenizers" 2>/dev/null \
    || die "the tokenizers library is missing: pip install -r experiments/requirements.txt"

if ! apt-cache show --no-all-versions manpages >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        echo "package lists are empty: apt-get update"
        apt-get update -qq
    else
        die "apt's package lists are empty: run 'sudo apt-get update' once, then this again"
    fi
fi

mkdir -p "$WORK/debs" "$WORK/root"
t0=$SECONDS
while read -r src group; do
    pkg=""
    for alt in ${group//|/ }; do
        if apt-cache show --no-all-versions "$alt" >/dev/null 2>&1; then pkg=$alt; break; fi
    done
    [ -n "$pkg" ] || die "source $src: none of the packages $group is known to apt (apt-get update?)"
    if [ -e "$WORK/root/$pkg/.unpacked" ]; then
        echo "$src: $pkg already unpacked"
        continue
    fi
    deb=$(ls "$WORK/debs/${pkg}_"*.deb 2>/dev/null | head -n 1 || true)
    if [ -z "$deb" ]; then
        (cd "$WORK/debs" && apt-get download -q "$pkg" 2>&1 | grep -v "^W: Download is performed unsandboxed" || true)
        deb=$(ls "$WORK/debs/${pkg}_"*.deb 2>/dev/null | head -n 1 || true)
        [ -n "$deb" ] || die "source $src: apt-get download $pkg failed"
        echo "$src: downloaded $(basename "$deb") ($(du -h "$deb" | cut -f1))"
    fi
    rm -rf "$WORK/root/$pkg"
    dpkg-deb -x "$deb" "$WORK/root/$pkg"
    touch "$WORK/root/$pkg/.unpacked"
    echo "$src: unpacked $(basename "$deb")"
done < <(python3 data/prose_corpus.py --list_packages)
echo "packages ready in $((SECONDS - t0))s"

exec python3 data/prose_corpus.py "$@"
