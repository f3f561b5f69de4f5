"""Build an English natural-text corpus from Debian documentation packages, train BPE tokenizers on its
train split, and write speedrun shards: the data of a fair CPU race at the paper's V/D ratio.

    bash data/build_prose_corpus.sh                                  # download, extract, build V = 8192
    bash data/build_prose_corpus.sh --vocab_sizes 2048,8192,32768    # several vocabularies at once
    python3 data/prose_corpus.py --list_packages                     # the packages each source reads

Steps (build_prose_corpus.sh does 1, then runs this script for 2-6):
 1. Packages. `apt-get download` fetches each source's .deb, at the version data/prose_packages.txt pins
    (--latest: today's), into data/prose/debs/ and `dpkg-deb -x` unpacks it into data/prose/root/<package>/:
    nothing is installed and no root is needed (except for an `apt-get update` when the package lists are
    missing). Debs and unpacked trees already there are kept.
 2. Documents. Every source below turns its files into documents (one file, man page, chapter or book
    = one document), cached in data/prose/docs/<source>.jsonl.gz (reused while its input files are
    unchanged; --refresh rebuilds). Markup is kept as the files have it (reStructuredText, POD,
    AsciiDoc), HTML is reduced to its text with the standard library's html.parser, man pages are
    rendered to plain text with `man -l -P cat` (80 columns).
 3. Filter. A document longer than --max_doc_chars is cut at paragraph breaks into pieces of at most
    that size (each piece a document). Then dropped, in this order: tiny (fewer than --min_chars
    characters), not prose (is_prose below: under half of its non-blank characters in prose lines, or
    under 20% English function words among its words), exact duplicates (same text after stripping;
    the first in source order is kept).
 4. Order and split. Documents are sorted by (source, name), shuffled with random.Random(--seed), and
    document i of the shuffled order goes to val iff tokenize_corpus.is_val(seed, i, --val_fraction):
    a seeded document-level split, and shard order is the shuffled order, never source order.
 5. Tokenizer. A byte-level BPE (the `tokenizers` library, GPT-2's pre-tokenizer regex, all 256 bytes in
    the base alphabet) trained on the train documents only, with V - 1 entries, plus the document-start
    token <|bos|> as the LAST id, V - 1 (the training script's default bos_id = vocab_size - 1). A literal
    "<|bos|>" in a text is encoded as plain text. Saved as data/prose<V>/tokenizer.json with meta.json;
    retrained only when the train documents or V changed.
 6. Shards. data/tokenize_corpus.py's writer: data/prose<V>/prose<V>_{train,val}_000000.bin, every
    document [BOS] + tokens, header[3] = V, version 1 (uint16) for V <= 65536.

It prints documents, drops and characters per source, then train/val documents and tokens per source and
vocabulary, and whether the targets (>= 20M tokens, val >= 1M tokens from >= 300 documents) are met.

Exit codes: 0 done, 1 data problem (packages not unpacked, a tool or the tokenizers library missing, no
documents), 2 bad command line.
"""

import argparse
import collections
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenize_corpus import (ByteEncoding, InputError, OneLineParser, OutputError, is_val,  # noqa: E402
                             read_shard_header, tokenize_corpus)

HERE = Path(os.path.relpath(Path(__file__).resolve().parent))  # relative: logs name no machine's paths
DEFAULT_WORK = HERE / "prose"          # debs/, root/, docs/ (git-ignored)
BOS_TOKEN = "<|bos|>"
BYTE_VOCAB = 257                       # --vocab_sizes 257: UTF-8 bytes and BOS, no tokenizer
CACHE_VERSION = 1                      # bump when a reader's output changes, to invalidate the caches
TARGET_TOKENS, TARGET_VAL_TOKENS, TARGET_VAL_DOCS = 20_000_000, 1_000_000, 300


class DataError(Exception):
    """Missing packages, tools or libraries, or no documents: one line, exit 1."""
    exit_code = 1


# ----------------------------------------------------------------------------------------------------
# the prose filter

