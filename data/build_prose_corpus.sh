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

die() { echo "error: $*" >&2; exit 1; }

PINS=data/prose_packages.txt
WORK=data/prose out_base=data latest=0 prev=""
args=()
for arg in "$@"; do  # --latest is this script's; --work_dir and --out_base (or a prefix argparse takes) are read too
    if [ "$arg" = --latest ]; then latest=1; else args+=("$arg"); fi
    case "$prev" in *=*) ;; --w*) WORK=$arg ;; --ou*) out_base=$arg ;; esac
    case "$arg" in --w*=*) WORK=${arg#*=} ;; --ou*=*) out_base=${arg#*=} ;; esac
    prev=$arg
done

command -v dpkg-deb >/dev/null || die "dpkg-deb not found: this builder reads Debian packages (Debian or Ubuntu)"
command -v man >/dev/null || die "man not found: apt-get install man-db (it renders the man pages)"
python3 -c "import tokenizers" 2>/dev/null \
    || die "the tokenizers library is missing: pip install -r experiments/requirements.txt"
[ "$latest" = 1 ] || [ -f "$PINS" ] || die "$PINS is missing: it pins the packages (or build with --latest)"

apt_ready=0
need_apt() {  # only when a .deb has to be looked up or downloaded: pinned .debs already here need no apt
    [ "$apt_ready" = 1 ] && return
    for tool in apt-get apt-cache; do
        command -v "$tool" >/dev/null || die "$tool not found: a package must be downloaded (Debian or Ubuntu)"
    done
    if ! apt-cache show --no-all-versions manpages >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ]; then
            echo "package lists are empty: apt-get update"
            apt-get update -qq
        else
            die "apt's package lists are empty: run 'sudo apt-get update' once, then this again"
        fi
    fi
    apt_ready=1
}
pin() { tr -d '\r' < "$PINS" | awk -v p="$1" '!/^#/ && $1 == p {print $2, $3}'; }
pool_path() { tr -d '\r' < "$PINS" | awk -v p="$1" '!/^#/ && $1 == p {print $4}'; }
from_pool() {  # the pinned .deb from its place in Debian's pool, when apt's lists have dropped its version
    local path url
    path=$(pool_path "$pkg")
    [ -n "$path" ] || return 0
    url="${PROSE_DEBIAN_MIRROR:-http://deb.debian.org}/$path"
    python3 - "$url" "$WORK/debs/$(basename "$path")" <<'PY' || true
import shutil, sys, urllib.request
url, dest = sys.argv[1:]
try:
    with urllib.request.urlopen(url, timeout=60) as r, open(dest + ".part", "wb") as f:
        shutil.copyfileobj(r, f)
except OSError as e:
    print(f"  not in Debian's pool either ({url}: {e})")
    sys.exit(1)
import os
os.replace(dest + ".part", dest)
PY
}
sha_of() { sha256sum "$1" | cut -d' ' -f1; }
matching_deb() {  # the .deb of $pkg here with the pinned sha256 (pinned) or apt's version (--latest)
    for f in "$WORK/debs/${pkg}_"*.deb; do
        [ -e "$f" ] || continue
        if [ -n "$sha" ]; then [ "$(sha_of "$f")" = "$sha" ] && { echo "$f"; return; }
        elif [ "$(dpkg-deb -f "$f" Version)" = "$version" ]; then echo "$f"; return; fi
    done
    return 0  # none: an empty answer, not a failure that set -e would stop the script on
}

