"""Tokenize a text corpus into speedrun shards (the same format as the FineWeb shards).

    python data/tokenize_corpus.py --stdlib --out_dir data/pystdlib --name pystdlib
    python data/tokenize_corpus.py notes.txt src/ chats.jsonl --out_dir data/mine --name mine
    python data/tokenize_corpus.py --stdlib --encoding bytes --out_dir data/pystdlib_bytes --name pystdlib

Inputs are files or folders. Folders are walked recursively in sorted order (hidden folders skipped),
keeping files that match --glob. A .jsonl/.json file holds one JSON document per line (text in
--text_field); any other file is one document. --stdlib adds every *.py file of this Python's standard
library (site-packages excluded). Files are read as UTF-8, undecodable bytes replaced. Documents that
are empty or whitespace only are skipped. A binary file (a NUL byte in its first 8 KiB, as git and grep
decide; e.g. images, executables, UTF-16 text) is skipped with a one-line notice, whether it was named
or found in a folder; if every input file is binary, nothing is written (exit 1).

Every document is written as [BOS] + tokens, BOS being the tokenizer's end-of-text token (50256 for
GPT-2), so documents start with BOS as in the FineWeb shards. Text is encoded with encode_ordinary:
a literal "<|endoftext|>" in a file is plain text, never a BOS.

Documents are split into val and train by a hash of (seed, document index); if one split would be
empty, the last document goes to it. Output files, in --out_dir:
    {name}_val_000000.bin, {name}_train_000000.bin, {name}_train_000001.bin, ...
cut every --shard_tokens tokens (documents may span two shards). Shard = 256 int32 little-endian
header (magic 20240520, version, token count, vocabulary size), then the tokens: version 1 = uint16
(vocabulary <= 65536), version 2 = uint32. Files are written under temporary names and renamed only
when everything succeeded; older {name}_{val,train}_*.bin files in --out_dir not rewritten this run
are removed so that a loader globbing them sees one corpus. Temporary files that a killed run left in
--out_dir for the same --name are removed (and reported) when the next run starts, so do not run two
tokenizers on the same --out_dir and --name at once.

Exit codes: 0 done, 1 tokenizer could not be loaded, every input binary, or --out_dir not writable,
2 bad input or command line.
"""

import argparse
import fnmatch
import glob
import re
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

MAGIC = 20240520
HEADER_INTS = 256
DEFAULT_GLOB = "*.py,*.txt,*.md,*.rst"
JSON_SUFFIXES = (".jsonl", ".json")
BATCH_CHARS = 4_000_000  # text handed to the tokenizer at once (bounded memory, enough work for threads)
BINARY_SNIFF_BYTES = 8192  # a NUL byte this early means binary (git's and grep's rule)


class InputError(Exception):
    """Bad input (missing path, unreadable JSON line, no documents): one-line message, exit 2."""
    exit_code = 2


class TokenizerUnavailable(Exception):
    """The tokenizer could not be loaded (typically: GPT-2 BPE files not cached, no internet): exit 1."""
    exit_code = 1


class NoTextError(Exception):
    """Every input file is binary: exit 1."""
    exit_code = 1


class OutputError(Exception):
    """--out_dir cannot be created or written (under a file, read-only, disk full): exit 1."""
    exit_code = 1


# ----------------------------------------------------------------------------------------------------
# shard files

