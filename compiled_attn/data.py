"""Training data every machine has: the Python standard library's own source, as bytes.

Documents are the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (installed
packages in ``site-packages`` / ``dist-packages`` left out), read as bytes and kept when
they are non-empty valid UTF-8; a token is a byte (the project's
:class:`~compiled_attn.tokenizer.ByteTokenizer`: id = byte value, 256 ids). Each file
goes to the validation split when a hash of its path relative to the root says so
(:func:`is_validation_file`), so the split is the same on every machine and run, and no
file is in both.

Packing (no padding): a split's files are concatenated in path order into one stream;
training row ``r`` is stream tokens ``[r L, (r + 1) L)`` (``L = seq_len``) with targets
shifted by one. Inside a row, each document (or piece of one, at a row edge) is its own
varlen sequence: ``cu_seqlens_q`` marks where documents start, positions restart at 0
there, and attention never crosses a document boundary. A token whose next byte starts
another document has no target (``IGNORE_INDEX``).
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from .metadata import AttentionMetadata

IGNORE_INDEX = -100
"""Target of a token with nothing to predict (``torch.nn.functional.cross_entropy``'s default)."""

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """``sysconfig.get_paths()["stdlib"]``: the standard library of this interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_validation_file(relative_path: str | Path, val_fraction: float) -> bool:
    """Whether the file at ``relative_path`` (relative to the corpus root, compared in its
    POSIX form) belongs to the validation split.

    The first 8 bytes of the SHA-256 of the path, as an unsigned integer over ``2**64``,
    fall below ``val_fraction``: independent of the machine, the root's location and the
    other files, and about ``val_fraction`` of the files.

    Raises:
        ValueError: ``val_fraction`` outside ``[0, 1)``.
    """
    _check_fraction(val_fraction)
    digest = hashlib.sha256(Path(relative_path).as_posix().encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2 ** 64 < val_fraction


def _check_fraction(val_fraction: float) -> None:
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")


def corpus_files(root: str | Path | None = None) -> list[Path]:
    """The ``.py`` files under ``root`` (default :func:`stdlib_root`), as paths relative to
    it in sorted order, directories named in ``EXCLUDED_DIRS`` left out.

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"data root {root} is not a directory")
    files = (p.relative_to(root) for p in root.rglob("*.py") if p.is_file())
    return sorted(p for p in files if not EXCLUDED_DIRS.intersection(p.parts[:-1]))


@dataclass
class TokenStream:
    """A split as one stream of byte tokens.

    Attributes:
        tokens: ``[N]`` uint8, the documents back to back.
        doc_starts: ``[N]`` bool, ``True`` at each document's first token.
        files: the documents' relative paths, in stream order.
    """

    tokens: torch.Tensor
    doc_starts: torch.Tensor
    files: list[str]

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def num_rows(self, seq_len: int) -> int:
        """Whole rows of ``seq_len`` inputs (each also needs its next token as a target)."""
        return max(self.num_tokens - 1, 0) // seq_len


@dataclass
class Corpus:
    """The train and validation streams of one root and split fraction."""

    train: TokenStream
    val: TokenStream
    root: Path
    val_fraction: float


def load_corpus(root: str | Path | None = None, val_fraction: float = 0.05) -> Corpus:
    """Read every file of :func:`corpus_files` and split it with :func:`is_validation_file`.

    Files that are empty or not valid UTF-8 are skipped (the model learns valid UTF-8).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
        ValueError: ``val_fraction`` outside ``[0, 1)``; no usable file; a split empty
            (say, a root of one file with ``val_fraction > 0``).
    """
    _check_fraction(val_fraction)
    root = stdlib_root() if root is None else Path(root)
    parts: dict[bool, list[tuple[str, bytes]]] = {False: [], True: []}
    for rel in corpus_files(root):
        data = (root / rel).read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if data:
            parts[is_validation_file(rel, val_fraction)].append((rel.as_posix(), data))
    for is_val, name in ((False, "train"), (True, "validation")):
        if not parts[is_val] and (is_val is False or val_fraction > 0):
            raise ValueError(f"data root {root} with val_fraction={val_fraction} leaves the {name} split "
                             f"without files ({sum(map(len, parts.values()))} usable .py files in all)")
    return Corpus(_stream(parts[False]), _stream(parts[True]), root, val_fraction)


