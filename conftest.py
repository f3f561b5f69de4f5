"""Helpers and fixtures the test files share: the repository's paths, a loader for its scripts, an independent
shard writer, a tiny corpus, the training script's flags for a tiny run, a command's main run in this process as a
command would run (no interpreter to start: seconds saved a call), the bad-input rule."""
import contextlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(ROOT, "train_gpt_cplm.py")


def _load(relative_path):
    """One of the repository's scripts as a module, its folder on sys.path as when it runs as a script
    (experiments/ import experiments/cli.py; data/ and records/ scripts import their neighbours)."""
    path = Path(ROOT) / relative_path
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_experiment(name):
    return _load(f"experiments/{name}.py")


BOS, VOCAB = 499, 500  # the toy corpora's tokenizer: ids 0..499, BOS 499


# ----------------------------------------------------------------------------------------------------
# helpers: an independent shard writer and a tiny corpus


def write_shard(path, tokens, version=1, vocab=VOCAB, magic=20240520, truncate=0):
    header = np.zeros(256, dtype="<i4")
    header[:4] = [magic, version, len(tokens), vocab]
    body = np.asarray(tokens, dtype="<u2" if version == 1 else "<u4").tobytes()
    with open(path, "wb") as f:
        f.write(header.tobytes() + body[:len(body) - truncate])


def toy_corpus(n, seed, vocab=VOCAB, bos=BOS):
    """Documents of 20-300 tokens from a small alphabet, so tokens recur inside documents."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        out += [bos] + list(rng.integers(0, 60, rng.integers(20, 300)))
    return out[:n]


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy")
    write_shard(d / "toy_train_000000.bin", toy_corpus(60_000, 0))
    write_shard(d / "toy_train_000001.bin", toy_corpus(60_000, 1))
    write_shard(d / "toy_val_000000.bin", toy_corpus(20_000, 2))
    return d


def tiny_flags(data_dir, log_dir, **over):
    flags = dict(preset="cpu", train_files=f"{data_dir}/toy_train_*.bin", val_files=f"{data_dir}/toy_val_*.bin",
                 vocab_size=VOCAB, bos_id=BOS, num_layers=2, model_dim=64, num_heads=2, batch_size=1024,
                 seq_len=256, val_seq_len=512, val_tokens=2048, num_iterations=6, val_loss_every=3,
                 attn_window=256, attn_window_start=128, log_dir=log_dir, run_id="run")
    flags.update(over)
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))]


def run_cli(args, nproc=None, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT]
    cmd = (cmd if nproc else [sys.executable, SCRIPT]) + args
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@contextlib.contextmanager
def one_thread():
    """torch on one thread in this process, as run_cli's OMP_NUM_THREADS=1 gives a subprocess (train_gpt_cplm.main
    then keeps it); the caller's thread count and environment come back after."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp


def as_a_command(main, args, refusals=None):
    """main(args) in this process as a command would run it, for checks of what it says and writes, not of how a
    process ends: its stdout, stderr and warnings (Python's default filters, as a fresh interpreter shows them)
    captured, SystemExit taken as the exit code, and refusals(exception) -> (exit code, stderr line) or None for
    the exceptions the command's __main__ block turns into one line. Any other exception propagates (where the
    command would print a traceback). Returns what subprocess.run gives: returncode, stdout, stderr."""
    import io
    import types
    import warnings
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # a fresh interpreter's filters: DeprecationWarning and its kin hidden
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        try:
            code = main([str(x) for x in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
        except Exception as e:
            said = refusals(e) if refusals else None
            if said is None:
                raise
            code, line = said
            print(line, file=sys.stderr)
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return types.SimpleNamespace(returncode=code or 0, stdout=out.getvalue(), stderr=shown + err.getvalue())


def main_in_process(args):
    """run_cli(args) without a new interpreter, for checks about the run's files, logs and messages, not about the
    process: train_gpt_cplm.main(args) in this process on one thread (as run_cli's OMP_NUM_THREADS=1), as_a_command,
    its refusals turned into the exit code and the one stderr line the script's __main__ block gives them
    (UsageError: 2 and '(see --help)', DataError: 1). That block itself runs in real processes in test_cli.py
    (test_bad_flags_exit_2_with_one_line: 2; test_missing_data_names_the_download_command,
    test_a_pipe_among_the_inputs_is_refused_not_waited_on: 1)."""
    import train_gpt_cplm as tg

    def refusals(e):
        if isinstance(e, (tg.UsageError, tg.DataError)):
            code = 2 if isinstance(e, tg.UsageError) else 1
            return code, f"train_gpt_cplm.py: error: {e}{' (see --help)' * (code == 2)}"
        return None
    with one_thread():
        return as_a_command(tg.main, args, refusals)


def log_values(path, kind):
    return log_values_in(open(path).read().split("=" * 100 + "\n", 1)[1], kind)


def log_values_in(text, kind):
    return [float(x) for x in re.findall(rf"^step:\d+/\d+ {kind}:([-\d.naif]+)", text, re.M)]


def assert_one_line(stderr, *words):
    """The rule for bad input: exactly one line on stderr, no traceback, saying what was found."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


TOKENIZE = Path(ROOT) / "data" / "tokenize_corpus.py"
DOWNLOAD = Path(ROOT) / "data" / "cached_fineweb10B.py"
COMPARE = Path(ROOT) / "tools" / "compare.py"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10"  # the first bytes of a PNG image
ELF = b"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00>\x00"  # ... and of a Linux executable


def _run(args, env_update=None, unset=(), cwd=None):
    """python ARGS (a script and its arguments) in a subprocess, its environment updated and unset."""
    env = dict(os.environ)
    env.update(env_update or {})
    for k in unset:
        env.pop(k, None)
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _text_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.txt").write_text("first document\n")
    (folder / "b.txt").write_text("second document\n")
    return [folder / "a.txt", folder / "b.txt"]


def random_documents(B, T, bos, seed, vocab=8):
    """(B, T) token ids of random documents, each row starting with bos and holding a few more."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    ids[ids == bos] = 0
    ids[:, 0] = bos
    starts = torch.randint(1, T, (B, 4), generator=g)  # a few more documents per row
    ids.scatter_(1, starts, bos)
    return ids