def write_shard(path, tokens, vocab_size):
    """Write `tokens` (ids in [0, vocab_size)) as a shard at `path`. Returns the version written.

    Version 1 stores uint16 and is used when vocab_size <= 65536 (so every id fits); otherwise
    version 2 stores uint32. The write goes straight to `path`: callers wanting atomicity write to a
    temporary name and os.replace it (as tokenize_corpus does)."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size}), got [{int(tokens.min())}, {int(tokens.max())}]")
    if tokens.size >= 2**31:
        raise ValueError(f"{tokens.size} tokens do not fit the int32 count in the header; use smaller shards")
    version, dtype = (1, np.uint16) if vocab_size <= 2**16 else (2, np.uint32)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2], header[3] = MAGIC, version, tokens.size, vocab_size
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.dtype(dtype).newbyteorder("<"), copy=False).tobytes())
    return version


def read_shard_header(path):
    """Header of a shard as a dict (magic, version, num_tokens, vocab_size); ValueError if not a shard.

    vocab_size is 0 for shards whose writer left header[3] unset (e.g. the public FineWeb shards)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_INTS * 4:
        raise ValueError(f"{path}: {size} bytes, too short for the {HEADER_INTS * 4}-byte shard header")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise ValueError(f"{path}: header magic {int(header[0])}, expected {MAGIC}: not a token shard")
    version, ntok = int(header[1]), int(header[2])
    if version not in (1, 2):
        raise ValueError(f"{path}: unknown shard version {version} (expected 1 = uint16 or 2 = uint32)")
    expected = HEADER_INTS * 4 + ntok * (2 if version == 1 else 4)
    if size != expected:
        raise ValueError(f"{path}: {size} bytes but the header announces {ntok} tokens ({expected} bytes)")
    return {"magic": MAGIC, "version": version, "num_tokens": ntok, "vocab_size": int(header[3])}


def read_shard(path):
    """(header dict, tokens as a uint16 or uint32 numpy array) of a shard."""
    header = read_shard_header(path)
    dtype = "<u2" if header["version"] == 1 else "<u4"
    tokens = np.fromfile(path, dtype=dtype, count=header["num_tokens"], offset=HEADER_INTS * 4)
    return header, tokens


# ----------------------------------------------------------------------------------------------------
# tokenizers

class ByteEncoding:
    """UTF-8 bytes as tokens 0..255, BOS = 256, vocabulary 257: the byte-level control."""
    name = "bytes"
    n_vocab = 257
    eot_token = 256

    def encode_ordinary(self, text):
        return list(text.encode("utf-8", errors="replace"))

    def encode_ordinary_batch(self, texts, num_threads=1):
        return [self.encode_ordinary(t) for t in texts]

    def encode_to_array(self, text):  # fast path used by encode_docs
        return np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(np.uint32)

    def decode(self, tokens):
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


def load_encoding(name):
    """'bytes' or a tiktoken encoding name ('gpt2', 'cl100k_base', ...).

    Raises InputError for an unknown name, TokenizerUnavailable when tiktoken cannot load it."""
    if name == "bytes":
        return ByteEncoding()
    import tiktoken
    if name not in tiktoken.list_encoding_names():
        raise InputError(f"unknown --encoding {name!r}; choose bytes or one of {', '.join(tiktoken.list_encoding_names())}")
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        what = "the GPT-2 tokenizer" if name == "gpt2" else f"the tiktoken encoding {name!r}"
        raise TokenizerUnavailable(
            f"could not load {what} ({type(e).__name__}): tiktoken downloads it once (needs internet) "
            f"or reads it from the folder in TIKTOKEN_CACHE_DIR; or use --encoding bytes") from e


def encode_docs(enc, texts, num_threads):
    """[BOS] + tokens for each text, as uint32 arrays."""
    bos = np.array([enc.eot_token], dtype=np.uint32)
    if hasattr(enc, "encode_to_array"):
        bodies = [enc.encode_to_array(t) for t in texts]
    elif num_threads > 1 and hasattr(enc, "encode_ordinary_batch"):
        bodies = enc.encode_ordinary_batch(texts, num_threads=num_threads)
    else:
        bodies = [enc.encode_ordinary(t) for t in texts]
    return [np.concatenate([bos, np.asarray(b, dtype=np.uint32)]) for b in bodies]


# ----------------------------------------------------------------------------------------------------
# documents

