#!/usr/bin/env bash
# Build the English prose corpus (data/prose_corpus.py has the whole story):
#   1. download the Debian documentation packages it reads (`apt-get download`, into data/prose/debs/) and
#      unpack them (`dpkg-deb -x`, into data/prose/root/<package>/): nothing is installed, no root needed,
#      debs and unpacked packages already there are reused. The versions are pinned (data/prose_packages.txt:
#      each .deb's version and sha256), so that the corpus is the one records/ trained on; --latest takes
#      today's packages instead (another corpus);
#   2. python3 data/prose_corpus.py "$@": documents, filter, seeded shuffle and split, BPE tokenizer(s)
#      trained on the train split, shards in data/prose<V>/;
#   3. pinned: the V = 8192 shards' sha256 against data/prose_packages.txt (a match: records/' corpus exactly).
#
#   bash data/build_prose_corpus.sh                                  # V = 8192
#   bash data/build_prose_corpus.sh --vocab_sizes 2048,8192,32768    # the V/D study
#   bash data/build_prose_corpus.sh --latest                         # today's packages, no pins
#
# Needs: Debian or Ubuntu (apt-get, dpkg-deb), man (man-db) to render man pages, and the tokenizers library
# (pip install -r experiments/requirements.txt). Exit 1 with a one-line message when one is missing, or when
# a pinned package cannot be had.
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

PINS=data/prose_packages.txt
latest=0 out_base=data prev=""
args=()
for arg in "$@"; do
    if [ "$arg" = --latest ]; then latest=1; else args+=("$arg"); fi
    [ "$prev" = --out_base ] && out_base=$arg
    case "$arg" in --out_base=*) out_base=${arg#--out_base=} ;; esac
    prev=$arg
done
[ "$latest" = 1 ] || [ -f "$PINS" ] || die "$PINS is missing: it pins the packages (or build with --latest)"
pin() { awk -v p="$1" '$1 == p && !/^#/ {print $2, $3}' "$PINS"; }

mkdir -p "$WORK/debs" "$WORK/root"
t0=$SECONDS
while read -r src group; do
    pkg=""
    for alt in ${group//|/ }; do
        if [ "$latest" = 1 ]; then
            apt-cache show --no-all-versions "$alt" >/dev/null 2>&1 && { pkg=$alt; break; }
        elif [ -n "$(pin "$alt")" ]; then
            pkg=$alt; break
        fi
    done
    if [ "$latest" = 1 ]; then
        [ -n "$pkg" ] || die "source $src: none of the packages $group is known to apt (apt-get update?)"
        version="" sha=""
    else
        [ -n "$pkg" ] || die "source $src: $PINS pins none of the packages $group"
        read -r version sha < <(pin "$pkg")
    fi
    deb=""  # the pinned .deb: already here (by its sha256), else downloaded at its version
    for f in "$WORK/debs/${pkg}_"*.deb; do
        [ -e "$f" ] || continue
        if [ -z "$sha" ] || [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$sha" ]; then deb=$f; break; fi
    done
    if [ -z "$deb" ]; then
        (cd "$WORK/debs" && apt-get download -q "$pkg${version:+=$version}" 2>&1 \
            | grep -v "^W: Download is performed unsandboxed" || true)
        for f in "$WORK/debs/${pkg}_"*.deb; do
            [ -e "$f" ] || continue
            if [ -z "$sha" ] || [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$sha" ]; then deb=$f; break; fi
        done
        [ -n "$deb" ] || [ -z "$version" ] || die "source $src: apt-get cannot download $pkg $version (Debian's archive \
moved on): put ${pkg}_${version}_*.deb from https://snapshot.debian.org/binary/$pkg/ into $WORK/debs/, or build \
from today's packages with --latest (another corpus than records/')"
        [ -n "$deb" ] || die "source $src: apt-get download $pkg failed"
        echo "$src: downloaded $(basename "$deb") ($(du -h "$deb" | cut -f1))"
    fi
    if [ "$(cat "$WORK/root/$pkg/.unpacked" 2>/dev/null)" = "$(basename "$deb")" ]; then
        echo "$src: $pkg already unpacked"
        continue
    fi
    rm -rf "$WORK/root/$pkg"
    dpkg-deb -x "$deb" "$WORK/root/$pkg"
    basename "$deb" > "$WORK/root/$pkg/.unpacked"
    echo "$src: unpacked $(basename "$deb")"
done < <(python3 data/prose_corpus.py --list_packages)
echo "packages ready in $((SECONDS - t0))s"

python3 data/prose_corpus.py "${args[@]}"
[ "$latest" = 1 ] && exit 0
while read -r _ shard sha; do
    [ -e "$out_base/$shard" ] || continue  # built only for the vocabularies asked for
    if [ "$(sha256sum "$out_base/$shard" | cut -d' ' -f1)" = "$sha" ]; then
        echo "$out_base/$shard: the pinned corpus's (sha256 ${sha:0:12}...)"
    else
        echo "$out_base/$shard: differs from the pinned corpus's sha256 (flags other than --vocab_sizes, or another \
man-db or groff rendering the man pages?): records/' numbers are not on this corpus"
    fi
done < <(grep '^shard ' "$PINS")
