"""run_files.py: a training run's files, beside train_gpt_cplm.py (which imports it): the log (its claim on the
run_id, the temporary name until the first validation, and undoing a refused start), the lock that keeps one
process per run, and the checkpoints (written whole or not at all, rotated, verified by a digest when read).
None of it changes what a run computes; each log holds this file's source after the training script's.
"""
import contextlib
import dataclasses
import datetime
import functools
import glob
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist


class UsageError(Exception):
    """A bad command line: reported in one line, exit code 2."""


class DataError(Exception):
    """Missing or malformed data: reported in one line, exit code 1."""


class Logger:
    """Rank 0 writes logs/<run_id>.txt: the script's source, the environment, then the run's lines. A run that
    resumes its own checkpoint appends a "resumed" section to its log. A new run writes to a hidden temporary
    file, which takes the name logs/<run_id>.txt only at start(), after the first validation (with --overwrite,
    the old run's checkpoints are set aside then): a refused or crashed start leaves an earlier run as it was.
    sources: the files whose text heads a new log (the training script, then this file).
    undo() takes back what a refused run wrote."""

    def __init__(self, a, master: bool, sources=()):
        self.path = log_path(a) if master else None
        self.run_folder = os.path.join(a.log_dir, a.run_id)
        self.resume_folder = os.path.realpath(os.path.dirname(a.resume)) if a.resume else None
        self.resume_step = checkpoint_step(a.resume)
        self.started = False
        self.size_before = None  # appending: the log's size before this run
        self.writing = self.path  # where lines go: the log itself, or the temporary file until start()
        if self.path:
            appending = continues_own_run(a) and os.path.exists(self.path)
            if appending:
                self.size_before = os.path.getsize(self.path)
            else:
                self.writing = os.path.join(a.log_dir, f".{a.run_id}.txt.starting{writer_tag()}")
            text = ("=" * 100 + f"\nresumed from {a.resume}\n") if appending else (
                "".join((f"# ---- {os.path.basename(path)}\n" if i else "") + read_text(path) + "\n"
                        for i, path in enumerate(sources)) + "=" * 100 + "\n")
            try:
                with open(self.writing, "a" if appending else "w") as f:
                    f.write(text)
            except OSError as e:
                self.undo()  # a full disk or a read-only folder: the data's place, not the command line, is at fault
                raise DataError(f"{self.writing}: cannot write the log ({e.strerror})")

    def __call__(self, line, console=True, console_extra=""):
        if self.path:
            if console:
                print(line + console_extra, flush=True)  # console_extra: on stdout only (an ETA)
            size = os.path.getsize(self.writing)
            try:
                with open(self.writing, "a") as f:
                    f.write(line + "\n")
            except OSError as e:  # a full disk: no half line at the end of the log, and one line that says why
                with contextlib.suppress(OSError):
                    os.truncate(self.writing, size)
                raise DataError(f"{self.writing}: cannot write the log ({e.strerror}); the run stops here")

    def start(self, overwrite=False):
        """The run has really started (its first validation is logged): its log takes the run_id's name."""
        self.started = True
        if self.path and self.writing != self.path:
            if overwrite:
                os.replace(self.writing, self.path)
            else:  # a link fails if another process took the name meanwhile: nothing is clobbered silently
                try:
                    os.link(self.writing, self.path)
                except FileExistsError:
                    raise UsageError(f"{self.path} appeared while this run was starting (another run with this "
                                     f"--run_id?); this run's log is {self.writing}")
                os.remove(self.writing)
            self.writing = self.path
        if overwrite and self.path:
            self.set_aside_replaced_checkpoints()

    def set_aside_replaced_checkpoints(self):
        """--overwrite, once the log has taken the name: the replaced run's checkpoints (or, when this run resumed
        its own from an earlier one, those after it: the branch it abandoned) move to <run>/replaced_<time>/, so
        that none of them can continue a log it does not belong to; from there a --resume starts a new run."""
        own = os.path.realpath(self.run_folder) == self.resume_folder
        replaced = [old for old in checkpoints_in(self.run_folder)
                    if not own or 0 <= self.resume_step < checkpoint_step(old)]
        if replaced:
            aside = os.path.join(self.run_folder, f"replaced_{time.strftime('%Y%m%d_%H%M%S')}_{os.getpid()}")
            os.makedirs(aside, exist_ok=True)
            for old in replaced:
                os.replace(old, os.path.join(aside, os.path.basename(old)))
            self(f"--overwrite: the replaced run's {len(replaced)} checkpoint(s) moved to {aside}")

    def undo(self, keep_if_new=False):
        """Takes back what a run that never started wrote. keep_if_new (a crash, not a refusal): a new run's log
        is kept under the run_id's name when no earlier run has that name."""
        if not self.path:
            return
        if self.writing != self.path:
            if keep_if_new and os.path.exists(self.writing) and not os.path.exists(self.path):
                os.replace(self.writing, self.path)
            elif os.path.exists(self.writing):
                os.remove(self.writing)
        elif self.size_before is not None:
            os.truncate(self.path, self.size_before)