def stdlib_files():
    """Every *.py file of this interpreter's standard library (site-/dist-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return collect_dir(root, ["*.py"], exclude_dirs=("site-packages", "dist-packages"))


def collect_dir(root, patterns, exclude_dirs=()):
    """Files under `root` whose name matches one of `patterns`, recursively, sorted by relative path.
    Hidden folders, __pycache__ and `exclude_dirs` are skipped; symlinked folders are not followed."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames
                       if not d.startswith(".") and d != "__pycache__" and d not in exclude_dirs]
        for fn in filenames:  # regular files only: a pipe or a device would block or never end
            if any(fnmatch.fnmatch(fn, pat) for pat in patterns) and (Path(dirpath) / fn).is_file():
                found.append(Path(dirpath) / fn)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def collect_files(inputs, patterns, stdlib=False):
    """The files to read, in order: each input (a file as given, a folder expanded), then the stdlib."""
    files = []
    for inp in inputs:
        p = Path(inp)
        if p.is_dir():
            files.extend(collect_dir(p, patterns))
        elif p.is_file():
            files.append(p)
        elif p.exists():
            raise InputError(f"input {inp} is neither a regular file nor a folder (a pipe or a device?): "
                             "give text files or folders")
        else:
            raise InputError(f"input not found: {inp}")
    if stdlib:
        files.extend(stdlib_files())
    return files


def is_binary(path):
    """Whether the file looks binary: a NUL byte in its first BINARY_SNIFF_BYTES bytes."""
    with open(path, "rb") as f:
        return b"\0" in f.read(BINARY_SNIFF_BYTES)


def iter_documents(files, text_field="text", warn=None):
    """Yield the non-empty documents of `files` in order, as str. Binary files are skipped with a notice
    through `warn` (default: print, with the run's other progress lines; stderr is kept for the error);
    NoTextError at the end if every file was binary."""
    warn = warn or print
    binary = 0
    for path in files:
        try:
            skip = is_binary(path)
        except OSError as e:  # e.g. a dangling symlink found in a folder
            raise InputError(f"cannot read {path}: {e.strerror or e}") from None
        if skip:
            warn(f"skipping binary file {path} (a NUL byte in its first {BINARY_SNIFF_BYTES} bytes)")
            binary += 1
            continue
        if path.suffix.lower() in JSON_SUFFIXES:
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise InputError(f"{path}:{lineno}: not valid JSON ({e.msg}); "
                                         f"{path.suffix} files must hold one JSON object per line") from None
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise InputError(f"{path}:{lineno}: no string field {text_field!r} "
                                         f"(choose the field with --text_field)")
                    if text.strip():
                        # JSON escapes can smuggle in lone surrogates; make the text encodable
                        yield text.encode("utf-8", errors="replace").decode("utf-8")
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                yield text
    if files and binary == len(files):
        raise NoTextError(f"every input file is binary ({binary} file(s), e.g. {files[0]}): nothing to tokenize; "
                          f"give text files (plain text, or JSON lines with a {text_field!r} field)")


def is_val(seed, index, val_fraction):
    """Whether document `index` belongs to the val split: a hash of (seed, index) below the fraction."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0**64 < val_fraction


def _batches(docs, max_chars):
    batch, chars = [], 0
    for d in docs:
        batch.append(d)
        chars += len(d)
        if chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# ----------------------------------------------------------------------------------------------------
# writing

class _SplitWriter:
    """Accumulates one split's tokens and writes a shard every `shard_tokens` tokens, under temporary names."""

    def __init__(self, out_dir, name, split, shard_tokens, vocab_size):
        self.out_dir, self.name, self.split = out_dir, name, split
        self.shard_tokens, self.vocab_size = shard_tokens, vocab_size
        self.buf, self.buffered = [], 0
        self.docs, self.tokens = 0, 0
        self.written = []  # (temporary path, final path, tokens, version)

    def add(self, doc_tokens):
        self.docs += 1
        self.tokens += len(doc_tokens)
        self.buf.append(doc_tokens)
        self.buffered += len(doc_tokens)
        if self.buffered >= self.shard_tokens:
            allbuf, start = np.concatenate(self.buf), 0
            while allbuf.size - start >= self.shard_tokens:
                self._write(allbuf[start:start + self.shard_tokens])
                start += self.shard_tokens
            rest = allbuf[start:]
            self.buf, self.buffered = ([rest] if rest.size else []), rest.size

    def close(self):
        if self.buffered:
            self._write(np.concatenate(self.buf))
            self.buf, self.buffered = [], 0

    def _write(self, tokens):
        final = self.out_dir / f"{self.name}_{self.split}_{len(self.written):06d}.bin"
        tmp = self.out_dir / f".{final.name}.tmp{os.getpid()}"
        self.written.append((tmp, final, tokens.size, None))
        try:
            version = write_shard(tmp, tokens, self.vocab_size)
        except OSError as e:
            raise _output_error(self.out_dir, e) from None
        self.written[-1] = (tmp, final, tokens.size, version)


