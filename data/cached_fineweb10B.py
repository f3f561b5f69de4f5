"""Download the GPT-2-tokenized FineWeb shards used by the speedrun.

    python data/cached_fineweb10B.py          # val shard + first 10 train shards (~2.2 GB)
    python data/cached_fineweb10B.py 7        # val shard + the 7 train shards the speedrun reads
    python data/cached_fineweb10B.py 7 --edu  # the same from FineWeb-Edu

The speedrun preset reads 1770 steps x 393,216 tokens = 696M train tokens, i.e. 7 shards; the default
of 10 leaves room for longer runs.

Each shard holds 100M tokens (about 200 MB): a 256 x int32 header (magic 20240520, version 1,
token count) followed by uint16 GPT-2 token ids, every document starting with token 50256.
Files land next to this script, in data/fineweb10B/ (or data/finewebedu10B/ with --edu), whatever
the current directory. Files already there are kept. Regenerating these tokens from raw FineWeb
takes about an hour; downloading them takes a minute or two.

Exit codes: 0 done, 1 download failed (no network, hub error, a broken local file, or a --dir that
cannot be created), 2 bad command line.
"""

import argparse
import shutil
import sys
from pathlib import Path

# name -> (hub dataset repo, local folder next to this script, file prefix)
DATASETS = {
    "fineweb": ("kjj0/fineweb10B-gpt2", "fineweb10B", "fineweb"),
    "edu": ("kjj0/finewebedu10B-gpt2", "finewebedu10B", "finewebedu"),
}
HEADER_BYTES = 256 * 4
MAGIC = 20240520


def shard_names(prefix, num_train):
    """The val shard, then train shards 1..num_train (train numbering starts at 1)."""
    return [f"{prefix}_val_{0:06d}.bin"] + [f"{prefix}_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def check_local_shard(path):
    """None when `path` looks like a complete shard, else a short description of what is wrong."""
    if not path.is_file():  # a folder, a pipe or a device where the shard should be
        return "not a regular file"
    size = path.stat().st_size
    if size < HEADER_BYTES:
        return f"only {size} bytes, shorter than the {HEADER_BYTES}-byte header"
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
    magic, version, ntok = (int.from_bytes(header[4 * i:4 * i + 4], "little", signed=True) for i in range(3))
    if magic != MAGIC:
        return f"header magic is {magic}, expected {MAGIC}"
    itemsize = {1: 2, 2: 4}.get(version)
    if itemsize is None:
        return f"unknown shard version {version}"
    if size != HEADER_BYTES + ntok * itemsize:
        return f"{size} bytes, the header announces {HEADER_BYTES + ntok * itemsize} (truncated download?)"
    return None


def _hub_unreachable(endpoint):
    """One quick request (no retries) to the hub; returns an error string when it cannot be reached."""
    from huggingface_hub.utils import get_session
    try:
        get_session().head(endpoint, timeout=15)
    except Exception as e:  # network-level failure of any kind (DNS, refused, TLS, timeout, proxy)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def _cleanup_failed(local_dir, created_dir):
    """Remove what an interrupted hf_hub_download leaves behind, so no partial file remains."""
    hf_download = local_dir / ".cache" / "huggingface" / "download"
    if hf_download.is_dir():
        for p in hf_download.iterdir():
            if p.name.endswith(".incomplete"):
                try:
                    p.unlink()
                except OSError:
                    pass
    if created_dir and local_dir.is_dir():
        # We made this folder in this run; if it holds nothing but the hub's bookkeeping, remove it.
        if all(p.name == ".cache" for p in local_dir.iterdir()):
            shutil.rmtree(local_dir, ignore_errors=True)


def download(num_train, edu=False, local_dir=None, out=print):
    """Fetch the val shard and the first `num_train` train shards. Returns 0 or 1 (the exit code)."""
    repo_id, folder, prefix = DATASETS["edu" if edu else "fineweb"]
    local_dir = Path(local_dir) if local_dir is not None else Path(__file__).resolve().parent / folder
    names = shard_names(prefix, num_train)

    todo = []
    for name in names:
        path = local_dir / name
        if path.exists():
            problem = check_local_shard(path)
            if problem is not None:
                print(f"error: {path} exists but is not a complete shard ({problem}); "
                      f"delete it and rerun this command", file=sys.stderr)
                return 1
            out(f"skip {path} (already present)")
        else:
            todo.append(name)
    if not todo:
        out(f"all {len(names)} shards present in {local_dir}")
        return 0

    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.utils import logging as hf_logging
    hf_logging.set_verbosity_error()  # the hub's retry chatter would bury the one-line error

    if constants.HF_HUB_OFFLINE:
        print(f"error: cannot download {todo[0]} from {repo_id}: HF_HUB_OFFLINE is set; "
              f"unset it (downloading needs internet access to huggingface.co)", file=sys.stderr)
        return 1
    problem = _hub_unreachable(constants.ENDPOINT)
    if problem is not None:
        print(f"error: cannot reach the Hugging Face hub at {constants.ENDPOINT} to download {todo[0]} "
              f"from {repo_id} ({problem}); this needs internet access to huggingface.co", file=sys.stderr)
        return 1

    created_dir = not local_dir.exists()
    try:
        local_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a file where the folder should be
        print(f"error: cannot create {local_dir} ({type(e).__name__}: {e.strerror}); "
              f"choose another folder with --dir", file=sys.stderr)
        return 1
    for name in todo:
        try:
            # hf_hub_download writes to a temporary .incomplete file and renames it when complete.
            hf_hub_download(repo_id=repo_id, filename=name, repo_type="dataset", local_dir=str(local_dir))
        except BaseException as e:
            _cleanup_failed(local_dir, created_dir)
            if isinstance(e, KeyboardInterrupt):
                print(f"interrupted while downloading {name}; nothing partial was kept", file=sys.stderr)
                return 130
            if not isinstance(e, Exception):
                raise
            msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"error: download of {name} from the dataset {repo_id} failed ({type(e).__name__}: {msg}); "
                  f"this needs internet access to huggingface.co", file=sys.stderr)
            return 1
        created_dir = False  # something real is in the folder now; never remove it
        out(f"downloaded {local_dir / name}")
    out(f"done: {len(names)} shards in {local_dir}")
    return 0


class OneLineParser(argparse.ArgumentParser):  # its own: this script must run when copied alone
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = OneLineParser(description="Download GPT-2-tokenized FineWeb(-Edu) shards from the Hugging Face hub.")
    p.add_argument("num_train", nargs="?", type=int, default=10,
                   help="number of 100M-token train shards to fetch, starting at 1 (default 10: the speedrun preset "
                        "reads 1770 x 393,216 tokens = 7.0 shards)")
    p.add_argument("--edu", action="store_true", help="fetch FineWeb-Edu (kjj0/finewebedu10B-gpt2) instead of FineWeb")
    p.add_argument("--dir", default=None,
                   help="download into this folder instead of data/fineweb10B (data/finewebedu10B with --edu)")
    args = p.parse_args(argv)
    most = 99 if args.edu else 103  # the shards the 10B-token samples have; more would fail at the download
    if not 1 <= args.num_train <= most:
        p.error(f"the number of train shards must lie in 1..{most}, the 10B-token sample's (got {args.num_train})")
    return args


def main(argv=None):
    args = parse_args(argv)
    return download(args.num_train, edu=args.edu, local_dir=args.dir)


if __name__ == "__main__":
    sys.exit(main())
