"""Training text that is on every machine with Python: the standard library's source files,
tokenized by a byte-level BPE (the `tokenizers` library) trained on them, stored as
memory-mapped uint16 token files and read through a torch.utils.data Dataset.

    data_dir/tokenizer.json   the BPE (trained once, cached)
    data_dir/train.bin        uint16 tokens of the training files, <|endoftext|> between files
    data_dir/val.bin          the held-out files (every 20th file by a hash of its path)
    data_dir/meta.json        vocabulary size, token counts, the source folder
"""

import hashlib
import json
import pathlib
import sysconfig

import numpy as np
import torch

EOT = "<|endoftext|>"


def stdlib_files(root=None):
    """The standard library's .py files (tests included), in a fixed order."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages"}
    return root, sorted(f for f in root.rglob("*.py") if not skip & set(f.parts))


def is_held_out(relative_path):
    """Every 20th file by a hash of its path: a fixed split, the same on every machine."""
    return int(hashlib.sha1(str(relative_path).encode()).hexdigest(), 16) % 20 == 0


def read_texts(files):
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts, vocab_size):
    """A byte-level BPE of vocab_size tokens (its last id is <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([EOT])
    return tokenizer


def _write_tokens(tokenizer, texts, path):
    eot = tokenizer.token_to_id(EOT)
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    array = np.asarray(ids, dtype=np.uint16)
    array.tofile(path)
    return len(array)


def prepare(data_dir, vocab_size=16384, root=None, max_files=None):
    """Builds data_dir (tokenizer, token files, meta.json) unless it is there with this
    vocabulary; returns meta.json's contents."""
    data_dir = pathlib.Path(data_dir)
    meta_path = data_dir / "meta.json"
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["vocab_size"] == vocab_size:
            return meta
    root, files = stdlib_files(root)
    files = files[:max_files] if max_files else files
    if not files:
        raise FileNotFoundError(f"gpt_data: no .py files under {root}")
    held_out = [is_held_out(f.relative_to(root)) for f in files]
    train = read_texts(f for f, h in zip(files, held_out) if not h)
    val = read_texts(f for f, h in zip(files, held_out) if h)
    if not val:  # a handful of files: hold out the last
        train, val = train[:-1], train[-1:]
    tokenizer = train_tokenizer(train, vocab_size)
    data_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(data_dir / "tokenizer.json"))
    meta = {
        "vocab_size": tokenizer.get_vocab_size(),
        "train_tokens": _write_tokens(tokenizer, train, data_dir / "train.bin"),
        "val_tokens": _write_tokens(tokenizer, val, data_dir / "val.bin"),
        "source": str(root),
        "files": len(files),
    }
    if meta["vocab_size"] != vocab_size:
        raise ValueError(
            f"gpt_data: the text yields {meta['vocab_size']} tokens, fewer than the "
            f"vocabulary asked for ({vocab_size}); use a smaller vocab_size or more text"
        )
    meta_path.write_text(json.dumps(meta, indent=1))
    return meta


class TokenWindows(torch.utils.data.Dataset):
    """Item i: (tokens, next tokens), seq_len each, from window i of a memory-mapped token file."""

    def __init__(self, path, seq_len):
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len
        if len(self.tokens) <= seq_len:
            raise ValueError(f"{path}: {len(self.tokens)} tokens, fewer than one window")

    def __len__(self):
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i):
        start = i * self.seq_len
        window = torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class StepBatches(torch.utils.data.Sampler):
    """Batches of window indices drawn from (seed, step) alone, so training resumed at a step sees
    the batches an uninterrupted run would have."""

    def __init__(self, num_windows, batch_size, seed, start_step=0, steps=None):
        self.num_windows, self.batch_size = num_windows, batch_size
        self.seed, self.start_step, self.steps = seed, start_step, steps

    def __len__(self):
        return self.steps if self.steps is not None else 2**62

    def __iter__(self):
        step = self.start_step
        while self.steps is None or step < self.start_step + self.steps:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
            yield torch.randint(self.num_windows, (self.batch_size,), generator=g).tolist()
            step += 1


def loader(data_dir, split, seq_len, batch_size, seed, start_step=0, steps=None):
    """A DataLoader of (tokens, targets) [batch, seq_len] batches for split "train" or "val"."""
    dataset = TokenWindows(pathlib.Path(data_dir) / f"{split}.bin", seq_len)
    batches = StepBatches(len(dataset), batch_size, seed, start_step, steps)
    return torch.utils.data.DataLoader(dataset, batch_sampler=batches)
