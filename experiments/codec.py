"""Text <-> token ids for a trained checkpoint: the tokenizer its shards were written with.

Shared by sample.py, needle.py and copy_picture.py. Which tokenizer, in this order:
  --tokenizer PATH   a `tokenizers` tokenizer.json (as data/prose_corpus.py writes data/prose<V>/tokenizer.json);
  V = 257            bytes (data/tokenize_corpus.py --encoding bytes: UTF-8 bytes 0..255, BOS 256);
  V = 50257          GPT-2 through tiktoken (the FineWeb shards; offline it needs TIKTOKEN_CACHE_DIR);
  otherwise          the tokenizer.json beside the checkpoint's training shards (the folder of its
                     --train_files, relative to where training ran: the repository root), when the meta.json
                     there states the checkpoint's vocabulary size.
"""
import json
import os

import cli  # noqa: F401,E402  (experiments/cli.py puts the repository root on sys.path)

import train_gpt_cplm as tg  # noqa: E402


class CodecError(Exception):
    """No tokenizer fits the checkpoint, or one cannot be loaded: one line, exit 1."""


class Codec:
    """encode (text -> ids, no BOS), decode (ids -> text, BOS dropped), piece (one id -> its text)."""

    def __init__(self, name, bos_id, encode, decode, piece):
        self.name, self.bos_id = name, bos_id
        self.encode, self.decode, self.piece = encode, decode, piece


def byte_codec():
    def decode(ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    return Codec("bytes", 256, lambda text: list(text.encode("utf-8")), decode,
                 lambda i: decode([i]) if i < 256 else "")


def gpt2_codec():
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # not installed, or offline without its files
        raise CodecError(f"cannot load GPT-2's tokenizer through tiktoken ({type(e).__name__}); install tiktoken "
                         "and, offline, point TIKTOKEN_CACHE_DIR at its files")
    bos = enc.eot_token
    return Codec("gpt2", bos, enc.encode_ordinary, lambda ids: enc.decode([i for i in ids if i != bos]),
                 lambda i: enc.decode_single_token_bytes(i).decode("utf-8", errors="replace") if i != bos else "")


def json_codec(path, vocab_size, bos_id):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise CodecError("the tokenizers library is missing: pip install tokenizers")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise CodecError(f"{path}: not a tokenizers tokenizer.json ({type(e).__name__}: {str(e)[:120]})")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise CodecError(f"{path}: a tokenizer of {size} ids, but the checkpoint has a vocabulary of {vocab_size}")
    tok.encode_special_tokens = True  # as data/prose_corpus.py: a literal "<|bos|>" in a text is text

    def decode(ids):
        return tok.decode([i for i in ids if i != bos_id])

    return Codec(os.path.basename(os.path.dirname(os.path.abspath(path))) or "tokenizer.json", bos_id,
                 lambda text: tok.encode(text, add_special_tokens=False).ids, decode,
                 lambda i: decode([i]))


def codec_for(a: tg.Hyperparameters, tokenizer_path=None) -> Codec:
    """The tokenizer of the checkpoint whose hyperparameters are a (see the module docstring)."""
    if tokenizer_path:
        if not os.path.isfile(tokenizer_path):
            raise CodecError(f"--tokenizer {tokenizer_path}: no such file")
        return json_codec(tokenizer_path, a.vocab_size, a.bos_id)
    if a.vocab_size == 257:
        return byte_codec()
    if a.vocab_size == tg.GPT2_VOCAB_SIZE:
        return gpt2_codec()
    folder = os.path.dirname(a.train_files)
    candidate, meta = os.path.join(folder, "tokenizer.json"), os.path.join(folder, "meta.json")
    if os.path.isfile(candidate) and os.path.isfile(meta):
        try:
            stated = json.load(open(meta)).get("vocab_size")
        except (OSError, ValueError):
            stated = None
        if stated == a.vocab_size:
            return json_codec(candidate, a.vocab_size, a.bos_id)
    raise CodecError(f"no tokenizer found for a vocabulary of {a.vocab_size} ids (looked for {candidate} with a "
                     f"meta.json stating it): pass --tokenizer PATH/tokenizer.json")