def run_settings(a, given=()):
    """(a, checkpoint, changed): the run's settings, its checkpoint (read on the CPU) and, with --resume, the
    flags given now that differ from the checkpoint's (lines for the log): a resumed run continues with its
    checkpoint's settings, flags given now win. A run without --run_id gets a fresh uuid."""
    checkpoint, changed = None, []
    if a.resume:
        if not os.path.isfile(a.resume):
            raise UsageError(f"--resume: no such checkpoint file: {a.resume}")
        if not a.run_id:  # the checkpoint's own run, <log_dir>/<run_id>/state_stepN.pt, wherever that log_dir is
            run_folder = os.path.realpath(os.path.dirname(a.resume))
            a.run_id = os.path.basename(run_folder)
            elsewhere = os.path.dirname(run_folder) != os.path.realpath(a.log_dir)
            if "log_dir" not in given and elsewhere and os.path.exists(f"{run_folder}.txt"):  # its own log
                a.log_dir = os.path.dirname(run_folder)
        checkpoint = read_checkpoint(a.resume, "cpu")
        a, changed = settings_on_resume(a, checkpoint["hyperparameters"], given)
        wrong = [f"{f.name} = {getattr(a, f.name)!r}" for f in dataclasses.fields(a) if not isinstance(
            getattr(a, f.name), (float, int) if f.type in (float, "float") else type(f.default)) or isinstance(
            getattr(a, f.name), bool)]
        if wrong:
            raise DataError(f"--resume {a.resume}: its settings are not this script's ({', '.join(wrong[:3])})")
        check_args(a, given)
    a.run_id = a.run_id or str(uuid.uuid4())
    return a, checkpoint, changed