mkdir -p "$WORK/debs" "$WORK/root"
t0=$SECONDS
packages=$(python3 data/prose_corpus.py --list_packages)
while read -r src group; do
    pkg=""
    for alt in ${group//|/ }; do
        if [ "$latest" = 1 ]; then
            need_apt
            apt-cache show --no-all-versions "$alt" >/dev/null 2>&1 && { pkg=$alt; break; }
        elif [ -n "$(pin "$alt")" ]; then
            pkg=$alt; break
        fi
    done
    if [ "$latest" = 1 ]; then
        [ -n "$pkg" ] || die "source $src: none of the packages $group is known to apt (apt-get update?)"
        version=$(apt-cache show --no-all-versions "$pkg" | awk '/^Version:/ {print $2; exit}') sha=""
    else
        [ -n "$pkg" ] || die "source $src: $PINS pins none of the packages $group"
        read -r version sha < <(pin "$pkg")
        [[ "$sha" =~ ^[0-9a-f]{64}$ ]] || die "$PINS: the line of $pkg needs a version and a sha256"
    fi
    for alt in ${group//|/ }; do  # the source reads the newest tree it finds: only the chosen package's stays
        [ "$alt" = "$pkg" ] || rm -rf "${WORK:?}/root/$alt"
    done
    deb=$(matching_deb)
    if [ -z "$deb" ]; then
        need_apt
        fetched=1
        out=$(cd "$WORK/debs" && apt-get download -q "$pkg=$version" 2>&1) || fetched=0
        [ -z "$out" ] || echo "$out" | grep -v "^W: Download is performed unsandboxed" || true
        deb=$(matching_deb)
        if [ -z "$deb" ] && [ -n "$sha" ]; then
            got=$(ls "$WORK/debs/${pkg}_${version//:/%3a}_"*.deb 2>/dev/null | head -n 1 || true)
            [ "$fetched" = 0 ] || [ -z "$got" ] \
                || die "source $src: apt's $(basename "$got") has sha256 $(sha_of "$got"), not the pinned $sha"
            from_pool
            deb=$(matching_deb)
            pooled="$WORK/debs/$(basename "$(pool_path "$pkg")")"
            if [ -z "$deb" ] && [ -n "$(pool_path "$pkg")" ] && [ -f "$pooled" ]; then
                sum=$(sha_of "$pooled")
                rm -f "$pooled"
                die "source $src: Debian's pool's $(basename "$pooled") has sha256 $sum, not the pinned $sha"
            fi
            [ -n "$deb" ] || die "source $src: neither apt-get nor Debian's pool has $pkg $version (the archive \
moved on): put ${pkg}_${version#*:}_*.deb from https://snapshot.debian.org/binary/$pkg/ into $WORK/debs/, or \
build from today's packages with --latest (another corpus than records/')"
        fi
        [ -n "$deb" ] || die "source $src: apt-get download $pkg=$version failed"
        echo "$src: downloaded $(basename "$deb") ($(du -h "$deb" | cut -f1))"
    fi
    marker="$(basename "$deb") ${sha:-$(sha_of "$deb")}"  # pinned: its sha256 was checked above, not hashed again
    if [ "$(cat "$WORK/root/$pkg/.unpacked" 2>/dev/null)" = "$marker" ]; then
        echo "$src: $pkg already unpacked"
        continue
    fi
    rm -rf "${WORK:?}/root/$pkg"
    err=$(dpkg-deb -x "$deb" "$WORK/root/$pkg" 2>&1) || die "source $src: dpkg-deb cannot unpack $deb: ${err%%$'\n'*}"
    echo "$marker" > "$WORK/root/$pkg/.unpacked"
    echo "$src: unpacked $(basename "$deb")"
done <<< "$packages"
echo "packages ready in $((SECONDS - t0))s"

stamp=$(mktemp)
trap 'rm -f "$stamp"' EXIT
python3 data/prose_corpus.py ${args[@]+"${args[@]}"}
[ "$latest" = 1 ] && exit 0
while read -r _ shard sha; do  # only shards this build wrote: another vocabulary's or folder's are not vouched for
    [ "$out_base/$shard" -nt "$stamp" ] || continue
    if [ "$(sha_of "$out_base/$shard")" = "$sha" ]; then
        echo "$out_base/$shard: the pinned corpus's (sha256 ${sha:0:12}...)"
    else
        echo "$out_base/$shard: differs from the pinned corpus's sha256 (flags other than --vocab_sizes, or another \
man-db or groff rendering the man pages?): records/' numbers are not on this corpus"
    fi
done < <(tr -d '\r' < "$PINS" | grep '^shard ' || true)
