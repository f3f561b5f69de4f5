"""run_files.py: a training run's files, beside train_gpt_cplm.py (which imports it): the log (its claim on the
run_id, the temporary name until the first validation, and undoing a refused start), the lock that keeps one
process per run, and the checkpoints (written whole or not at all, rotated, verified by a digest when read).
None of it changes what a run computes; each log holds this file's source after the training script's.
"""
import contextlib
import dataclasses
import glob
import fcntl
import hashlib
import json
import os
import platform
import re
import socket
import subprocess
import time

import torch


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
                self.undo()
                raise UsageError(f"{self.writing}: cannot write the log ({e.strerror})")

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
    if checkpoints_in(checkpoints) and not a.resume and not a.overwrite:
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
    if run_lock is not None:
        remove_dead_writers_files([a.log_dir], f".{glob.escape(a.run_id)}.txt.starting*")  # killed before starting
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


def file_sha256(path, block=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def settings_digest(a):
    """63 bits of a sha256 of the run's settings (the run_id aside: a rank may have drawn its own), which every
    rank of a run must share."""
    settings = {k: v for k, v in dataclasses.asdict(a).items() if k != "run_id"}
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


def writer_tag():
    return f"{os.getpid()}@{socket.gethostname()}"


def remove_dead_writers_files(folders, pattern):
    """Removes the temporary files (named ...<pid>@<host>, or ...<pid>@<host>.tmp: writer_tag()) in these folders
    whose writer is no longer alive on this machine; a live process's stay, and so do another machine's, whose
    liveness cannot be told from here. Returns the removed paths."""
    removed = []
    for path in sorted(f for folder in folders for f in glob.glob(os.path.join(glob.escape(folder), pattern))):
        m = re.search(r"(\d+)(?:@([^/]*?))?(?:\.tmp)?$", path)
        if m and m[2] is not None and m[2] != socket.gethostname():
            continue  # another machine's writer (a shared filesystem, another container): its pid means nothing here
        try:
            os.kill(int(m[1]), 0)  # a live process's: leave it
        except (TypeError, ProcessLookupError):
            os.remove(path)
            removed.append(path)
        except PermissionError:
            pass
    return removed


SHAPE_FIELDS = ("vocab_size", "num_layers", "model_dim", "num_heads", "no_attention_layer", "cplm", "cp_dim",
                "cp_optimizer")  # a checkpoint only fits a run that agrees on these


def save_checkpoint(path, model, optimizers, step, loader, training_time_ms, a, written):
    """Written to a temporary file and renamed, so a crash never leaves half a checkpoint; then only the
    newest keep_checkpoints of those this run wrote (the list `written`) stay. Another run's are not touched."""
    if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):  # a diverged run: keep the good ones
        raise DataError(f"step {step}: the weights are not finite (the run diverged); no checkpoint saved over the "
                        f"good ones (newest: {written[-1] if written else 'none'}); lower the learning rates")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = dict(step=step, model=model.state_dict(), optimizers=[o.state_dict() for o in optimizers],
                 loader=loader.state(), training_time_ms=training_time_ms, hyperparameters=dataclasses.asdict(a))
    state["digest"] = tensor_digest([state["model"], state["optimizers"], checkpoint_scalars(state)])
    tmp = f"{path}.{writer_tag()}.tmp"  # the writer's pid and host: a live run's file is never taken for stale
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # a full disk: torch's zip writer raises RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = e.strerror if isinstance(e, OSError) else str(e).splitlines()[0][:120]
        raise DataError(f"{path}: cannot save the checkpoint ({reason}); the run stops here, and the previous "
                        "checkpoint is intact")
    written.append(path)
    for old in written[:-a.keep_checkpoints]:
        if os.path.exists(old):
            os.remove(old)
    del written[:-a.keep_checkpoints]


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
    text = json.dumps([state["step"], state["training_time_ms"], state["loader"], state["hyperparameters"]],
                      sort_keys=True, default=str)
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def read_checkpoint(path, device, verify=True, mmap=False, resumable=True):
    """A checkpoint of this script, refused in one line (DataError) when it is missing or unreadable, or (verify)
    when its bytes changed since it was saved or its weights are not finite; checkpoints written before the
    digest existed are read unverified. mmap, verify=False: weights read from disk only where used (listings)."""
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
        saved = state["hyperparameters"]
        assert isinstance(saved, dict) and isinstance(state["step"], int) and isinstance(state["model"], dict)
        if resumable:  # optimizer states, data position and clock: what --resume needs beside the weights
            assert len(state["optimizers"]) == 2 and isinstance(state["loader"]["position"], int)
            assert float(state["training_time_ms"]) >= 0
    except FileNotFoundError:
        raise DataError(f"{path}: no such checkpoint file")
    except Exception as e:  # a truncated file, another format, missing keys: all the same to the user
        raise DataError(f"{path}: not a readable checkpoint of this script "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
    saved_digest = state.get("digest") if verify else None
    if saved_digest and tensor_digest([state["model"], state["optimizers"], checkpoint_scalars(state)]) != saved_digest:
        raise DataError(f"{path}: its tensors do not match the digest saved with them: the file is corrupted; use "
                        "an earlier checkpoint")
    if verify and not all(bool(w.isfinite().all()) for w in state["model"].values() if w.is_floating_point()):
        raise DataError(f"{path}: its weights are not finite (saved by a run that diverged)")
    return state


def check_checkpoint_fits(a, state):
    """A checkpoint fits only a model of the same shape and mode."""
    saved = state["hyperparameters"]
    differ = [f"{f} {saved.get(f)!r} -> {getattr(a, f)!r}" for f in SHAPE_FIELDS if saved.get(f) != getattr(a, f)]
    if differ:
        raise DataError(f"--resume {a.resume}: the checkpoint's model differs from this run's: {', '.join(differ)}")


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
