"""The data tools: data/tokenize_corpus.py, data/cached_fineweb10B.py and the prose corpus's builder
(data/prose_corpus.py, data/build_prose_corpus.sh), with experiments/copy_share.py, which reads its trees."""
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import train_gpt_cplm as tg
from conftest import (DOWNLOAD, ELF, PNG, ROOT, TOKENIZE, _load, _load_experiment, _run, _text_files,
                      assert_one_line)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ====================================================================================================
# data/tokenize_corpus.py and data/cached_fineweb10B.py

tc = _load("data/tokenize_corpus.py")
dl = _load("data/cached_fineweb10B.py")


def _split_docs(tokens, bos):
    """Split a token stream into documents at BOS (each document starts with BOS)."""
    starts = np.flatnonzero(tokens == bos).tolist()
    assert starts and starts[0] == 0, "stream must start with BOS"
    return [tokens[a:b] for a, b in zip(starts, starts[1:] + [len(tokens)])]


def _read_split(out_dir, name, split):
    files = sorted(Path(out_dir).glob(f"{name}_{split}_*.bin"))
    headers, arrays = zip(*(tc.read_shard(f) for f in files))
    return files, list(headers), np.concatenate(arrays)


def _make_corpus(root):
    """Files on disk + the documents they should produce, in order, for inputs [a.txt, tree/, e.jsonl]."""
    (root / "tree" / "sub").mkdir(parents=True)
    (root / "tree" / ".hidden").mkdir()
    files = {
        "a.txt": "plain text file\nwith two lines\n",
        "tree/b.md": "# markdown\n",
        "tree/c.py": "print('hi')  # <|endoftext|> is just text here\n",
        "tree/sub/d.txt": "caf\u00e9 \u2603 non-ascii\n",
        "tree/empty.txt": "  \n\n",          # whitespace only: skipped
        "tree/skip.bin": "not matched by --glob",  # filtered out
        "tree/.hidden/h.txt": "hidden folder: skipped",
    }
    for rel, text in files.items():
        (root / rel).write_text(text, encoding="utf-8")
    (root / "tree" / "sub" / "bad.txt").write_bytes(b"bad \xff\xfe bytes\n")  # undecodable: replaced
    records = [{"text": "first json doc", "id": 1}, {"text": ""}, {"text": "second \"json\" doc\n"},
               {"text": "third <|endoftext|> doc"}]
    (root / "e.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    docs = [files["a.txt"], files["tree/b.md"], files["tree/c.py"], "bad \ufffd\ufffd bytes\n", files["tree/sub/d.txt"],
            "first json doc", "second \"json\" doc\n", "third <|endoftext|> doc"]
    return [root / "a.txt", root / "tree", root / "e.jsonl"], docs


# ----------------------------------------------------------------------------------------------------
# tokenize_corpus.py

def test_bytes_corpus_split_and_headers(tmp_path, capsys):
    inputs, docs = _make_corpus(tmp_path)
    out = tmp_path / "out"
    frac, seed = 0.4, 3
    rc = tc.main([*map(str, inputs), "--encoding", "bytes", "--out_dir", str(out), "--name", "toy",
                  "--val_fraction", str(frac), "--seed", str(seed)])
    assert rc == 0
    assert "docs" in capsys.readouterr().out
    expected = [np.array([256] + list(d.encode("utf-8")), dtype=np.uint32) for d in docs]
    got = {}
    for split in ("val", "train"):
        files, headers, tokens = _read_split(out, "toy", split)
        assert [f.name for f in files] == [f"toy_{split}_000000.bin"]
        for h, f in zip(headers, files):
            assert (h["magic"], h["version"], h["vocab_size"]) == (20240520, 1, 257)
            assert f.stat().st_size == 1024 + 2 * h["num_tokens"]
        assert sum(h["num_tokens"] for h in headers) == len(tokens)
        got[split] = _split_docs(tokens, 256)
    # the split follows the hash rule (unless a split would be empty), is disjoint and covers every doc in order
    val_idx = [i for i in range(len(docs)) if tc.is_val(seed, i, frac)]
    assert 0 < len(val_idx) < len(docs), "pick a seed giving both splits for this test"
    assert [d.tolist() for d in got["val"]] == [expected[i].tolist() for i in val_idx]
    assert [d.tolist() for d in got["train"]] == [expected[i].tolist() for i in range(len(docs)) if i not in val_idx]
    assert sum(map(len, got["val"] + got["train"])) == sum(map(len, expected))
    assert not list(out.glob(".*")), "no temporary files left"


def test_shard_cutting_stale_files_and_max_tokens(tmp_path):
    inputs, docs = _make_corpus(tmp_path)
    out = tmp_path / "out"
    stream = np.concatenate([[256] + list(d.encode("utf-8")) for d in docs])
    common = [*map(str, inputs), "--encoding", "bytes", "--out_dir", str(out), "--name", "s", "--val_fraction", "0.2"]
    assert tc.main(common + ["--shard_tokens", "16"]) == 0
    train_files, headers, train = _read_split(out, "s", "train")
    _, _, val = _read_split(out, "s", "val")
    assert len(train_files) > 3 and all(h["num_tokens"] == 16 for h in headers[:-1])
    assert 1 <= headers[-1]["num_tokens"] <= 16 and train[0] == 256
    assert len(train) + len(val) == len(stream)
    # a rerun with bigger shards replaces the set: no stale shard of the earlier run remains
    assert tc.main(common + ["--shard_tokens", "1000000"]) == 0
    assert [f.name for f in sorted(out.glob("s_*.bin"))] == ["s_train_000000.bin", "s_val_000000.bin"]
    # --max_tokens caps the total (the last document is truncated), both splits still non-empty
    assert tc.main(common + ["--max_tokens", "40"]) == 0
    _, _, train = _read_split(out, "s", "train")
    _, _, val = _read_split(out, "s", "val")
    assert len(train) + len(val) == 40 and train[0] == 256 and val[0] == 256