@contextlib.contextmanager
def claim_run(a, rank, distributed, device, sources):
    """The run's claim on its run_id, around its training: the lock (rank 0; every rank refuses together if
    another process holds it, none waiting in a collective for a rank 0 that has gone), the process group,
    the same settings and shards on every rank, and the Logger it yields. A run refused or crashed before its
    first validation leaves no log where there was none and an earlier run's as it was; a later failure ends
    the log with a "stopped:" line saying why."""
    run_lock = check_log_target(a, writer=rank == 0)  # rank 0: the run's lock; None where another process has it
    try:
        if distributed:  # a rank that stops answering ends the job after dist_timeout_s instead of hanging it
            dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                    device_id=device if device.type == "cuda" else None,
                                    timeout=datetime.timedelta(seconds=a.dist_timeout_s))
        refused = rank == 0 and run_lock is None
        if distributed:
            flag = torch.tensor([int(refused), (d := settings_digest(a, with_shards=True)), -d], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the ranks' digests agree iff max(d) == -max(-d)
            if flag[1] != -flag[2]:
                raise UsageError("the ranks were started with different settings or see different shards (their "
                                 "sha256): give every rank the same flags and the same data")
            refused = bool(flag[0].item())
        if refused:
            raise UsageError(f"run {a.run_id} is training in another process on this machine: wait for it to end, "
                             "or choose another --run_id")
        if a.cp_backend == "lse_kernel":  # the CP sums' kernel is code the run ran: its source follows the script's
            sources = (*sources, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cp_kernel.py"))
        log = Logger(a, rank == 0, sources=sources)
        try:
            yield log
            if not log.started:  # stopped at its first validation (a NaN): its log stays only where none was
                log.undo(keep_if_new=True)
            if distributed:  # no rank tears its connections down while another still uses them (gloo aborted
                dist.barrier()  # a finished job now and then: "terminate called without an active exception")
        except (UsageError, DataError):
            if not log.started:  # refused before the first step: leave no trace in the logs
                log.undo()
            else:
                with contextlib.suppress(OSError, DataError):  # a full disk: the one line that says why
                    log(f"stopped: {sys.exc_info()[0].__name__}: {sys.exc_info()[1]}", console=False)
            raise
        except BaseException as e:  # the log ends with why it stopped
            with contextlib.suppress(OSError, DataError):
                log(f"stopped: {type(e).__name__}: {e}", console=False)
            if not log.started:
                log.undo(keep_if_new=True)  # an earlier run's log stays as it was
            if distributed and peer_ended(e):  # another rank died mid-collective: its own output says why. Here one
                if run_lock is not None:  # line, and an exit now: gloo's threads abort a normal one (std::terminate,
                    release_run_lock(run_lock)  # exit -6) with a dead peer and work in flight
                print(f"{os.path.basename(sys.argv[0])}: error: another process of this run ended or stopped answering; "
                      f"its output says why (here: {str(e).splitlines()[0][:200]})", file=sys.stderr, flush=True)
                os._exit(1)
            raise
    finally:
        if run_lock is not None:  # first: a teardown that raises leaves no lock file behind
            release_run_lock(run_lock)
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def log_path(a):
    return os.path.join(a.log_dir, f"{a.run_id}.txt")


def continues_own_run(a):
    """--resume of a checkpoint in logs/<run_id>/ continues that run; from anywhere else it starts a new run
    (run_id) from the checkpoint's state."""
    return bool(a.resume) and os.path.realpath(os.path.dirname(a.resume)) == os.path.realpath(
        os.path.join(a.log_dir, a.run_id))


def check_log_target(a, writer=True):
    """Before anything starts: the log directory is writable, and a fresh run does not overwrite another
    run's log unless asked; then the run's lock (returned, to close at the end; None while another process holds
    it, and always for writer=False). writer=False (ranks > 0): the
    read-only checks, so that every rank refuses at once instead of waiting in the rendezvous for a rank 0 that
    has gone."""
    try:
        if writer:
            os.makedirs(a.log_dir, exist_ok=True)
            with open(os.path.join(a.log_dir, f".{a.run_id}.probe"), "w"):
                pass
            os.remove(os.path.join(a.log_dir, f".{a.run_id}.probe"))
    except OSError as e:
        raise UsageError(f"--log_dir {a.log_dir}: cannot write there ({e.strerror})")
    checkpoints = os.path.join(a.log_dir, a.run_id)
    if os.path.exists(checkpoints) and not os.path.isdir(checkpoints):
        raise UsageError(f"{checkpoints} is a file, but checkpoints go in a folder of that name: choose another "
                         "--run_id")
    if os.path.exists(log_path(a)) and not continues_own_run(a) and not a.overwrite:
        raise UsageError(f"{log_path(a)} exists: choose another --run_id, continue it with --resume of one of its "
                         "own checkpoints, or replace it with --overwrite 1")
    if checkpoints_in(checkpoints) and not continues_own_run(a) and not a.overwrite:  # another run's state would
        # be written over them (a resume of someone else's checkpoint starts a new run in this folder)
        raise UsageError(f"{checkpoints} holds checkpoints of an earlier run: choose another --run_id, continue it "
                         "with --resume of one of them, or replace them with --overwrite 1")
    if continues_own_run(a) and not a.overwrite:  # resuming from an earlier checkpoint would overwrite later ones
        folder = os.path.dirname(a.resume)
        later = [f for f in checkpoints_in(folder) if checkpoint_step(f) > checkpoint_step(a.resume) >= 0]
        if later:
            raise UsageError(f"{folder} holds checkpoints after this one ({os.path.basename(later[-1])}): resuming "
                             "from here would replace them; resume the newest, or pass --overwrite 1 to branch")
    if not writer:
        return None
    run_lock = take_run_lock(os.path.join(a.log_dir, f".{a.run_id}.lock"))  # one process per run_id, fresh or resumed
    if run_lock is not None:  # a starting log of this run_id is a dead process's: any live one would hold the lock
        for path in glob.glob(os.path.join(glob.escape(a.log_dir), f".{glob.escape(a.run_id)}.txt.starting*")):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    return run_lock


def take_run_lock(path):
    """An flock on path, held until release_run_lock (or the process's end, if it is killed); None while another
    process holds it. The file goes at the release, so a finished run leaves none: whoever locks checks that the
    file it locked is still the one at path (a releaser may have removed it between this open and this lock)."""
    while True:
        lock = open(path, "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # another process's run: main refuses on every rank at once
            lock.close()
            return None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        lock.close()  # a released lock's removed file: lock the path's new one


def release_run_lock(lock):
    with contextlib.suppress(OSError):
        os.remove(lock.name)  # still held: a process that opened this file before now finds it gone, and retries
    lock.close()


def git_state(folder):
    """The commit checked out in folder, '+dirty' if tracked files differ from it; 'unknown' outside git."""
    try:
        run = lambda *cmd: subprocess.run(["git", "-C", folder, *cmd], capture_output=True, text=True,  # noqa: E731
                                          timeout=20, check=True).stdout.strip()
        return run("rev-parse", "HEAD") + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (not a git checkout)"


@functools.lru_cache(maxsize=None)
def _sha256_of(path, size, mtime_ns, inode, block=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def file_sha256(path):
    """sha256 of a file's bytes, read once per process while its size, mtime and inode stay the same (the log,
    the ranks' digest and the checkpoint all ask for the shards' hashes)."""
    st = os.stat(path)
    return _sha256_of(os.path.realpath(path), st.st_size, st.st_mtime_ns, st.st_ino)


def settings_digest(a, with_shards=False):
    """63 bits of a sha256 of the run's settings (the run_id aside: a rank may have drawn its own) and, with_shards,
    of the train and val shards' bytes (sha256 each, by their order in the globs): every rank of a run must share
    them (two nodes' copies of the data that differ, or a relative glob that finds other files, are refused)."""
    settings = {k: v for k, v in dataclasses.asdict(a).items() if k != "run_id"}
    if with_shards:
        settings["shards"] = [[file_sha256(p) for p in sorted(glob.glob(g)) if os.path.isfile(p)]
                              for g in (a.train_files, a.val_files)]
    return int(hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:15], 16)


def read_text(path):
    with open(path) as f:
        return f.read()


def checkpoint_step(path):
    m = re.search(r"state_step(\d+)\.pt$", path)
    return int(m[1]) if m else -1


def checkpoints_in(folder):
    """The checkpoints in a run's folder, oldest step first."""
    return sorted(glob.glob(os.path.join(glob.escape(folder), "state_step*.pt")), key=checkpoint_step)


def peer_ended(e):
    """A collective's error because another process of the run is gone (gloo's closed or reset connection, NCCL's
    aborted communicator), not a fault of this one."""
    return isinstance(e, getattr(dist, "DistError", ())) or (
        isinstance(e, RuntimeError) and re.search(r"gloo|NCCL|Connection (reset|closed) by peer", str(e)) is not None)


def writer_tag():
    return f"{os.getpid()}@{socket.gethostname()}"


def remove_stale_saves(folders, pattern="state_step*.pt.*.tmp", quiet_s=60):
    """Removes the temporary checkpoints in these folders that no live process is writing; returns their paths.
    A writer holds an flock on its temporary file from its creation to its rename (save_checkpoint), and every
    process on this host sees it (a pid would not tell: another PID namespace or container reuses pids); a file
    unlocked but changed in the last quiet_s seconds may be a writer between its open and its lock, and stays.
    So do another host's (the name carries the writer's host): its locks need not reach this one."""
    removed = []
    for path in sorted(f for folder in folders for f in glob.glob(os.path.join(glob.escape(folder), pattern))):
        m = re.search(r"@([^/]*?)\.tmp$", path)
        if m and m[1] != socket.gethostname():
            continue
        try:
            with open(path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if time.time() - os.fstat(f.fileno()).st_mtime >= quiet_s:
                    os.remove(path)
                    removed.append(path)
        except OSError:  # a live writer's (BlockingIOError), gone already, or in a folder this process cannot
            continue  # write (a resume from a read-only run folder): left where it is
    return removed


SHAPE_FIELDS = ("vocab_size", "num_layers", "model_dim", "num_heads", "no_attention_layer", "cplm", "cp_dim",
                "cp_optimizer", "copy_gate")  # a checkpoint only fits a run that agrees on these


def save_checkpoint(path, model, optimizers, step, loader, training_time_ms, a, written):
    """Written to a temporary file and renamed, so a crash never leaves half a checkpoint; then only the
    newest keep_checkpoints of those this run wrote (the list `written`) stay. Another run's are not touched."""
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):  # a diverged run: keep the good ones
        raise DataError(f"step {step}: the weights are not finite (the run diverged); no checkpoint saved over the "
                        f"good ones (newest: {written[-1] if written else 'none'}); lower the learning rates")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = dict(step=step, model=model.state_dict(), optimizers=[o.state_dict() for o in optimizers],
                 loader=loader.state(), training_time_ms=training_time_ms, hyperparameters=dataclasses.asdict(a),
                 shards=shard_hashes(a))
    state["digest"] = tensor_digest([state["model"], state["optimizers"], checkpoint_scalars(state)])
    tmp = f"{path}.{writer_tag()}.tmp"
    try:
        with open(tmp, "wb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # held until the rename: the proof, on this host, that its writer lives
            torch.save(state, f)
            f.flush()
            os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk: torch's zip writer raises RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        full = shutil.disk_usage(os.path.dirname(path)).free < 2 ** 20  # torch's writer says "enforce fail at ..."
        reason = ("no space left on the disk" if full else e.strerror if isinstance(e, OSError)
                  else str(e).splitlines()[0][:120])
        raise DataError(f"{path}: cannot save the checkpoint ({reason}); the run stops here, and the previous "
                        "checkpoint is intact")
    written.append(path)
    for old in written[:-a.keep_checkpoints]:
        if os.path.exists(old):
            os.remove(old)
    del written[:-a.keep_checkpoints]


class Checkpoints:
    """A run's checkpoints: the one it resumes (restored here: weights, optimizer states, data position and
    clock, said in the log) and the ones it saves, of which the newest --keep_checkpoints stay (this run's, and a
    continued run's up to its resume)."""

    def __init__(self, a, log, checkpoint, model, optimizers, loader, changed=()):
        self.a, self.log, self.model, self.optimizers, self.loader = a, log, model, optimizers, loader
        self.start_step, self.training_time_ms = 0, 0.0
        if checkpoint is not None:
            self.start_step, self.training_time_ms = restore_checkpoint(checkpoint, model, optimizers, loader, a.resume)
            log(("continuing" if log.size_before is not None else f"resumed from {a.resume}")
                + f" at step {self.start_step}, train_time {self.training_time_ms:.0f}ms"
                + (f"; changed on the command line: {', '.join(changed)}" if changed else "; every setting as saved"))
        self.written = [] if log.size_before is None else [
            p for p in checkpoints_in(os.path.join(a.log_dir, a.run_id)) if checkpoint_step(p) <= self.start_step]

    def save(self, step, training_time_ms):
        path = os.path.join(self.a.log_dir, self.a.run_id, f"state_step{step:06d}.pt")
        save_checkpoint(path, self.model, self.optimizers, step, self.loader, training_time_ms, self.a, self.written)
        self.log(f"saved checkpoint {path}")


def tensor_digest(obj) -> str:
    """sha256 over every tensor in a nested state (names, dtypes, shapes, bytes): torch's zip reader checks no
    CRC, so a checkpoint carries this, and a file whose bytes changed is refused instead of resumed."""
    h = hashlib.sha256()

    def visit(x, name):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                visit(x[k], f"{name}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, f"{name}[{i}]")
    visit(obj, "")
    return h.hexdigest()


def checkpoint_scalars(state):
    """What the digest covers beside the tensors: step, clock, loader and settings, as one byte tensor."""
    scalars = [state["step"], state["training_time_ms"], state["loader"], state["hyperparameters"]]
    text = json.dumps(scalars + ([state["shards"]] if "shards" in state else []), sort_keys=True, default=str)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def read_checkpoint(path, device, verify=True, mmap=False, resumable=True):
    """A checkpoint of this script, refused in one line (DataError) when it is missing or unreadable, or (verify)
    when its bytes changed since it was saved or its weights are not finite; checkpoints written before the
    digest existed are read unverified. mmap, verify=False: weights read from disk only where used (listings)."""
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
        saved = state["hyperparameters"]
        assert isinstance(saved, dict) and isinstance(state["step"], int) and isinstance(state["model"], dict)
        assert state["step"] >= 0, f"step {state['step']}"
        if resumable:  # optimizer states, data position and clock: what --resume needs beside the weights
            assert len(state["optimizers"]) == 2 and isinstance(state["loader"]["position"], int)
            assert float(state["training_time_ms"]) >= 0
    except FileNotFoundError:
        raise DataError(f"{path}: no such checkpoint file")
    except Exception as e:  # a truncated file, another format, missing keys: all the same to the user
        if re.search(r"unsupported global", str(e), re.I):  # torch's advice (weights_only=False) would run what the file holds
            raise DataError(f"{path}: holds objects other than tensors and settings; refused, since loading them "
                            "could run code (this script's checkpoints hold none)")
        raise DataError(f"{path}: not a readable checkpoint of this script "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
    saved_digest = state.get("digest") if verify else None
    if saved_digest and tensor_digest([state["model"], state["optimizers"], checkpoint_scalars(state)]) != saved_digest:
        raise DataError(f"{path}: its tensors do not match the digest saved with them: the file is corrupted; use "
                        "an earlier checkpoint")
    if verify and not all(bool(w.isfinite().all()) for w in state["model"].values() if w.is_floating_point()):
        raise DataError(f"{path}: its weights are not finite (saved by a run that diverged)")
    return state


def check_train_val_apart(train_files, val_files):
    """The run must not train on its validation set: no val shard may be a train shard, by path, link, bind
    mount (the same inode) or copy (the same bytes)."""
    def identity(path):
        st = os.stat(path)
        return {("inode", st.st_dev, st.st_ino), ("bytes", file_sha256(path))}
    train = {key: path for path in train_files for key in identity(path)}
    for path in val_files:
        if same := [train[key] for key in identity(path) if key in train]:
            raise DataError(f"--val_files {path} is --train_files {same[0]} (the same file, a link or a copy of "
                            "its bytes): the run would train on its validation set")


def shard_hashes(a):
    """{"train": [...], "val": [...]}: the sha256 of each shard the run reads, in the globs' order."""
    return {split: [file_sha256(p) for p in sorted(glob.glob(pattern)) if os.path.isfile(p)]
            for split, pattern in (("train", a.train_files), ("val", a.val_files))}


def check_checkpoint_fits(a, state):
    """A checkpoint fits only a model of the same shape and mode, and continues only on the bytes it trained and
    validated on (a checkpoint from before the shards' hashes were saved is not checked for them)."""
    saved = state["hyperparameters"]
    differ = [f"{f} {saved[f]!r} -> {getattr(a, f)!r}" for f in SHAPE_FIELDS
              if f in saved and saved[f] != getattr(a, f)]
    if differ:
        raise DataError(f"--resume {a.resume}: the checkpoint's model differs from this run's: {', '.join(differ)}")
    now = shard_hashes(a)
    saved_shards = state.get("shards", {})
    changed = [split for split in ("train", "val") if split in saved_shards and saved_shards[split] != now[split]]
    if changed:
        raise DataError(f"--resume {a.resume}: the {' and '.join(changed)} shards' bytes differ from those the "
                        "checkpoint trained on (their sha256): resume on the same data, or start a new run")


def finished_before(a, state):
    """A checkpoint with nothing left to train: past --num_iterations, or at it with its log already ended (a run
    killed between its final checkpoint and its final line is finished instead: the final validation and line)."""
    if state["step"] != a.num_iterations:
        return state["step"] > a.num_iterations
    if not continues_own_run(a) or not os.path.exists(log_path(a)):
        return False
    lines = read_text(log_path(a)).splitlines()
    last_section = max((i for i, line in enumerate(lines) if line.startswith("hyperparameters: {")), default=0)
    return any(line.startswith("final ") for line in lines[last_section:])


def restore_checkpoint(state, model, optimizers, loader, path):
    """Loads a checkpoint's weights, optimizer states and data position; the learning rates stay this run's
    (a resume may change them). Returns (step, training_time_ms) to continue from."""
    command_line_lrs = [[g["initial_lr"] for g in opt.param_groups] for opt in optimizers]
    try:
        model.load_state_dict(state["model"])
        for opt, opt_state in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(opt_state)  # this brings back the checkpoint's learning rates...
    except (RuntimeError, ValueError, KeyError) as e:
        raise DataError(f"--resume {path}: its weights or optimizer states do not fit this model "
                        f"({str(e).splitlines()[0][:200]})")
    for opt, lrs in zip(optimizers, command_line_lrs):
        for group, lr in zip(opt.param_groups, lrs):
            group["initial_lr"] = lr  # ...but this run's are the ones it asked for
    loader.set_state(state["loader"])
    return state["step"], state["training_time_ms"]


def environment_lines(device, world_size, a=None):
    """The log's header after the sources: versions and hardware; with a (rank 0), what the run read: the code's
    commit and the data's bytes, so that a number in records/ names what made it."""
    lines = [f"python {platform.python_version()} torch {torch.__version__} on {platform.platform()}",
             f"device: {device} world_size: {world_size} cpu_threads: {torch.get_num_threads()}"]
    if a is not None:
        lines.append(f"git: {git_state(os.path.dirname(os.path.abspath(__file__)))}")
        lines += [f"data: {path} sha256 {file_sha256(path)}"  # regular files only: reading a pipe would block
                  for path in sorted(glob.glob(a.train_files)) + sorted(glob.glob(a.val_files)) if os.path.isfile(path)]
    if device.type == "cuda":
        lines.append(f"gpu: {torch.cuda.get_device_name(device)} cuda {torch.version.cuda}")
        try:
            lines.append(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    return lines


# -----------------------------------------------------------------------------------------------------
# Settings and shards, checked before anything is read or built (the script's parse_args and loaders call these)

LR_FIELDS = ("lr_embed", "lr_head", "lr_scalar", "lr_muon", "lr_cp")
INVOCATION_FIELDS = ("preset", "resume", "run_id", "log_dir", "overwrite")  # about this command, not the run


def check_args(a, given=()):
    """Every setting in range, before anything is read or built; given: the flags on the command line."""
    def need(ok, message):
        if not ok:
            raise UsageError(message)

    need(a.cplm in (0, 1), f"--cplm must be 0 or 1, not {a.cplm}")
    need(a.seq_len > 0 and a.seq_len % 128 == 0, f"--seq_len must be a positive multiple of 128, not {a.seq_len}")
    need(a.val_seq_len > 0 and a.val_seq_len % 128 == 0, "--val_seq_len must be a positive multiple of 128")
    need(a.batch_size > 0 and a.batch_size % a.seq_len == 0, "--batch_size must be a multiple of --seq_len")
    need(a.val_tokens >= 0 and a.val_tokens % a.val_seq_len == 0,
         "--val_tokens must be a multiple of --val_seq_len (0: no validation)")
    need(a.val_tokens > 0 or a.target_val_loss == 0, "--target_val_loss needs validation: --val_tokens > 0")
    need(a.num_heads >= 1 and a.model_dim >= a.num_heads, "--num_heads must be >= 1 and --model_dim >= --num_heads")
    need(a.model_dim % a.num_heads == 0 and (a.model_dim // a.num_heads) % 4 == 0,
         "--model_dim must be num_heads x head_dim with head_dim a multiple of 4")
    need(a.num_layers >= 2 and a.num_layers % 2 == 0 and a.num_iterations >= 0, "--num_layers must be even and "
         "positive (the U-net pairs each layer of the first half with one of the second), --num_iterations >= 0")
    need(0 <= a.attn_window_start <= a.attn_window, "need 0 <= --attn_window_start <= --attn_window")
    need(a.no_attention_layer >= -1, "--no_attention_layer is a layer index, or -1 for none")
    need(a.fp8_head in (-1, 0, 1) and a.cp_backend in ("auto", "flex", "dense", "lse_kernel"),
         "--fp8_head must be -1, 0 or 1; --cp_backend auto, flex, dense or lse_kernel")
    need(a.cp_chunk >= 0, f"--cp_chunk must be >= 0 (0: the device's default), not {a.cp_chunk}")
    need(a.vocab_size >= 0 and (a.bos_id == -1 or 0 <= a.bos_id < (a.vocab_size or 2 ** 31)),
         "--vocab_size must be >= 0 (0: from the shards) and --bos_id a token id below it (-1: the last id)")
    need(a.cp_dim > 0 and a.cp_optimizer in ("adam", "muon"), "--cp_dim must be > 0, --cp_optimizer adam|muon")
    need(0 <= a.copy_gate_init < 1, "--copy_gate_init is the gate's starting value: it must lie in [0, 1)")
    need(a.dist_timeout_s > 0 and a.train_loss_every >= 0, "--dist_timeout_s must be > 0, --train_loss_every >= 0")
    need(0 <= a.cooldown_frac <= 1, "--cooldown_frac must lie in [0, 1]")
    need(0 <= a.logit_softcap <= 1000, f"--logit_softcap must lie in [0, 1000] (0: no soft-cap; the record's is 15), "
         f"not {a.logit_softcap}: a huge cap makes every logit equal")
    # sizes past any model this script can build fail later and worse (a 256 GB allocation, an overflow)
    limits = dict(num_layers=1024, model_dim=65536, num_heads=4096, cp_dim=65536, vocab_size=2 ** 24,
                  attn_window=2 ** 24, attn_window_start=2 ** 24, seq_len=2 ** 24, val_seq_len=2 ** 24,
                  batch_size=2 ** 31, val_tokens=2 ** 31, cp_chunk=2 ** 24, num_iterations=10 ** 9,
                  dist_timeout_s=7 * 86400, no_attention_layer=1023)
    need(all(getattr(a, f) <= m for f, m in limits.items()), "too large: " + ", ".join(
        f"--{f} {getattr(a, f)} (at most {m})" for f, m in limits.items() if getattr(a, f) > m))
    # the presets' 7 on the cpu preset's 4 layers means none; a layer named on the command line must exist
    need("no_attention_layer" not in given or a.no_attention_layer < a.num_layers,
         f"--no_attention_layer {a.no_attention_layer} is not a layer of a {a.num_layers}-layer model "
         "(-1: every layer has attention)")
    need(a.cp_backend != "lse_kernel" or (16 <= a.cp_dim <= 256 and a.cp_dim & (a.cp_dim - 1) == 0),
         f"--cp_backend lse_kernel needs --cp_dim a power of two from 16 to 256 (a Triton dot's), not {a.cp_dim}")
    need(a.cp_backend not in ("flex", "lse_kernel") or torch.cuda.is_available(),
         f"--cp_backend {a.cp_backend} needs a CUDA GPU (FlexAttention has no backward on CPU; the kernel is "
         "Triton's): use --cp_backend dense or auto")
    need(a.cplm == 1 or a.copy_gate_init == 0, "--copy_gate_init sets the CP head's gate: it needs --cplm 1")
    need(a.cplm == 1 or a.cp_stop_grad != 1, "--cp_stop_grad is an ablation of the CP head: it needs --cplm 1")
    need(a.copy_gate in ("lm", "sentinel") and (a.copy_gate == "lm" or (a.cplm == 1 and a.copy_gate_init == 0)),
         f"--copy_gate is lm or sentinel (got {a.copy_gate!r}); sentinel needs --cplm 1 and no --copy_gate_init")
    need(all(x in (0, 1) for x in (a.cp_stop_grad, a.save_checkpoint, a.overwrite, a.coordinate_descent))
         and a.compile in (-1, 0, 1),
         "--cp_stop_grad, --save_checkpoint, --overwrite and --coordinate_descent must be 0 or 1, --compile -1, 0 or 1")
    lrs = {f: getattr(a, f) for f in LR_FIELDS}
    # at most 1e6: Adam's first step moves by lr / (1 - beta1), which above ~1e37 no longer fits a float32
    need(all(0 <= v <= 1e6 for v in lrs.values()), "learning rates must lie in [0, 1e6]: " + ", ".join(
        f"--{k} {v}" for k, v in lrs.items() if not 0 <= v <= 1e6))
    need(0 <= a.muon_momentum < 1, "--muon_momentum must lie in [0, 1)")
    need(a.muon_momentum_warmup_steps >= 0, "--muon_momentum_warmup_steps must be >= 0")
    need(0 <= a.seed < 2 ** 63 and -1 <= a.data_seed < 2 ** 63,
         "--seed must lie in [0, 2^63), --data_seed in [-1, 2^63)")
    intervals = ("val_loss_every", "train_loss_every", "checkpoint_every", "warmup_steps", "target_val_loss")
    need(all(getattr(a, f) >= 0 for f in intervals), "must be >= 0: " + ", ".join(
        f"--{f} {getattr(a, f)}" for f in intervals if not getattr(a, f) >= 0))  # nan too
    need(math.isfinite(a.target_val_loss), f"--target_val_loss must be a finite loss (0: none), not "
         f"{a.target_val_loss}")
    need(a.keep_checkpoints >= 1, "--keep_checkpoints must be >= 1")
    need(re.fullmatch(r"[\w.-]*", a.run_id) is not None and a.run_id not in (".", ".."),
         f"--run_id {a.run_id!r} must be a plain name (letters, digits, '.', '_', '-'): it names files")
    need(len(a.run_id) <= 200, f"--run_id is {len(a.run_id)} characters: at most 200 (it names files)")
    need(a.log_dir != "", "--log_dir must name a folder (default logs)")


def settings_on_resume(a, saved: dict, given=()):
    """The checkpoint's settings for every field not given on this command line; the given ones that differ
    from the checkpoint's, as lines for the log ("--batch_size 2048 -> 4096"). Flags that only set the initial
    weights are ignored: the weights come from the checkpoint."""
    names = [f.name for f in dataclasses.fields(a) if f.name not in INVOCATION_FIELDS]
    kept = {f: saved[f] for f in names if f in saved and (f not in given or f in ("seed", "copy_gate_init"))}
    lines = [f"--{f} {getattr(a, f)!r} ignored (the checkpoint's weights are loaded)" if f in kept else
             f"--{f} {saved[f]!r} -> {getattr(a, f)!r}"
             for f in names if f in saved and f in given and saved[f] != getattr(a, f)]
    return dataclasses.replace(a, **kept), lines


SHARD_MAGIC = 20240520
SHARD_DTYPES = {1: np.uint16, 2: np.uint32}  # version -> token type


def shard_header(path: str) -> tuple[np.dtype, int, int]:
    """(token dtype, token count, vocabulary size or 0) of one shard, its header checked against the file."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a pipe would block the read below forever
            raise DataError(f"{path}: not a regular file (a folder, pipe or device), so not a token shard")
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype="<i4", count=256)
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror})")
    if size < 1024:
        raise DataError(f"{path}: {size} bytes, too short for the 1024-byte shard header")
    if header[0] != SHARD_MAGIC:
        raise DataError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
    if header[1] not in SHARD_DTYPES:
        raise DataError(f"{path}: unsupported shard version {header[1]} (1 = uint16, 2 = uint32 tokens)")
    dtype, count = np.dtype(SHARD_DTYPES[int(header[1])]), int(header[2])
    if size != 1024 + count * dtype.itemsize:
        raise DataError(f"{path}: truncated or padded: header says {count} tokens ({1024 + count * dtype.itemsize} "
                        f"bytes with the header), the file has {size} bytes")
    if header[3] < 0:
        raise DataError(f"{path}: header states a vocabulary of {header[3]} ids")
    return dtype, count, int(header[3])


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str):
    """Every id must index the embedding: one pass over the tokens, so a bad id fails here, not hours in."""
    if len(tokens) and int(tokens.max()) >= vocab_size:
        raise DataError(f"{where}: holds token id {int(tokens.max())}, but --vocab_size is {vocab_size} (ids "
                        f"0..{vocab_size - 1}); pass the tokenizer's vocabulary size or rebuild the shards")


def find_shards(pattern: str) -> list[str]:
    files = sorted(glob.glob(pattern))
    if not files:
        raise DataError(f"no shards match {pattern}: fetch FineWeb with `python data/cached_fineweb10B.py 10`, "
                        "or build the CPU corpus with `bash run.sh` (see README.md)")
    return files


def header_vocab_size(patterns: list[str]) -> int:
    """The vocabulary size the shards' headers state (0 where none does, as in the FineWeb shards); shards
    that state different sizes are an error."""
    sizes = {path: shard_header(path)[2] for pattern in patterns for path in find_shards(pattern)}
    stated = {v for v in sizes.values() if v > 0}
    if len(stated) > 1:
        examples = ", ".join(f"{p}: {v}" for p, v in list(sizes.items()) if v > 0)
        raise DataError(f"the shards state different vocabularies ({examples}): use shards of one tokenizer")
    return stated.pop() if stated else 0


GPT2_VOCAB_SIZE = 50257  # the FineWeb shards' tokenizer; their headers state no vocabulary


def resolve_vocabulary(a):
    """vocab_size from the shards' headers where they state one (a given --vocab_size must agree), else
    GPT-2's; bos_id -1 becomes the last id (GPT-2's 50256, the byte tokenizer's 256)."""
    stated = header_vocab_size([a.train_files, a.val_files])
    if stated > 2 ** 24:  # --vocab_size's own limit: a 5 GB embedding table means a bad header, not a model
        raise DataError(f"the shards' headers state a vocabulary of {stated} ids, more than 2^24: not this script's")
    if stated and a.vocab_size and a.vocab_size != stated:
        raise DataError(f"the shards were written for a vocabulary of {stated} ids, --vocab_size is {a.vocab_size}: "
                        f"drop --vocab_size or pass {stated}")
    vocab_size = a.vocab_size or stated or GPT2_VOCAB_SIZE
    # the 4 embedding tables and the head, with their gradients and Adam's two moments: 4 float32 copies each
    need, have = 4 * 4 * 5 * vocab_size * a.model_dim, machine_memory()
    if have and need > have:
        raise DataError(f"a vocabulary of {vocab_size} ids ({'the shards state it' if stated else '--vocab_size'}) "
                        f"needs {need / 2 ** 30:.1f} GiB for its tables alone, more than this machine's "
                        f"{have / 2 ** 30:.1f} GiB: a bad header or flag, not a model to train here")
    bos_id = vocab_size - 1 if a.bos_id == -1 else a.bos_id
    if bos_id >= vocab_size:
        raise UsageError(f"--bos_id {bos_id} is not a token id of a {vocab_size}-id vocabulary")
    return dataclasses.replace(a, vocab_size=vocab_size, bos_id=bos_id)




def machine_memory():
    """Bytes of memory the run's tensors can use: the GPU's, else the machine's (0 where unknown)."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0