# The most frequent English function words: about 40% of the words of running English prose, a few
# percent of code, tables and option lists.
STOPWORDS = frozenset("""
a about all also an and any are as at be because been but by can could do does each for from had has
have he her his how i if in into is it its may more most must no not of on one only or other our she
should so some such than that the their them then there these they this those to was we were what when
where which while who will with would you your
""".split())
_WORD = re.compile(r"[A-Za-z]+")
# a plain word, possibly with quotes/brackets around it and punctuation after it
_PLAIN_TOKEN = re.compile(r"""[(\[\"'`‘“]?[A-Za-z][a-z]*(?:['’-][A-Za-z][a-z]*)*[)\]\"'`’”]?[.,;:!?]?[)\]\"'’”]?""")
PROSE_LINE_MIN_TOKENS = 6
PROSE_LINE_MIN_PLAIN = 2 / 3
PROSE_MIN_SHARE = 0.5
PROSE_MIN_STOPWORDS = 0.2


def is_prose_line(line):
    """A line of running text: at least 6 whitespace-separated tokens, at least 2/3 of them plain words."""
    toks = line.split()
    if len(toks) < PROSE_LINE_MIN_TOKENS:
        return False
    return sum(1 for t in toks if _PLAIN_TOKEN.fullmatch(t)) >= PROSE_LINE_MIN_PLAIN * len(toks)


def prose_stats(text):
    """(share of non-blank characters in prose lines, share of words that are English function words)."""
    total = prose = 0
    for line in text.splitlines():
        n = len(line.strip())
        if n:
            total += n
            if is_prose_line(line):
                prose += n
    words = _WORD.findall(text)
    stop = sum(1 for w in words if w.lower() in STOPWORDS)
    return (prose / total if total else 0.0), (stop / len(words) if words else 0.0)


def is_prose(text):
    """The document filter: at least half of its non-blank characters lie in prose lines, and at least
    20% of its words are English function words (code, tables, option lists and other languages fail)."""
    share, stop = prose_stats(text)
    return share >= PROSE_MIN_SHARE and stop >= PROSE_MIN_STOPWORDS


# ----------------------------------------------------------------------------------------------------
# readers: files -> text

def read_text(path):
    """A file as UTF-8 text (gzip-compressed if its name ends in .gz), undecodable bytes replaced."""
    path = Path(path)
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return data.decode("utf-8", errors="replace")


_HTML_SKIP = {"script", "style", "head", "header", "footer", "nav", "aside"}  # page furniture
_HTML_SKIP_CLASSES = {"navheader", "navfooter"}  # DocBook's Prev/Up/Next bars, the same on every page
_HTML_BLOCK = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6",
               "pre", "table", "tr", "td", "th", "blockquote", "section", "hr", "caption", "figure"}