def test_small_corpus_forces_both_splits(tmp_path):
    (tmp_path / "x.txt").write_text("one")
    (tmp_path / "y.txt").write_text("two")
    out = tmp_path / "out"
    assert tc.main([str(tmp_path / "x.txt"), str(tmp_path / "y.txt"), "--encoding", "bytes",
                    "--out_dir", str(out), "--name", "p"]) == 0
    _, _, val = _read_split(out, "p", "val")
    _, _, train = _read_split(out, "p", "train")
    assert len(_split_docs(val, 256)) == 1 and len(_split_docs(train, 256)) == 1


class _WideEncoding:
    """A fake tokenizer whose ids exceed uint16."""
    name, n_vocab, eot_token = "wide", 70_000, 69_999

    def encode_ordinary(self, text):
        return [65_536 + ord(c) % 4000 for c in text]


def test_version2_when_ids_exceed_uint16(tmp_path):
    docs = ["abc", "hello world", "zzz", "more text"]
    summary = tc.tokenize_corpus(iter(docs), _WideEncoding(), tmp_path, "w", val_fraction=0.3, num_threads=1,
                                 log=lambda *a: None)
    assert summary["versions"] == [2]
    alltok = []
    for split in ("val", "train"):
        files, headers, tokens = _read_split(tmp_path, "w", split)
        assert all((h["version"], h["vocab_size"]) == (2, 70_000) for h in headers)
        assert all(f.stat().st_size == 1024 + 4 * h["num_tokens"] for f, h in zip(files, headers))
        assert tokens.dtype == np.uint32 and tokens[0] == 69_999
        alltok.append(tokens)
    assert sorted(np.concatenate(alltok).tolist()) == sorted(
        sum(([69_999] + _WideEncoding().encode_ordinary(d) for d in docs), []))
    # write_shard on its own: uint16 up to a 65536 vocabulary, ids checked against the vocabulary
    p = tmp_path / "one.bin"
    assert tc.write_shard(p, [0, 65_535], 65_536) == 1
    assert tc.read_shard(p)[1].tolist() == [0, 65_535]
    with pytest.raises(ValueError):
        tc.write_shard(p, [50_257], 50_257)
    p.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError):
        tc.read_shard_header(p)


@pytest.mark.skipif(not os.environ.get("TIKTOKEN_CACHE_DIR"),
                    reason="needs GPT-2's tokenizer files offline: set TIKTOKEN_CACHE_DIR to a folder holding them "
                           "(tiktoken fills one on first use with internet)")
def test_gpt2_roundtrip(tmp_path):
    try:
        enc = tc.load_encoding("gpt2")
    except tc.TokenizerUnavailable:
        pytest.skip("TIKTOKEN_CACHE_DIR holds no gpt2 files: run tiktoken.get_encoding('gpt2') once with "
                    "internet and that folder set")
    inputs, docs = _make_corpus(tmp_path)
    out = tmp_path / "out"
    assert tc.main([*map(str, inputs), "--out_dir", str(out), "--name", "g", "--val_fraction", "0.3",
                    "--threads", "2"]) == 0
    decoded = []
    for split in ("val", "train"):
        _, headers, tokens = _read_split(out, "g", split)
        assert all((h["version"], h["vocab_size"]) == (1, 50_257) for h in headers)
        decoded += [(i, enc.decode(d[1:].tolist())) for i, d in enumerate(_split_docs(tokens, 50_256))]
    # a literal "<|endoftext|>" in the text is plain text, not a BOS: one BOS per document exactly
    assert sorted(t for _, t in decoded) == sorted(docs)