def _stream(documents: list[tuple[str, bytes]]) -> TokenStream:
    blob = b"".join(data for _, data in documents)
    tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    doc_starts = torch.zeros(len(blob), dtype=torch.bool)
    offset = 0
    for _, data in documents:
        doc_starts[offset] = True
        offset += len(data)
    return TokenStream(tokens, doc_starts, [name for name, _ in documents])


@dataclass
class PackedBatch:
    """One step's packed rows.

    Attributes:
        metadata: ``input_ids`` ``[T]`` int64 (``T = rows * seq_len``), ``positions``
            ``[T]`` (restarting at 0 at each document and row start), ``cu_seqlens_q``
            ``[B + 1]`` int32 (``B`` = document pieces), ``seq_lens`` ``[B]``; no cache
            (``slot_mapping`` all ``PAD_SLOT_ID``, one-column ``block_table``),
            ``prefill_only=True``: the model runs varlen attention over the fresh K/V.
        targets: ``[T]`` int64 next byte, ``IGNORE_INDEX`` where the next byte starts
            another document.
        causal_pairs: ``Σ n (n + 1) / 2`` over the sequences' lengths ``n``: the (query,
            key) pairs causal attention computes (a host int, for FLOP counts).
    """

    metadata: AttentionMetadata
    targets: torch.Tensor
    causal_pairs: int = 0

    @property
    def num_tokens(self) -> int:
        return self.targets.numel()


def pack_rows(stream: TokenStream, rows: torch.Tensor | list[int], seq_len: int,
              device: torch.device | str = "cpu") -> PackedBatch:
    """Rows ``rows`` of ``stream`` (see the module docstring) as one varlen batch on ``device``.

    Raises:
        ValueError: ``seq_len < 1``, no rows, or a row index outside
            ``[0, stream.num_rows(seq_len))``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    rows = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
    available = stream.num_rows(seq_len)
    if rows.numel() == 0 or int(rows.min()) < 0 or int(rows.max()) >= available:
        raise ValueError(f"rows must be a non-empty set of indices in [0, {available}) for seq_len={seq_len}, "
                         f"got {rows.tolist()[:8]}")
    index = (rows[:, None] * seq_len + torch.arange(seq_len)).reshape(-1)  # [T] input tokens
    inputs = stream.tokens[index].long()
    targets = stream.tokens[index + 1].long()
    targets[stream.doc_starts[index + 1]] = IGNORE_INDEX  # the next byte is another file's
    starts = stream.doc_starts[index].clone()
    starts[::seq_len] = True  # each row starts a sequence
    total = index.numel()
    start_idx = torch.nonzero(starts).reshape(-1)
    cu_seqlens = torch.cat([start_idx, torch.tensor([total])]).to(torch.int32)
    arange = torch.arange(total)
    positions = arange - torch.cummax(torch.where(starts, arange, 0), 0).values
    seq_lens = cu_seqlens.diff()
    md = AttentionMetadata(
        input_ids=inputs.to(device), positions=positions.to(device),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=device),
        cu_seqlens_q=cu_seqlens.to(device), seq_lens=seq_lens.to(device),
        block_table=torch.zeros((seq_lens.numel(), 1), dtype=torch.int32, device=device),
        prefill_only=True,
    )
    return PackedBatch(md, targets.to(device), int((seq_lens.long() * (seq_lens.long() + 1) // 2).sum()))


def train_rows(num_rows: int, batch_rows: int, step: int, seed: int) -> torch.Tensor:
    """Row indices of training step ``step`` (0-based): epochs of a permutation of the
    ``num_rows`` rows drawn from ``seed + epoch``, read ``batch_rows`` at a time across
    epoch ends. A function of its arguments only, so a resumed run reads the rows an
    uninterrupted one would.

    Raises:
        ValueError: ``batch_rows > num_rows`` (a step would repeat rows), or sizes < 1.
    """
    if num_rows < 1 or batch_rows < 1 or batch_rows > num_rows:
        raise ValueError(f"batch_rows must lie in [1, num_rows={num_rows}] (the training rows), got {batch_rows}")
    first = step * batch_rows
    out = []
    while len(out) < batch_rows:
        epoch, offset = divmod(first + len(out), num_rows)
        out.extend(_permutation(num_rows, seed + epoch)[offset:offset + batch_rows - len(out)])
    return torch.tensor(out, dtype=torch.int64)


@functools.lru_cache(maxsize=4)
def _permutation(num_rows: int, seed: int) -> tuple[int, ...]:
    """``torch.randperm(num_rows)`` from a CPU generator seeded with ``seed`` (the same on
    every machine), as an immutable tuple so the cache can hand it out."""
    return tuple(torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist())