class _HTMLText(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip_tag, self.skip_depth, self.pre = [], None, 0, 0

    def handle_starttag(self, tag, attrs):
        if self.skip_tag:
            self.skip_depth += tag == self.skip_tag
            return
        classes = set((dict(attrs).get("class") or "").split())
        if tag in _HTML_SKIP or classes & _HTML_SKIP_CLASSES:
            self.skip_tag, self.skip_depth = tag, 1
            return
        if tag == "pre":
            self.pre += 1
        if tag in _HTML_BLOCK:
            self.out.append("\n\n" if tag in ("p", "pre", "h1", "h2", "h3", "h4", "h5", "h6") else "\n")

    def handle_endtag(self, tag):
        if self.skip_tag:
            if tag == self.skip_tag:
                self.skip_depth -= 1
                if self.skip_depth == 0:
                    self.skip_tag = None
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in _HTML_BLOCK:
            self.out.append("\n")

    def handle_data(self, data):
        if self.skip_tag:
            return
        if not self.pre:
            data = re.sub(r"\s+", " ", data)
            if not self.out or self.out[-1].endswith("\n"):
                data = data.lstrip()
        self.out.append(data)


def html_to_text(html):
    """The visible text of an HTML page (no head, scripts, styles or DocBook navigation bars), block
    elements on their own lines, whitespace collapsed outside <pre>, at most one blank line in a row."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    text = "".join(parser.out)
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def render_man(path):
    """A man page rendered to plain text, 80 columns; None for a page that only aliases another (.so)."""
    for line in read_text(path).splitlines():
        if line.startswith(('.\\"', "'\\\"")) or not line.strip():
            continue
        if line.startswith(".so "):
            return None
        break
    env = dict(os.environ, MANWIDTH="80", LC_ALL="C.UTF-8", MAN_KEEP_FORMATTING="")
    env.pop("MAN_KEEP_FORMATTING")
    res = subprocess.run(["man", "-l", "-E", "UTF-8", "-P", "cat", str(path)], env=env,
                         capture_output=True, text=True, errors="replace")
    return res.stdout if res.returncode == 0 else None


def split_jargon(text):
    """The Jargon File as documents: its front matter, each chapter and appendix, the glossary's index, and
    its lexicon grouped by the first letter of the headword (an entry starts with an indented ":word:")."""
    docs, name, buf = [], "front matter", []
    for line in text.splitlines():
        head = re.match(r"(Chapter \d+|Appendix [A-Z]|Bibliography|Glossary)\b", line)
        entry = re.match(r"\s+:(\S)", line) if name.startswith(("Glossary", "lexicon")) else None
        new = head.group(1) if head else None
        if entry:
            new = "lexicon " + (entry.group(1).upper() if entry.group(1).isalpha() else "0-9")
        if new and new != name:
            docs.append((name, buf))
            name, buf = new, []
        buf.append(line)
    docs.append((name, buf))
    return [(n, "\n".join(b).strip() + "\n") for n, b in docs if "".join(b).strip()]


def split_bible(text):
    """The output of `bible` for the whole KJV as one document per book: chapter headings ("Genesis 1")
    kept, verse numbers dropped, one verse per line."""
    books, order = {}, []
    book, verse = None, []

    def flush():
        if book and verse:
            books[book].append(" ".join(verse))

    for line in text.splitlines():
        head = re.fullmatch(r"((?:[1-3] )?[A-Z][A-Za-z]*(?: of [A-Z][a-z]+)?) (\d+)", line.strip())
        if head and not line.startswith(" "):
            flush()
            verse = []
            book = head.group(1)
            if book not in books:
                books[book], order = [], order + [book]
            books[book].append(("\n" if books[book] else "") + line.strip() + "\n")
            continue
        m = re.match(r"\s+\d+ (.*)", line)
        if m:
            flush()
            verse = [m.group(1).strip()]
        elif line.strip() and book:
            verse.append(line.strip())
    flush()
    return [(b, "\n".join(books[b]).replace("\n\n\n", "\n\n").strip() + "\n") for b in order]


# ----------------------------------------------------------------------------------------------------
# sources

def _version_key(p):
    return [int(x) for x in re.findall(r"\d+", p.name)]


def _newest(paths):
    """The path whose name carries the highest version number (linux-doc-6.12 over linux-doc-6.1)."""
    paths = [p for p in paths if p.is_dir()]
    return max(paths, key=_version_key) if paths else None


def _pkg_roots(root, prefix):
    return sorted(root.glob(f"{prefix}*"), key=_version_key)


@dataclass
class Source:
    name: str
    packages: tuple     # "a|b" groups: every group is needed; of a group, the first package apt knows
    description: str

    def files(self, root):
        """The input files, sorted (what the document cache is keyed on)."""
        return sorted(_FILES[self.name](Path(root)))

    def documents(self, root, files, threads):
        """(name, text) pairs, in file order."""
        return _DOCS.get(self.name, _docs_per_file)(Path(root), files, threads)


SOURCES = [
    Source("kernel", ("linux-doc-6.12|linux-doc-6.1",),
           "Linux kernel Documentation/ reStructuredText and text files (translations/ excluded), one file each"),
    Source("python", ("python3.13-doc|python3.12-doc|python3.11-doc",),
           "Python documentation reStructuredText sources (html/_sources), one file each"),
    Source("man", ("manpages", "manpages-dev"),
           "Linux man-pages (sections 1-8) rendered with man -l, one page each (aliases skipped)"),
    Source("perl", ("perl-doc",), "Perl's POD manuals (perlfaq, perlretut, perlXXXdelta, ...), one file each"),
    Source("git", ("git-doc",), "Git's AsciiDoc manuals, howtos and technical notes, one file each"),
    Source("postgresql", ("postgresql-doc-17|postgresql-doc-16|postgresql-doc-15",),
           "The PostgreSQL manual (HTML reduced to text), one page each"),
    Source("gimp", ("gimp-help-en",), "The GIMP user manual (HTML reduced to text), one page each"),
    Source("sqlite", ("sqlite3-doc",), "The SQLite documentation (HTML reduced to text), one page each"),
    Source("libreoffice", ("libreoffice-help-en-us",), "LibreOffice's help (HTML reduced to text), one page each"),
    Source("octave", ("octave-doc",), "The GNU Octave manual (HTML reduced to text), one page each"),
    Source("debian", ("debian-handbook", "debian-reference-en"),
           "The Debian Administrator's Handbook (en-US) and the Debian Reference (HTML reduced to text), one page each"),
    Source("jargon", ("jargon-text",), "The Jargon File 4.4.7, one chapter or lexicon letter each"),
    Source("bible", ("bible-kjv", "bible-kjv-text"), "The King James Bible (public domain), one book each"),
]
SOURCE_NAMES = [s.name for s in SOURCES]


def _kernel_files(root):
    docs = _newest([d / "usr/share/doc" / d.name / "Documentation" for d in _pkg_roots(root, "linux-doc-")])
    if docs is None:
        return []
    return [p for pat in ("*.rst", "*.rst.gz", "*.txt", "*.txt.gz") for p in docs.rglob(pat)
            if "translations" not in p.relative_to(docs).parts]


def _python_files(root):
    docs = _newest([d / "usr/share/doc" / d.name.removesuffix("-doc") for d in _pkg_roots(root, "python3.")
                    if (d / "usr/share/doc" / d.name.removesuffix("-doc") / "html/_sources").is_dir()])
    return list((docs / "html/_sources").rglob("*.rst.txt")) if docs else []


def _man_files(root):
    # symlinked pages (acosf.3 -> acos.3) are aliases: read the target once
    return [p for pkg in ("manpages", "manpages-dev") for p in (root / pkg / "usr/share/man").glob("man[1-8]/*")
            if p.is_file() and not p.is_symlink()]


def _perl_files(root):
    return list((root / "perl-doc/usr/share/perl").glob("5*/pod/*.pod"))


def _git_files(root):
    return list((root / "git-doc/usr/share/doc/git-doc").rglob("*.txt"))


def _postgresql_files(root):
    pkg = _newest(_pkg_roots(root, "postgresql-doc-"))
    return list((pkg / "usr/share/doc" / pkg.name / "html").glob("*.html")) if pkg else []


def _gimp_files(root):
    return list((root / "gimp-help-en/usr/share/gimp/2.0/help/en").rglob("*.html"))


def _html_files(root, *patterns):
    return [p for pat in patterns for p in root.glob(pat) if p.is_file()]


def _jargon_files(root):
    return [p for p in [root / "jargon-text/usr/share/doc/jargon-text/jargon.txt.gz"] if p.is_file()]


def _bible_files(root):
    files = [root / "bible-kjv/usr/bin/bible", root / "bible-kjv-text/usr/lib/bible.data"]
    return files if all(p.is_file() for p in files) else []


_FILES = {"kernel": _kernel_files, "python": _python_files, "man": _man_files, "perl": _perl_files,
          "git": _git_files, "postgresql": _postgresql_files, "gimp": _gimp_files, "jargon": _jargon_files,
          "sqlite": lambda r: _html_files(r, "sqlite3-doc/usr/share/doc/sqlite3/**/*.html"),
          "libreoffice": lambda r: _html_files(r, "libreoffice-help-en-us/usr/share/libreoffice/help/en-US/**/*.html"),
          "octave": lambda r: _html_files(r, "octave-doc/usr/share/doc/octave/octave.html/*.html"),
          "debian": lambda r: _html_files(r, "debian-handbook/usr/share/doc/debian-handbook/html/en-US/*.html",
                                          "debian-reference-en/usr/share/debian-reference/**/*.en.html"),
          "bible": _bible_files}


def _docs_per_file(root, files, threads):
    for p in files:
        yield p.relative_to(root).as_posix(), read_text(p)


def _html_docs(root, files, threads):
    for p in files:
        yield p.relative_to(root).as_posix(), html_to_text(read_text(p))


def _man_docs(root, files, threads):
    if shutil.which("man") is None:
        raise DataError("the man command is missing: apt-get install man-db (it renders the man pages)")
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for p, text in zip(files, pool.map(render_man, files)):
            if text is not None:
                yield p.relative_to(root).as_posix(), text


def _jargon_docs(root, files, threads):
    for p in files:
        for name, text in split_jargon(read_text(p)):
            yield f"jargon/{name}", text


def _bible_docs(root, files, threads):
    exe, data = files
    res = subprocess.run([str(exe), "-p", str(data.parent), "-l80", "Ge1:1-Re22:21"],
                         capture_output=True, text=True, errors="replace")
    if res.returncode != 0 or not res.stdout.strip():
        raise DataError(f"{exe} failed (exit {res.returncode}): {res.stderr.strip()[:200]}")
    for name, text in split_bible(res.stdout):
        yield f"bible/{name}", text


_DOCS = {"man": _man_docs, "postgresql": _html_docs, "gimp": _html_docs, "sqlite": _html_docs,
         "libreoffice": _html_docs, "octave": _html_docs, "debian": _html_docs, "jargon": _jargon_docs,
         "bible": _bible_docs}


def fingerprint(root, files):
    """A hash of the input files' paths, sizes and mtimes, and of CACHE_VERSION."""
    h = hashlib.sha256(f"v{CACHE_VERSION}".encode())
    for p in files:
        st = p.stat()
        h.update(f"{p.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def load_source(source, root, cache_dir, threads, refresh=False, log=print):
    """The documents of one source as a list of (name, text), through the cache in cache_dir."""
    files = source.files(root)
    if not files:
        raise DataError(f"source {source.name}: no input files under {root} (packages {' '.join(source.packages)}); "
                        f"run bash data/build_prose_corpus.sh, which downloads and unpacks them")
    fp = fingerprint(root, files)
    cache = Path(cache_dir) / f"{source.name}.jsonl.gz"
    if cache.exists() and not refresh:
        with gzip.open(cache, "rt", encoding="utf-8") as f:
            head = json.loads(f.readline())
            if head.get("fingerprint") == fp:
                return [(d["name"], d["text"]) for d in map(json.loads, f)], len(files), True
    t0 = time.perf_counter()
    docs = list(source.documents(root, files, threads))
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = cache.with_name(cache.name + f".tmp{os.getpid()}")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=1) as f:
        f.write(json.dumps({"fingerprint": fp, "source": source.name}) + "\n")
        for name, text in docs:
            f.write(json.dumps({"name": name, "text": text}) + "\n")
    os.replace(tmp, cache)
    log(f"  read {source.name}: {len(files):,} files -> {len(docs):,} documents in {time.perf_counter() - t0:.0f}s")
    return docs, len(files), False


# ----------------------------------------------------------------------------------------------------
# filter, order, split

def split_long(text, max_chars):
    """Pieces of at most max_chars characters, cut at blank lines where possible (else at line ends,
    else hard)."""
    if len(text) <= max_chars:
        return [text]
    pieces, cur = [], ""
    for para in re.split(r"(?<=\n\n)", text):
        while len(para) > max_chars:  # one paragraph longer than a piece: cut at a line end, else hard
            cut = para.rfind("\n", 0, max_chars) + 1 or max_chars
            if cur:
                pieces.append(cur)
                cur = ""
            pieces.append(para[:cut])
            para = para[cut:]
        if len(cur) + len(para) > max_chars and cur:
            pieces.append(cur)
            cur = ""
        cur += para
    if cur:
        pieces.append(cur)
    return pieces


def filter_documents(docs, min_chars=200, max_doc_chars=200_000, seen=None):
    """Cut, then drop tiny, non-prose and duplicate documents. docs: (name, text) pairs.
    Returns (kept (name, text) pairs, counts dict). `seen`: text hashes kept so far (shared across
    sources so that a duplicate in a later source is dropped too); updated in place."""
    seen = set() if seen is None else seen
    kept, counts = [], {"pieces": 0, "tiny": 0, "not_prose": 0, "duplicate": 0}
    for name, text in docs:
        pieces = split_long(text, max_doc_chars)
        for k, piece in enumerate(pieces):
            counts["pieces"] += 1
            piece = piece.strip() + "\n"
            if len(piece.strip()) < min_chars:
                counts["tiny"] += 1
                continue
            if not is_prose(piece):
                counts["not_prose"] += 1
                continue
            h = hashlib.sha256(piece.encode("utf-8", errors="replace")).digest()
            if h in seen:
                counts["duplicate"] += 1
                continue
            seen.add(h)
            kept.append((f"{name}#{k}" if len(pieces) > 1 else name, piece))
    return kept, counts


def shuffle_documents(docs, seed):
    """docs: (source, name, text) triples. Sorted by (source, name), then shuffled with random.Random(seed):
    the same set of documents always gives the same order, whatever order they were read in."""
    docs = sorted(docs, key=lambda d: (d[0], d[1]))
    random.Random(seed).shuffle(docs)
    return docs


def split_flags(n, seed, val_fraction):
    """is_val for each of n documents in shuffled order (tokenize_corpus.is_val: the split the shards get)."""
    return [is_val(seed, i, val_fraction) for i in range(n)]


def straddling(docs, flags):
    """The val documents that are pieces of a long document (split_long's NAME#k) with a sibling piece in the
    train split: [(number in the val split, source, name, sibling pieces in train)]. The split is by piece, so
    such a piece is scored on text the model may have trained next to (records/cpu_speedrun: the test slice)."""
    book = lambda src, name: (src, name.rsplit("#", 1)[0])  # noqa: E731
    in_train = collections.Counter(book(src, name) for (src, name, _), v in zip(docs, flags) if not v and "#" in name)
    val = [(src, name) for (src, name, _), v in zip(docs, flags) if v]
    return [(i, src, name, in_train[book(src, name)]) for i, (src, name) in enumerate(val)
            if "#" in name and in_train[book(src, name)]]


# ----------------------------------------------------------------------------------------------------
# tokenizer

def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("the tokenizers library is missing: pip install -r experiments/requirements.txt") from None
    return tokenizers


def train_tokenizer(texts, vocab_size, threads=None):
    """Byte-level BPE with vocab_size - 1 learned entries (fewer if the texts are too small to learn them)
    and BOS_TOKEN appended as the last id. Returns the tokenizers.Tokenizer."""
    tk = _tokenizers()
    if threads:
        os.environ["RAYON_NUM_THREADS"] = str(threads)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size - 1, min_frequency=2, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    texts = list(texts)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.add_special_tokens([BOS_TOKEN])
    return tok


class HFEncoding:
    """A trained tokenizers.Tokenizer in the interface tokenize_corpus expects (n_vocab, eot_token,
    encode_ordinary, encode_ordinary_batch). BOS is the last id; a literal BOS_TOKEN in a text stays
    text. `lengths` records the number of tokens of every text encoded, in order."""

    def __init__(self, tok, name):
        self.tok, self.name = tok, name
        self.n_vocab = tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = tok.token_to_id(BOS_TOKEN)
        assert self.eot_token == self.n_vocab - 1, (self.eot_token, self.n_vocab)
        tok.encode_special_tokens = True  # "<|bos|>" in a document is text, never the BOS id
        self.lengths = []

    def encode_ordinary(self, text):
        ids = self.tok.encode(text, add_special_tokens=False).ids
        self.lengths.append(len(ids))
        return ids

    def encode_ordinary_batch(self, texts, num_threads=1):
        out = [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]
        self.lengths.extend(len(ids) for ids in out)
        return out

    def decode(self, ids):
        return self.tok.decode([i for i in ids if i != self.eot_token])


class ProseBytes(ByteEncoding):
    """UTF-8 bytes (vocabulary 257, BOS 256): the byte-level control, `--vocab_sizes 257`. No tokenizer is
    trained; `lengths` as HFEncoding's."""

    def __init__(self):
        self.lengths = []

    def encode_to_array(self, text):
        ids = super().encode_to_array(text)
        self.lengths.append(len(ids))
        return ids


def load_or_train_tokenizer(out_dir, vocab_size, train_texts, train_fp, threads, log=print):
    """data/prose<V>/tokenizer.json, retrained unless meta.json records the same train documents and V."""
    tk = _tokenizers()
    out_dir = Path(out_dir)
    path, meta_path = out_dir / "tokenizer.json", out_dir / "meta.json"
    if path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta.get("train_fingerprint") == train_fp and meta.get("requested_vocab_size") == vocab_size:
            log(f"  tokenizer V={vocab_size}: reusing {path.name} (same train documents)")
            return tk.Tokenizer.from_file(str(path))
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, vocab_size, threads)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    got = tok.get_vocab_size(with_added_tokens=True)
    meta_path.write_text(json.dumps({"requested_vocab_size": vocab_size, "vocab_size": got, "bos_id": got - 1,
                                     "bos_token": BOS_TOKEN, "train_fingerprint": train_fp}, indent=1) + "\n")
    log(f"  tokenizer V={vocab_size}: trained in {time.perf_counter() - t0:.0f}s"
        + ("" if got == vocab_size else f" (only {got} entries: the train text is too small for more)"))
    return tok