def _output_error(out_dir, e):
    if isinstance(e, (NotADirectoryError, FileExistsError)):  # mkdir's words for "a file is in the way"
        why = "a file stands where a folder of that path should be"
    else:
        why = (e.strerror or str(e)) + (f" ({e.filename})" if e.filename and str(e.filename) != str(out_dir) else "")
    return OutputError(f"cannot write to --out_dir {out_dir}: {why}; choose a folder you can write to, "
                       f"with room for the shards")


def tokenize_corpus(docs, enc, out_dir, name, val_fraction=0.05, seed=0, shard_tokens=100_000_000,
                    max_tokens=None, num_threads=None, log=print):
    """Tokenize the documents (an iterable of str) into shards in `out_dir`. Returns a summary dict.

    Each document becomes [BOS] + tokens. Document i goes to val iff is_val(seed, i, val_fraction); the
    last document is moved to whichever split would otherwise be empty (InputError if < 2 documents).
    With max_tokens, documents are taken in order until that many tokens (BOS included) are written,
    the last one truncated. Nothing is renamed into place unless everything succeeds."""
    if not 0.0 < val_fraction < 1.0:
        raise InputError(f"--val_fraction must lie strictly between 0 and 1 (got {val_fraction})")
    if shard_tokens < 1:
        raise InputError(f"--shard_tokens must be >= 1 (got {shard_tokens})")
    if max_tokens is not None and max_tokens < 2:
        raise InputError(f"--max_tokens must be >= 2 (got {max_tokens})")
    num_threads = num_threads or os.cpu_count() or 1
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # a killed run leaves its temporary shards behind (see _SplitWriter._write); nothing else removes them
        leftovers = sorted(p for p in out_dir.iterdir() if is_shard_of(p.name, name, temporary=True))
        for p in leftovers:
            p.unlink()
    except OSError as e:
        raise _output_error(out_dir, e) from None
    if leftovers:
        more = f" and {len(leftovers) - 1} more" if len(leftovers) > 1 else ""
        log(f"removed temporary file(s) left by an interrupted run: {leftovers[0]}{more}")
    vocab = enc.n_vocab
    writers = {s: _SplitWriter(out_dir, name, s, shard_tokens, vocab) for s in ("val", "train")}
    t0 = time.perf_counter()
    try:
        index, total, pending = 0, 0, None  # pending: (index, tokens) of the last document, held back
        for batch in _batches(docs, BATCH_CHARS):
            for toks in encode_docs(enc, batch, num_threads):
                if max_tokens is not None:
                    toks = toks[:max_tokens - total]
                if pending is not None:
                    i, prev = pending
                    writers["val" if is_val(seed, i, val_fraction) else "train"].add(prev)
                pending = (index, toks)
                index += 1
                total += len(toks)
                if max_tokens is not None and total >= max_tokens:
                    break
            if max_tokens is not None and total >= max_tokens:
                break
        if index < 2:
            raise InputError(f"found {index} non-empty document(s); at least 2 are needed (one for val, one for train)")
        i, last = pending
        if writers["val"].docs == 0:
            split = "val"
        elif writers["train"].docs == 0:
            split = "train"
        else:
            split = "val" if is_val(seed, i, val_fraction) else "train"
        writers[split].add(last)
        for w in writers.values():
            w.close()
        # everything is on disk under temporary names: move into place, then drop stale shards
        finals = set()
        try:
            for w in writers.values():
                for tmp, final, _, _ in w.written:
                    os.replace(tmp, final)
                    finals.add(final.name)
            stale = sorted(p for p in out_dir.iterdir() if is_shard_of(p.name, name) and p.name not in finals)
            for p in stale:
                p.unlink()
        except OSError as e:
            raise _output_error(out_dir, e) from None
    finally:
        for w in writers.values():
            for tmp, _, _, _ in w.written:
                if tmp.exists():
                    tmp.unlink()
    summary = {
        "encoding": getattr(enc, "name", "?"), "vocab_size": vocab, "bos": enc.eot_token,
        "docs": {s: w.docs for s, w in writers.items()}, "tokens": {s: w.tokens for s, w in writers.items()},
        "files": [str(final) for w in writers.values() for _, final, _, _ in w.written],
        "versions": sorted({v for w in writers.values() for _, _, _, v in w.written}),
        "stale_removed": [str(p) for p in stale], "seconds": time.perf_counter() - t0,
    }
    for p in summary["stale_removed"]:
        log(f"removed stale {p}")
    log(f"encoding {summary['encoding']} (vocab {vocab}, BOS {enc.eot_token}), "
        f"{summary['seconds']:.1f}s, shard version(s) {summary['versions']}")
    for s in ("train", "val"):
        w = writers[s]
        log(f"{s:5s}: {w.docs:,} docs, {w.tokens:,} tokens, {len(w.written)} file(s)")
    for f in summary["files"]:
        log(f"wrote {f}")
    return summary