def test_gpt2_unavailable_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    import tiktoken

    def offline(name):
        raise ConnectionError("no route to openaipublic.blob.core.windows.net")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    (tmp_path / "a.txt").write_text("x")
    rc = tc.main([str(tmp_path / "a.txt"), "--out_dir", str(tmp_path / "o"), "--name", "n"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert "GPT-2 tokenizer" in err[0] and "TIKTOKEN_CACHE_DIR" in err[0] and "--encoding bytes" in err[0]


def test_bad_inputs_exit_2_nothing_written(tmp_path):
    out = tmp_path / "out"
    r = _run([TOKENIZE, tmp_path / "missing.txt", "--encoding", "bytes", "--out_dir", out, "--name", "m"])
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "missing.txt" in r.stderr
    r = _run([TOKENIZE, "--encoding", "bytes", "--out_dir", out, "--name", "m"])  # no input at all
    assert r.returncode == 2
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\nnot json\n')
    r = _run([TOKENIZE, tmp_path / "ok.txt", tmp_path / "bad.jsonl", "--encoding", "bytes", "--out_dir", out,
              "--name", "m"])
    assert r.returncode == 2 and "bad.jsonl:3" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() or not any(out.iterdir()), "nothing (not even a temporary file) is left"
    r = _run([TOKENIZE, tmp_path / "ok.txt", "--encoding", "bytes", "--out_dir", out, "--name", "m"])
    assert r.returncode == 2 and "at least 2" in r.stderr  # a single document cannot be split


def test_stdlib_listing():
    files = tc.stdlib_files()
    assert len(files) > 500 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert files == tc.stdlib_files()  # deterministic


# ----------------------------------------------------------------------------------------------------
# cached_fineweb10B.py

UNREACHABLE = {"HF_ENDPOINT": "http://127.0.0.1:9"}


def _fake_shard(path, ntok=5):
    path.parent.mkdir(parents=True, exist_ok=True)
    tc.write_shard(path, np.full(ntok, 50256), 50257)


def test_download_skips_present_files(tmp_path):
    # a copy of the script in a fresh folder: the default target is next to the script, whatever the cwd
    (tmp_path / "data").mkdir()
    script = tmp_path / "data" / "cached_fineweb10B.py"
    script.write_text(DOWNLOAD.read_text())
    for name in ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]:
        _fake_shard(tmp_path / "data" / "fineweb10B" / name)
    r = _run([script, "2"], UNREACHABLE, unset=["HF_HUB_OFFLINE"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    skipped = [l for l in r.stdout.splitlines() if l.startswith("skip ")]
    assert len(skipped) == 3 and str(tmp_path / "data" / "fineweb10B") in skipped[0]
    assert "fineweb_train_000002.bin" in skipped[2]
    # --edu uses its own names and folder
    for name in ["finewebedu_val_000000.bin", "finewebedu_train_000001.bin"]:
        _fake_shard(tmp_path / "edu" / name)
    r = _run([script, "1", "--edu", "--dir", tmp_path / "edu"], UNREACHABLE, unset=["HF_HUB_OFFLINE"])
    assert r.returncode == 0, r.stderr
    assert sum(l.startswith("skip ") for l in r.stdout.splitlines()) == 2


def test_download_unreachable_hub_one_line_exit_1(tmp_path):
    target = tmp_path / "fw"
    r = _run([DOWNLOAD, "1", "--dir", target], UNREACHABLE, unset=["HF_HUB_OFFLINE"])
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "huggingface.co" in lines[0] and "fineweb_val_000000.bin" in lines[0]
    assert not target.exists(), "nothing left behind"


def test_download_bad_args_and_broken_local_file(tmp_path):
    assert _run([DOWNLOAD, "0", "--dir", tmp_path]).returncode == 2
    assert _run([DOWNLOAD, "two", "--dir", tmp_path]).returncode == 2
    (tmp_path / "fineweb_val_000000.bin").write_bytes(b"\0" * 2000)  # not a shard
    r = _run([DOWNLOAD, "1", "--dir", tmp_path], UNREACHABLE, unset=["HF_HUB_OFFLINE"])
    assert r.returncode == 1 and "delete it" in r.stderr


def test_download_failure_midway_leaves_no_partial_file(tmp_path, monkeypatch):
    import huggingface_hub
    calls, failing = [], {"fineweb_train_000001.bin"}

    def fake_download(repo_id, filename, repo_type, local_dir):
        assert repo_type == "dataset" and repo_id == "kjj0/fineweb10B-gpt2"
        calls.append(filename)
        if filename in failing:  # dies half way, as hf_hub_download would: a partial .incomplete file
            hfdir = Path(local_dir) / ".cache" / "huggingface" / "download"
            hfdir.mkdir(parents=True, exist_ok=True)
            (hfdir / f"abc.{filename}.incomplete").write_bytes(b"partial")
            raise OSError("connection reset by peer")
        _fake_shard(Path(local_dir) / filename)
        return str(Path(local_dir) / filename)

    monkeypatch.setattr(dl, "_hub_unreachable", lambda endpoint: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    target = tmp_path / "fw"
    assert dl.download(2, local_dir=target, out=lambda *a: None) == 1
    assert calls == ["fineweb_val_000000.bin", "fineweb_train_000001.bin"]
    assert sorted(p.name for p in target.iterdir()) == [".cache", "fineweb_val_000000.bin"]
    assert not list(target.rglob("*.incomplete"))
    # the rerun skips the finished file and fetches the rest
    calls.clear()
    failing.clear()
    assert dl.download(2, local_dir=target, out=lambda *a: None) == 0
    assert calls == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]


# ----------------------------------------------------------------------------------------------------
# data/tokenize_corpus.py


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_tokenize_unwritable_out_dir_is_one_line_exit_1(tmp_path, where):
    inputs = _text_files(tmp_path / "in")
    (tmp_path / "plain").write_text("a regular file")
    out = tmp_path / "plain" / "shards" if where == "under_a_file" else tmp_path / "plain"
    r = _run([TOKENIZE, *inputs, "--encoding", "bytes", "--out_dir", out, "--name", "t"])
    assert r.returncode == 1
    assert_one_line(r.stderr, "--out_dir", str(out))
    assert (tmp_path / "plain").read_text() == "a regular file"


def test_tokenize_removes_temporary_files_of_a_killed_run(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # what a killed run leaves: a shard written under its temporary name, never renamed
    killed = tc._SplitWriter(out, "t", "train", 4, 257)
    killed.add(np.arange(6, dtype=np.uint32))
    stale = killed.written[0][0]
    assert stale.exists() and stale.name.startswith(".t_train_000000.bin.tmp")
    other = out / ".other_train_000000.bin.tmp1"  # another corpus's: not ours to remove
    other.write_bytes(b"x")
    assert tc.main([*map(str, _text_files(tmp_path / "in")), "--encoding", "bytes", "--out_dir", str(out),
                    "--name", "t"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "interrupted run" in line]
    assert len(said) == 1 and stale.name in said[0]
    assert not stale.exists() and other.exists()
    assert sorted(p.name for p in out.iterdir()) == [other.name, "t_train_000000.bin", "t_val_000000.bin"]


def test_tokenize_leaves_other_corpora_alone(tmp_path, capsys):
    """The stale-shard clean-up removes only this corpus's own shards: corpus x must not take x_val's
    (x_val_train_000000.bin once matched x_val_*.bin), and a name with glob characters is refused."""
    out = tmp_path / "out"
    out.mkdir()
    inputs = [*map(str, _text_files(tmp_path / "in"))]
    others = [out / n for n in ("x_val_train_000000.bin", "x_val_val_000000.bin", "x_train_000000.bin.bak",
                                "xx_train_000000.bin", ".x_val_train_000000.bin.tmp9")]
    for f in others:
        f.write_bytes(b"another corpus")
    assert tc.main(inputs + ["--encoding", "bytes", "--out_dir", str(out), "--name", "x"]) == 0
    assert all(f.read_bytes() == b"another corpus" for f in others)
    for name in ("*", "x?", "[x]", "../x", ""):
        with pytest.raises(SystemExit) as e:
            tc.main(inputs + ["--encoding", "bytes", "--out_dir", str(out), "--name", name])
        assert e.value.code == 2
    assert all(f.exists() for f in others) and (out / "x_train_000000.bin").exists()


def test_tokenize_skips_binary_files(tmp_path, capsys):
    folder = tmp_path / "tree"
    _text_files(folder)
    (folder / "logo.txt").write_bytes(PNG + b"\x00" * 64)  # matches --glob, but is an image
    elf = tmp_path / "prog"
    elf.write_bytes(ELF + b"text after the header")  # named explicitly
    out = tmp_path / "out"
    assert tc.main([str(folder), str(elf), "--encoding", "bytes", "--out_dir", str(out), "--name", "t"]) == 0
    notices = [line for line in capsys.readouterr().out.splitlines() if line.startswith("skipping binary file")]
    assert len(notices) == 2 and "logo.txt" in notices[0] and str(elf) in notices[1]
    tokens = np.concatenate([tc.read_shard(p)[1] for p in sorted(out.glob("t_*.bin"))])
    assert (tokens == 256).sum() == 2 and 0 not in tokens  # the two text documents, and no NUL byte


def test_tokenize_only_binary_inputs_is_one_line_exit_1(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    (tmp_path / "b.bin").write_bytes(ELF)
    out = tmp_path / "out"
    r = _run([TOKENIZE, tmp_path / "a.png", tmp_path / "b.bin", "--encoding", "bytes", "--out_dir", out, "--name", "t"])
    assert r.returncode == 1
    assert_one_line(r.stderr, "binary")
    assert not out.exists() or not any(out.iterdir()), "nothing written"


# ----------------------------------------------------------------------------------------------------
# data/cached_fineweb10B.py


def test_download_docstring_and_help_agree_with_the_code(capsys):
    default = dl.parse_args([]).num_train
    usage = re.search(r"cached_fineweb10B\.py +# val shard \+ first (\d+) train shards", dl.__doc__)
    assert usage and int(usage.group(1)) == default
    hp = tg.Hyperparameters()  # the speedrun preset
    tokens = hp.num_iterations * hp.batch_size + 1  # the loader reads one token past each batch
    need = math.ceil(tokens / 100_000_000)
    assert default >= need
    assert f"{need} train shards the speedrun reads" in dl.__doc__
    with pytest.raises(SystemExit):
        dl.parse_args(["--help"])
    assert f"{hp.num_iterations} x {hp.batch_size:,} tokens = {tokens / 1e8:.1f} shards" in \
        " ".join(capsys.readouterr().out.split())


def test_download_dir_under_a_file_is_one_line_exit_1(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    def must_not_download(**kwargs):
        raise AssertionError("downloaded into an impossible folder")
    monkeypatch.setattr(dl, "_hub_unreachable", lambda endpoint: None)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", must_not_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    (tmp_path / "plain").write_text("a regular file")
    target = tmp_path / "plain" / "fw"
    assert dl.download(1, local_dir=target, out=lambda *a: None) == 1
    assert_one_line(capsys.readouterr().err, str(target), "--dir")


def test_download_a_folder_where_a_shard_should_be_is_one_line_exit_1(tmp_path, capsys):
    """A directory named like a shard was an IsADirectoryError traceback."""
    (tmp_path / "fineweb_val_000000.bin").mkdir()
    assert dl.download(0, local_dir=tmp_path, out=lambda *a: None) == 1
    assert_one_line(capsys.readouterr().err, "fineweb_val_000000.bin", "not a regular file")


# ----------------------------------------------------------------------------------------------------
# the prose corpus builder (data/prose_corpus.py) and experiments/copy_share.py: tiny trees, no apt, no network


pc = _load("data/prose_corpus.py")
cs = _load_experiment("copy_share")

PROSE = ("The kernel keeps a list of the tasks that are ready to run, and it picks the next one when the\n"
         "current task blocks or uses up its time slice. This is what we call scheduling, and it is one of\n"
         "the oldest problems in the design of an operating system; it has been studied for decades.\n")
CODE = ("static int foo(struct bar *b)\n{\n\tint i, n = b->len;\n\tfor (i = 0; i < n; i++)\n"
        "\t\tb->v[i] = bar_get(b, i) + 1;\n\treturn n ? b->v[0] : -EINVAL;\n}\n") * 3
TABLE = ("| 0x00 | RESET   | 0   | r/w | 32 |\n| 0x04 | STATUS  | 1   | ro  | 16 |\n"
         "| 0x08 | CONTROL | 0xff | rw | 8 |\n") * 4
GERMAN = ("Der Kern verwaltet eine Liste der Aufgaben, die bereit sind, und er wählt die nächste aus, wenn\n"
          "die aktuelle Aufgabe blockiert oder ihre Zeitscheibe aufgebraucht hat. Das nennt man Planung.\n") * 2


def _run_script(script, *args):
    return _run([Path(ROOT) / script, *args], cwd=ROOT)


def assert_one_line_error(res, code):
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert_one_line(res.stderr)


# ----------------------------------------------------------------------------------------------------
# the prose corpus's builder: pinned Debian packages (data/prose_packages.txt), checked shards

FAKE_APT_GET = """#!/bin/sh
echo "apt-get $*" >> "$FAKE_LOG"
[ "$1" = download ] || exit 0
case "$3" in
  docpkg=1.0) [ -n "$FAKE_HAS_PIN" ] || { echo "E: Version '1.0' for 'docpkg' was not found"; exit 100; }
              printf "$FAKE_HAS_PIN" > docpkg_1.0_all.deb ;;
  *) printf today > "$(echo "$3" | tr = _)_all.deb" ;;
esac
"""
FAKE_CORPUS = """import os, sys
if "--list_packages" in sys.argv:
    print("docs docpkg-new|docpkg")
    sys.exit(0)
print("prose_corpus.py", *sys.argv[1:])
if os.environ["FAKE_SHARD"]:  # empty: this build writes no V = 8192 shard (another vocabulary)
    os.makedirs("data/prose8192", exist_ok=True)
    open("data/prose8192/prose8192_train_000000.bin", "w").write(os.environ["FAKE_SHARD"])
"""


def _run_build(tmp_path, *args, has_pin="pinned", shard="the corpus", pins=None, mirror=None):
    data, bin_dir, fake_py = tmp_path / "data", tmp_path / "bin", tmp_path / "py" / "tokenizers"
    for d in (data, bin_dir, fake_py):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(ROOT) / "data" / "build_prose_corpus.sh", data)
    (data / "prose_corpus.py").write_text(FAKE_CORPUS)
    (fake_py / "__init__.py").write_text("")
    sha = lambda text: hashlib.sha256(text.encode()).hexdigest()  # noqa: E731
    (data / "prose_packages.txt").write_text(pins or f"# package version sha256\r\ndocpkg 1.0 {sha('pinned')}\r\n"
                                             f"shard prose8192/prose8192_train_000000.bin {sha('the corpus')}\r\n")
    for tool, text in (("apt-get", FAKE_APT_GET), ("man", "#!/bin/sh\n"),
                       ("apt-cache", '#!/bin/sh\necho "apt-cache $*" >> "$FAKE_LOG"\necho "Version: 9.9"\n'),
                       ("dpkg-deb", '#!/bin/sh\n[ "$1" = -f ] && { basename "$2" | cut -d_ -f2; exit 0; }\n'
                                    'mkdir -p "$3" && cp "$2" "$3/"\n')):
        (bin_dir / tool).write_text(text)
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "apt.txt").unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(fake_py.parent),
           "FAKE_LOG": str(tmp_path / "apt.txt"), "FAKE_HAS_PIN": has_pin, "FAKE_SHARD": shard,
           "PROSE_DEBIAN_MIRROR": mirror or (tmp_path / "no_mirror").as_uri()}
    r = subprocess.run(["bash", str(data / "build_prose_corpus.sh"), *args], capture_output=True, text=True,
                       timeout=60, env=env)
    calls = (tmp_path / "apt.txt").read_text().splitlines() if (tmp_path / "apt.txt").exists() else []
    return r, calls


def test_the_prose_builder_takes_the_pinned_packages_and_checks_the_shards(tmp_path):
    """The corpus followed Debian's packages of the day, so a rebuild gave another corpus than the one records/
    trained on. The builder takes each package at its pinned version (the .deb's sha256), from data/prose/debs/
    or apt, and says whether the shards it wrote are the pinned corpus's."""
    (tmp_path / "data/prose/root/docpkg-new").mkdir(parents=True)  # a newer alternative's tree, left by --latest
    r, calls = _run_build(tmp_path, "--vocab_sizes", "8192")
    assert r.returncode == 0, r.stderr
    assert calls[-1] == "apt-get download -q docpkg=1.0"  # the pinned one of its group, not the newest alternative
    assert (tmp_path / "data/prose/root/docpkg/docpkg_1.0_all.deb").read_text() == "pinned"
    assert not (tmp_path / "data/prose/root/docpkg-new").exists()  # the source would read the newest tree there
    assert "prose_corpus.py --vocab_sizes 8192" in r.stdout and "the pinned corpus's" in r.stdout
    r, calls = _run_build(tmp_path, shard="other bytes")  # every pinned .deb here: no apt at all
    assert r.returncode == 0 and calls == [] and "docpkg already unpacked" in r.stdout, r.stderr
    assert "differs from the pinned corpus's sha256" in r.stdout
    r, calls = _run_build(tmp_path, shard="")  # a shard this build did not write is not vouched for
    assert r.returncode == 0 and "pinned corpus" not in r.stdout


def test_the_prose_builder_refuses_what_is_not_the_pinned_package_in_one_line(tmp_path):
    (tmp_path / "data/prose/debs").mkdir(parents=True)
    (tmp_path / "data/prose/debs/docpkg_1.0_all.deb").write_text("changed")  # not the pinned bytes: fetched again
    r, calls = _run_build(tmp_path, has_pin="")
    assert r.returncode == 1 and "apt-get download -q docpkg=1.0" in calls
    assert_one_line(r.stderr, "neither apt-get nor Debian's pool has docpkg 1.0", "snapshot.debian.org/binary/docpkg/",
                    "--latest")
    assert "prose_corpus.py" not in r.stdout  # nothing built
    r, _ = _run_build(tmp_path, has_pin="other bytes")  # the archive's file is not the pinned one
    assert r.returncode == 1 and "prose_corpus.py" not in r.stdout
    assert_one_line(r.stderr, "docpkg_1.0_all.deb has sha256", "not the pinned")
    r, _ = _run_build(tmp_path, pins="docpkg 1.0\n")  # a pin without its sha256 would check nothing
    assert r.returncode == 1
    assert_one_line(r.stderr, "the line of docpkg needs a version and a sha256")
    r, calls = _run_build(tmp_path, "--latest")  # today's packages: the first alternative apt knows, its version
    assert r.returncode == 0 and "apt-get download -q docpkg-new=9.9" in calls, r.stderr
    assert "prose_corpus.py\n" in r.stdout and "pinned corpus" not in r.stdout  # --latest is not passed on


def test_the_prose_builder_takes_a_pin_apt_has_dropped_from_debians_pool(tmp_path):
    """On 2026-12-03 apt's lists no longer had four of the sixteen pinned versions (superseded security updates),
    which Debian's pool still served: the builder fetches the pin from its place there and checks its sha256."""
    sha = hashlib.sha256(b"pinned").hexdigest()
    pins = (f"docpkg 1.0 {sha} debian-security/pool/updates/main/d/docsrc/docpkg_1.0_all.deb\n"
            f"shard prose8192/prose8192_train_000000.bin {hashlib.sha256(b'the corpus').hexdigest()}\n")
    pool = tmp_path / "mirror/debian-security/pool/updates/main/d/docsrc"
    pool.mkdir(parents=True)
    (pool / "docpkg_1.0_all.deb").write_text("pinned")
    mirror = (tmp_path / "mirror").as_uri()
    r, calls = _run_build(tmp_path, has_pin="", pins=pins, mirror=mirror)  # apt: "Version '1.0' was not found"
    assert r.returncode == 0 and "apt-get download -q docpkg=1.0" in calls, r.stderr
    assert "docs: downloaded docpkg_1.0_all.deb" in r.stdout and "the pinned corpus's" in r.stdout
    assert (tmp_path / "data/prose/root/docpkg/docpkg_1.0_all.deb").read_text() == "pinned"
    (pool / "docpkg_1.0_all.deb").write_text("other bytes")  # the pool's file is not the pinned one: refused
    shutil.rmtree(tmp_path / "data/prose")
    r, _ = _run_build(tmp_path, has_pin="", pins=pins, mirror=mirror)
    assert r.returncode == 1 and "prose_corpus.py" not in r.stdout
    assert_one_line(r.stderr, "Debian's pool's docpkg_1.0_all.deb has sha256", "not the pinned")
    assert not (tmp_path / "data/prose/debs/docpkg_1.0_all.deb").exists()  # not kept to be taken later
    (pool / "docpkg_1.0_all.deb").unlink()  # gone from the pool too: snapshot.debian.org, in one line
    r, _ = _run_build(tmp_path, has_pin="", pins=pins, mirror=mirror)
    assert r.returncode == 1
    assert_one_line(r.stderr, "neither apt-get nor Debian's pool has docpkg 1.0", "snapshot.debian.org")


# ----------------------------------------------------------------------------------------------------
# the prose filter and the readers

def test_prose_filter_keeps_prose_and_drops_code_tables_and_other_languages():
    assert pc.is_prose(PROSE)
    assert pc.is_prose(PROSE + "\n.. code-block:: c\n\n\tfoo(1);\n")  # a little code in prose is fine
    for text in (CODE, TABLE, GERMAN, "- one\n- two\n- three\n" * 20):
        assert not pc.is_prose(text), text[:40]
    share, stop = pc.prose_stats(PROSE + CODE)
    assert 0.0 < share < 1.0 and 0.0 < stop < 0.5


def test_html_to_text_drops_page_furniture_and_keeps_pre():
    html = ("<html><head><title>T</title><style>p {}</style></head><body><nav>Home | Next</nav>"
            "<div class='navheader'><div>Prev</div> Up</div><h1>Title</h1><p>One   two\nthree &amp; four.</p>"
            "<script>var x = 1;</script><pre>a\n    b</pre><footer>debug info</footer></body></html>")
    assert pc.html_to_text(html) == "Title\n\nOne two three & four.\n\na\n    b\n"


def test_split_long_cuts_at_paragraphs_and_loses_nothing():
    text = "".join(f"paragraph {i} " + "word " * (i % 7 * 20) + "\n\n" for i in range(50)) + "x" * 3000
    pieces = pc.split_long(text, 1000)
    assert "".join(pieces) == text and all(len(p) <= 1000 for p in pieces)
    assert sum(p.endswith("\n\n") for p in pieces) >= len(pieces) - 4
    assert pc.split_long("short", 1000) == ["short"]


def test_filter_documents_counts_each_drop():
    docs = [("a", PROSE), ("b", "tiny"), ("c", CODE), ("d", PROSE + "\n"), ("e", PROSE * 3)]
    kept, counts = pc.filter_documents(docs, min_chars=200, max_doc_chars=100_000)
    assert [n for n, _ in kept] == ["a", "e"]
    assert counts == {"pieces": 5, "tiny": 1, "not_prose": 1, "duplicate": 1}
    seen = set()  # a shared `seen` drops a later source's copy too
    pc.filter_documents([("x", PROSE)], seen=seen)
    assert pc.filter_documents([("y", PROSE)], seen=seen)[1]["duplicate"] == 1


def test_split_jargon_and_bible():
    jargon = ("The Jargon File\n\nfront matter text\n\nChapter 1. Hacker Slang\n\nchapter text\n\nGlossary\n\n   0\n\n"
              "   :0: n.\n\n   Numeric zero.\n\n   :ACK: interj.\n\n   Acknowledge.\n\n   :abbrev: n.\n\n   Short.\n\n"
              "   :BASIC: n.\n\n   A language.\n\nAppendix A. Hacker Folklore\n\nstories\n")
    names = [n for n, _ in pc.split_jargon(jargon)]
    assert names == ["front matter", "Chapter 1", "Glossary", "lexicon 0-9", "lexicon A", "lexicon B", "Appendix A"]
    bible = ("\nGenesis 1\n\n  1 In the beginning God created the heaven\nand the earth.\n  2 And the earth was void.\n"
             "\nGenesis 2\n\n  1 Thus the heavens were finished.\n\nSong of Solomon 1\n\n  1 The song of songs.\n")
    books = dict(pc.split_bible(bible))
    assert list(books) == ["Genesis", "Song of Solomon"]
    assert books["Genesis"] == ("Genesis 1\n\nIn the beginning God created the heaven and the earth.\n"
                                "And the earth was void.\n\nGenesis 2\n\nThus the heavens were finished.\n")


# ----------------------------------------------------------------------------------------------------
# order and split

def test_shuffle_and_split_are_seeded_and_independent_of_reading_order():
    docs = [("s", f"doc{i:03d}", f"text {i}") for i in range(200)]
    a = pc.shuffle_documents(docs, seed=0)
    assert a == pc.shuffle_documents(list(reversed(docs)), seed=0)  # reading order does not matter
    assert a != docs and sorted(a) == docs                          # not source order, nothing lost
    assert a != pc.shuffle_documents(docs, seed=1)
    f = pc.split_flags(len(a), seed=0, val_fraction=0.1)
    assert f == pc.split_flags(len(a), seed=0, val_fraction=0.1) and 5 <= sum(f) <= 40
    assert f != pc.split_flags(len(a), seed=1, val_fraction=0.1)


def test_straddling_finds_val_pieces_whose_siblings_are_in_train():
    docs = [("a", "book#0", ""), ("a", "page", ""), ("a", "book#1", ""), ("b", "book#2", ""), ("a", "book#2", ""),
            ("b", "book#0", ""), ("a", "other#0", "")]
    flags = [False, True, True, True, False, True, True]  # val: page, a book#1, b book#2, b book#0, other#0
    # a's book has two pieces in train; b's book (another source) has none there, nor has other
    assert pc.straddling(docs, flags) == [(1, "a", "book#1", 2)]
    assert pc.straddling(docs, [False] * 7) == [] and pc.straddling(docs, [True] * 7) == []


# ----------------------------------------------------------------------------------------------------
# tokenizer and shards (a fake unpacked-package tree, two sources)

def _fake_work(tmp_path, n_docs=40):
    root = tmp_path / "work" / "root"
    git = root / "git-doc/usr/share/doc/git-doc"
    gimp = root / "gimp-help-en/usr/share/gimp/2.0/help/en"
    git.mkdir(parents=True)
    gimp.mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = "the of and a to in is it that for tool layer image brush commit branch merge color".split()
    for i in range(n_docs):
        body = "\n".join(" ".join(rng.choice(words, 10)) + "." for _ in range(8 + i % 5))
        if i % 2:
            (git / f"doc{i}.txt").write_text(f"Document {i} of git, on <|bos|> and more.\n{body}\n")
        else:
            (gimp / f"page{i}.html").write_text(f"<html><body><h1>Page {i}</h1><p>{body}</p></body></html>")
    (git / "code.txt").write_text(CODE)  # dropped as not prose
    return tmp_path / "work"


def test_build_trains_on_train_split_and_writes_shards_with_bos_last(tmp_path, monkeypatch):
    pytest.importorskip("tokenizers", reason="needs the tokenizers library: pip install -r experiments/requirements.txt")
    work = _fake_work(tmp_path)
    seen_texts = []
    real_train = pc.train_tokenizer
    monkeypatch.setattr(pc, "train_tokenizer", lambda texts, V, threads=None: (
        seen_texts.extend(texts), real_train(seen_texts, V, threads))[1])
    logs = []
    s = pc.build(work, tmp_path / "out", vocab_sizes=[300], sources=["git", "gimp"], seed=3, val_fraction=0.25,
                 min_chars=100, threads=1, log=logs.append)
    assert s["sources"]["git"]["not_prose"] == 1 and s["documents"] == 40
    v = s["vocab"][300]
    V = v["vocab_size"]
    assert V == 300 and v["bos"] == V - 1
    # the tokenizer saw exactly the train documents of the shuffled, seeded split
    docs = pc.shuffle_documents([(src, n, t) for src in ("git", "gimp") for n, t in
                                 pc.filter_documents(pc.load_source(next(x for x in pc.SOURCES if x.name == src),
                                                                    work / "root", work / "docs", 1)[0], 100)[0]], 3)
    flags = pc.split_flags(len(docs), 3, 0.25)
    assert seen_texts == [t for (_, _, t), f in zip(docs, flags) if not f]
    assert v["docs"] == {"val": sum(flags), "train": len(docs) - sum(flags)}
    tok = pc.HFEncoding(pc._tokenizers().Tokenizer.from_file(str(tmp_path / "out/prose300/tokenizer.json")), "t")
    for split in ("train", "val"):
        path = tmp_path / f"out/prose300/prose300_{split}_000000.bin"
        header, tokens = pc.read_shard_header(path), np.fromfile(path, dtype="<u2", offset=1024)
        assert header["vocab_size"] == V and header["version"] == 1 and header["num_tokens"] == tokens.size
        assert tokens[0] == V - 1 and (tokens == V - 1).sum() == v["docs"][split]  # BOS starts every document
        assert tokens.max() == V - 1
        first = tokens[1:np.flatnonzero(tokens == V - 1)[1] if v["docs"][split] > 1 else None]
        texts = [t for (_, _, t), f in zip(docs, flags) if f == (split == "val")]
        assert tok.decode(first.tolist()) == texts[0]  # and "<|bos|>" in a text stayed text
    assert any("targets" in line for line in logs)
    # a second build reuses the tokenizer and the document caches
    logs.clear()
    pc.build(work, tmp_path / "out", vocab_sizes=[300], sources=["git", "gimp"], seed=3, val_fraction=0.25,
             min_chars=100, threads=1, log=logs.append)
    assert any("reusing" in line for line in logs) and any("(cached)" in line for line in logs)


def test_literal_bos_text_is_not_the_bos_id():
    pytest.importorskip("tokenizers", reason="needs the tokenizers library: pip install -r experiments/requirements.txt")
    tok = pc.train_tokenizer([PROSE * 5, "<|bos|> appears here"], 300, threads=1)
    enc = pc.HFEncoding(tok, "t")
    assert enc.eot_token == enc.n_vocab - 1
    ids = enc.encode_ordinary_batch(["a <|bos|> b"])[0]
    assert enc.eot_token not in ids and enc.decode(ids) == "a <|bos|> b"


# ----------------------------------------------------------------------------------------------------
# copy share

def _brute_force(tokens, bos, w):
    n = copy = 0
    start = 0
    for t, x in enumerate(tokens):
        if x == bos:
            start = t
            continue
        n += 1
        lo = max(start, t - w) if w else start
        copy += x in tokens[lo:t]
    return n, copy


def test_copy_share_matches_brute_force(tmp_path):
    rng = np.random.default_rng(1)
    V = 40
    docs = [np.concatenate([[V - 1], rng.integers(0, 12 if i % 2 else V - 1, rng.integers(1, 300))]) for i in range(30)]
    tokens = np.concatenate([rng.integers(0, 5, 7)] + docs)  # a headless first document too
    cut = tokens.size // 2
    tc.write_shard(tmp_path / "c_000000.bin", tokens[:cut], V)
    tc.write_shard(tmp_path / "c_000001.bin", tokens[cut:], V)  # a document spans the two files
    paths = sorted(tmp_path.glob("c_*.bin"))
    for chunk in (16, 1 << 20):
        dist = np.concatenate([cs.copy_distances(p, V - 1) for p in cs.document_chunks(paths, V - 1, chunk)])
        assert dist.size == tokens.size
    r = cs.copy_share(paths, [1, 5, 64])
    assert r["docs"] == 30 and r["bos"] == V - 1
    lst = tokens.tolist()
    for w, key in ((1, "1"), (5, "5"), (64, "64"), (0, "doc")):
        n, copy = _brute_force(lst, V - 1, w)
        assert r["tokens"] == n and r["copyable"][key] == copy, key
    out = _run_script("experiments/copy_share.py", str(tmp_path / "c_*.bin"), "--windows", "1,5")
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout.strip().splitlines()[-1])["corpora"][0]
    assert row["copyable"]["5"] == _brute_force(lst, V - 1, 5)[1]


# ----------------------------------------------------------------------------------------------------
# one-line errors

def test_scripts_give_one_line_errors(tmp_path):
    assert_one_line_error(_run_script("data/prose_corpus.py", "--vocab_sizes", "100"), 2)
    assert_one_line_error(_run_script("data/prose_corpus.py", "--vocab_sizes", "8k"), 2)
    assert_one_line_error(_run_script("data/prose_corpus.py", "--sources", "nonsense"), 2)
    assert_one_line_error(_run_script("data/prose_corpus.py", "--work_dir", tmp_path / "none", "--sources", "git"), 1)
    assert_one_line_error(_run_script("experiments/copy_share.py", tmp_path / "none_*.bin"), 1)
    (tmp_path / "x.bin").write_bytes(b"not a shard" * 200)
    assert_one_line_error(_run_script("experiments/copy_share.py", tmp_path / "x.bin"), 1)
    assert_one_line_error(_run_script("experiments/copy_share.py", tmp_path / "x.bin", "--windows", "a,b"), 2)
    assert_one_line_error(_run_script("experiments/copy_share.py"), 2)


def test_build_writes_a_byte_level_corpus_without_a_tokenizer(tmp_path):
    work = _fake_work(tmp_path)
    s = pc.build(work, tmp_path / "out", vocab_sizes=[257], sources=["git", "gimp"], seed=3, val_fraction=0.25,
                 min_chars=100, threads=1, log=lambda line: None)
    v = s["vocab"][257]
    assert v["vocab_size"] == 257 and v["bos"] == 256 and not (tmp_path / "out/prose257/tokenizer.json").exists()
    docs = pc.shuffle_documents([(src, n, t) for src in ("git", "gimp") for n, t in
                                 pc.filter_documents(pc.load_source(next(x for x in pc.SOURCES if x.name == src),
                                                                    work / "root", work / "docs", 1)[0], 100)[0]], 3)
    flags = pc.split_flags(len(docs), 3, 0.25)
    for split in ("train", "val"):
        path = tmp_path / f"out/prose257/prose257_{split}_000000.bin"
        tokens = np.fromfile(path, dtype="<u2", offset=1024)
        texts = [t for (_, _, t), f in zip(docs, flags) if f == (split == "val")]
        expected = np.concatenate([np.r_[256, np.frombuffer(t.encode(), np.uint8).astype(np.uint16)] for t in texts])
        np.testing.assert_array_equal(tokens, expected)  # BOS, then each document's UTF-8 bytes
        assert v["tokens"][split] == expected.size
    assert pc.parse_args(["--vocab_sizes", "257,2048"]).vocab_sizes == [257, 2048]
    with pytest.raises(SystemExit):
        pc.parse_args(["--vocab_sizes", "258"])