# ----------------------------------------------------------------------------------------------------
# the build

def build(work=DEFAULT_WORK, out_base=HERE, vocab_sizes=(8192,), sources=SOURCE_NAMES, seed=0,
          val_fraction=0.07, min_chars=200, max_doc_chars=200_000, threads=None, refresh=False, log=print):
    """The whole pipeline (steps 2-6 of the module docstring). Returns a summary dict."""
    t0 = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    root, cache_dir = Path(work) / "root", Path(work) / "docs"
    log(f"documents (min {min_chars} chars, pieces of at most {max_doc_chars:,} chars, prose filter, exact duplicates)")
    log(f"{'source':12s} {'files':>6s} {'docs':>6s} {'pieces':>6s} {'tiny':>5s} {'!prose':>6s} {'dup':>5s} {'kept':>6s} {'MB kept':>8s}")
    all_docs, seen, per_source = [], set(), {}
    for s in (src for src in SOURCES if src.name in sources):
        docs, nfiles, cached = load_source(s, root, cache_dir, threads, refresh, log)
        kept, c = filter_documents(docs, min_chars, max_doc_chars, seen)
        mb = sum(len(t) for _, t in kept) / 1e6
        per_source[s.name] = dict(files=nfiles, docs=len(docs), kept=len(kept), chars=int(mb * 1e6), **c)
        log(f"{s.name:12s} {nfiles:6,d} {len(docs):6,d} {c['pieces']:6,d} {c['tiny']:5,d} {c['not_prose']:6,d} "
            f"{c['duplicate']:5,d} {len(kept):6,d} {mb:8.1f}" + (" (cached)" if cached else ""))
        all_docs.extend((s.name, n, t) for n, t in kept)
    if len(all_docs) < 2:
        raise DataError(f"only {len(all_docs)} document(s) survived the filters; at least 2 are needed")
    tot = {k: sum(v[k] for v in per_source.values()) for k in ("files", "docs", "pieces", "tiny", "not_prose", "duplicate", "kept", "chars")}
    log(f"{'total':12s} {tot['files']:6,d} {tot['docs']:6,d} {tot['pieces']:6,d} {tot['tiny']:5,d} {tot['not_prose']:6,d} "
        f"{tot['duplicate']:5,d} {tot['kept']:6,d} {tot['chars'] / 1e6:8.1f}")

    docs = shuffle_documents(all_docs, seed)
    flags = split_flags(len(docs), seed, val_fraction)
    train_texts = [t for (_, _, t), v in zip(docs, flags) if not v]
    h = hashlib.sha256(f"{seed}:{val_fraction}".encode())
    for t in train_texts:
        h.update(hashlib.sha256(t.encode("utf-8", errors="replace")).digest())
    train_fp = h.hexdigest()
    log(f"shuffled with seed {seed}; split: {len(docs) - sum(flags):,} train / {sum(flags):,} val documents "
        f"(val_fraction {val_fraction})")
    for i, src, name, n in straddling(docs, flags):
        log(f"  val document {i} ({src} {name}) is a piece of a long document with {n} piece(s) in train")

    summary = {"sources": per_source, "documents": len(docs), "seed": seed, "val_fraction": val_fraction,
               "vocab": {}}
    for V in vocab_sizes:
        out_dir = Path(out_base) / f"prose{V}"
        log(f"\nvocabulary {V}: {out_dir.name}/")
        if V == BYTE_VOCAB:
            enc = ProseBytes()
        else:
            enc = HFEncoding(load_or_train_tokenizer(out_dir, V, train_texts, train_fp, threads, log), f"bpe{V}")
        res = tokenize_corpus((t for _, _, t in docs), enc, out_dir, f"prose{enc.n_vocab}",
                              val_fraction=val_fraction, seed=seed, num_threads=threads, log=lambda m: log("  " + m))
        assert res["docs"]["val"] == sum(flags), "the shards' split differs from the tokenizer's train split"
        for f in res["files"]:
            hd = read_shard_header(f)
            assert hd["vocab_size"] == enc.n_vocab and (hd["version"] == 1) == (enc.n_vocab <= 65536)
        # tokens per source and split (BOS included, as in the shards)
        table = {}
        for (src, _, _), v, n in zip(docs, flags, enc.lengths):
            row = table.setdefault(src, {"train_docs": 0, "val_docs": 0, "train_tokens": 0, "val_tokens": 0})
            split = "val" if v else "train"
            row[f"{split}_docs"] += 1
            row[f"{split}_tokens"] += n + 1
        log(f"  {'source':12s} {'train docs':>10s} {'train tokens':>13s} {'val docs':>8s} {'val tokens':>11s} {'chars/token':>11s}")
        for src in [s for s in SOURCE_NAMES if s in table]:
            r = table[src]
            cpt = per_source[src]["chars"] / max(1, r["train_tokens"] + r["val_tokens"])
            log(f"  {src:12s} {r['train_docs']:10,d} {r['train_tokens']:13,d} {r['val_docs']:8,d} {r['val_tokens']:11,d} {cpt:11.2f}")
        tr, va = res["tokens"]["train"], res["tokens"]["val"]
        log(f"  {'total':12s} {res['docs']['train']:10,d} {tr:13,d} {res['docs']['val']:8,d} {va:11,d} "
            f"{tot['chars'] / (tr + va):11.2f}")
        log(f"  V = {enc.n_vocab}, BOS = {enc.eot_token}; V/D = {enc.n_vocab / 128:.0f} at D = 128, "
            f"{enc.n_vocab / 192:.0f} at D = 192, {enc.n_vocab / 768:.1f} at D = 768")
        ok_total, ok_val = tr + va >= TARGET_TOKENS, va >= TARGET_VAL_TOKENS and res["docs"]["val"] >= TARGET_VAL_DOCS
        log(f"  targets: >= {TARGET_TOKENS / 1e6:.0f}M tokens: {'met' if ok_total else 'NOT met'}; val >= "
            f"{TARGET_VAL_TOKENS / 1e6:.0f}M tokens from >= {TARGET_VAL_DOCS} documents: {'met' if ok_val else 'NOT met'}")
        summary["vocab"][V] = {"vocab_size": enc.n_vocab, "bos": enc.eot_token, "docs": res["docs"],
                               "tokens": res["tokens"], "per_source": table, "files": res["files"]}
    log(f"\ndone in {time.perf_counter() - t0:.0f}s")
    return summary