# ----------------------------------------------------------------------------------------------------
# command line

class OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = OneLineParser(description="Tokenize text files into speedrun token shards.")
    p.add_argument("inputs", nargs="*",
                   help="files or folders (.jsonl/.json: one document per line; binary files are skipped)")
    p.add_argument("--stdlib", action="store_true", help="add the Python standard library's *.py files")
    p.add_argument("--out_dir", required=True, help="folder for the shards (created if needed)")
    p.add_argument("--name", required=True, help="file prefix: {name}_val_000000.bin, {name}_train_000000.bin, ...")
    p.add_argument("--encoding", default="gpt2",
                   help="gpt2 (default, BOS 50256), bytes (UTF-8 bytes, BOS 256, vocab 257), or a tiktoken name")
    p.add_argument("--glob", default=DEFAULT_GLOB, help=f"comma-separated file patterns for folders (default {DEFAULT_GLOB!r})")
    p.add_argument("--text_field", default="text", help="JSON field holding the text in .jsonl/.json files (default text)")
    p.add_argument("--val_fraction", type=float, default=0.05, help="share of documents held out for val (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="seed of the val/train split (default 0)")
    p.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard file (default 100M)")
    p.add_argument("--max_tokens", type=int, default=None, help="stop after this many tokens in total")
    p.add_argument("--threads", type=int, default=None, help="tokenizer threads (default: all CPUs)")
    args = p.parse_args(argv)
    if not args.inputs and not args.stdlib:
        p.error("no input: give files/folders to tokenize, or --stdlib")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", args.name or ""):
        p.error(f"--name must be a plain file prefix of letters, digits, '.', '_' and '-' (got {args.name!r})")
    if re.search(r"_(val|train)$", args.name):  # NAME_val_*.bin would then match the train shards too
        p.error(f"--name {args.name} ends in _val or _train: the val and train globs would match each other's shards")
    return args


def is_shard_of(filename, name, temporary=False):
    """Whether filename is one of corpus `name`'s shards ({name}_{val,train}_NNNNNN.bin), or with temporary, a
    temporary file of one: exactly, so that no other corpus's files match (corpus x and corpus x_val)."""
    shard = rf"{re.escape(name)}_(val|train)_\d{{6}}\.bin"
    return re.fullmatch(rf"\.{shard}\.tmp.*" if temporary else shard, filename) is not None


def main(argv=None):
    args = parse_args(argv)
    try:
        patterns = [g.strip() for g in args.glob.split(",") if g.strip()]
        files = collect_files(args.inputs, patterns, stdlib=args.stdlib)
        if not files:
            raise InputError(f"no input files found (folders are filtered by --glob {args.glob!r})")
        enc = load_encoding(args.encoding)
        print(f"tokenizing {len(files):,} file(s) with {args.encoding} into {args.out_dir}")
        tokenize_corpus(iter_documents(files, args.text_field), enc, args.out_dir, args.name,
                        val_fraction=args.val_fraction, seed=args.seed, shard_tokens=args.shard_tokens,
                        max_tokens=args.max_tokens, num_threads=args.threads)
    except (InputError, TokenizerUnavailable, NoTextError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