# ----------------------------------------------------------------------------------------------------
# command line

def _int_list(s):
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return vals


def parse_args(argv=None):
    p = OneLineParser(description="Build the English prose corpus, its BPE tokenizers and shards "
                                  "(run through bash data/build_prose_corpus.sh, which downloads the packages).")
    p.add_argument("--vocab_sizes", type=_int_list, default=[8192],
                   help="comma-separated vocabulary sizes, BOS included (default 8192; e.g. 2048,8192,32768; "
                        "257: UTF-8 bytes, no tokenizer)")
    p.add_argument("--work_dir", default=str(DEFAULT_WORK),
                   help="folder with root/ (unpacked packages) and docs/ (document cache); default data/prose")
    p.add_argument("--out_base", default=str(HERE), help="shards go to OUT_BASE/prose<V>/ (default: data/)")
    p.add_argument("--sources", default=",".join(SOURCE_NAMES), help=f"comma-separated subset of {','.join(SOURCE_NAMES)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the document shuffle and of the val/train split")
    p.add_argument("--val_fraction", type=float, default=0.07, help="share of documents held out for val (default 0.07)")
    p.add_argument("--min_chars", type=int, default=200, help="drop documents shorter than this (default 200)")
    p.add_argument("--max_doc_chars", type=int, default=200_000,
                   help="cut longer documents at paragraph breaks into pieces of at most this (default 200000)")
    p.add_argument("--threads", type=int, default=None, help="threads for rendering and tokenizing (default: all CPUs)")
    p.add_argument("--refresh", action="store_true", help="re-read every source instead of using data/prose/docs/")
    p.add_argument("--list_packages", action="store_true",
                   help="print the Debian packages, one line per needed package: SOURCE ALTERNATIVE|ALTERNATIVE... (and exit)")
    args = p.parse_args(argv)
    bad = [v for v in args.vocab_sizes if not (512 <= v <= 2**20 or v == BYTE_VOCAB)]
    if bad:
        p.error(f"--vocab_sizes must be 257 (bytes) or lie in [512, 1048576] (256 byte tokens + merges + BOS), "
                f"got {bad[0]}")
    srcs = [s.strip() for s in args.sources.split(",") if s.strip()]
    unknown = [s for s in srcs if s not in SOURCE_NAMES]
    if unknown or not srcs:
        p.error(f"unknown source {unknown[0] if unknown else '(none)'!r}; choose from {','.join(SOURCE_NAMES)}")
    args.sources = srcs
    if not 0.0 < args.val_fraction < 1.0:
        p.error(f"--val_fraction must lie strictly between 0 and 1 (got {args.val_fraction})")
    if args.min_chars < 1 or args.max_doc_chars < max(1000, args.min_chars):
        p.error("--min_chars must be >= 1 and --max_doc_chars >= max(1000, --min_chars)")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.list_packages:
        for s in SOURCES:
            if s.name in args.sources:
                for group in s.packages:
                    print(s.name, group)
        return 0
    try:
        build(args.work_dir, args.out_base, args.vocab_sizes, args.sources, args.seed, args.val_fraction,
              args.min_chars, args.max_doc_chars, args.threads, args.refresh)
    except (DataError, InputError, OutputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
