"""Reading Hugging Face checkpoints (safetensors only) from a local directory.

A checkpoint is either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (its ``weight_map`` decides which file holds which
tensor). One ``safe_open`` handle is kept per shard file; ``read_slice`` goes through
``get_slice`` so a tensor-parallel rank reads only the bytes of its part.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
MEDUSA_FILE = "medusa_lm_head.safetensors"   # draft heads beside a model (engine.models.medusa), never its weights
_LIST_LIMIT = 10  # names shown per problem kind in check()
_FINITE_CHUNK = 1 << 26   # elements that count_non_finite tests at a time (its temporaries stay below ~128 MB)

# safetensors dtype strings -> torch dtypes.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what was wrong and what to do."""


def read_config(model_dir: str | Path) -> dict:
    """The model's ``config.json`` as a dict."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a Hugging Face model directory must hold config.json "
                              f"next to its weights; point --model-id at such a directory")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}); expected the model's config.json: "
                              f"re-download or regenerate it") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, expected an object; "
                              f"re-download or regenerate it")
    return config


def open_checkpoint(model_dir: str | Path) -> "Checkpoint":
    """Open the safetensors weights in ``model_dir`` (single file or index + shards)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist (or is not a directory); "
                              f"expected a local Hugging Face checkpoint directory: check the path")
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return Checkpoint(model_dir, _weight_map_from_index(index_path))
    if (model_dir / SINGLE_FILE).is_file():
        return Checkpoint(model_dir, None, files=[SINGLE_FILE])
    files = sorted(p.name for p in model_dir.glob("*.safetensors") if p.name != MEDUSA_FILE)
    if files:  # shards without an index: each file's own header says what it holds
        return Checkpoint(model_dir, None, files=files)
    if list(model_dir.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{model_dir} holds only PyTorch .bin weights; safetensors required: convert it (e.g. transformers "
            f"`save_pretrained(..., safe_serialization=True)`) or use a repo that ships .safetensors")
    raise CheckpointError(f"no weights in {model_dir}: expected {SINGLE_FILE} or {INDEX_FILE} with its shards; "
                          f"download the model's safetensors files into this directory")


def _weight_map_from_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index_path} is not a valid safetensors index ({err!r}); expected JSON with a "
                              f"'weight_map' of tensor name -> shard file: re-download it") from err
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_path} has an empty or malformed 'weight_map'; expected tensor name -> "
                              f"shard file: re-download it")
    missing = sorted({f for f in weight_map.values() if not (index_path.parent / f).is_file()})
    if missing:
        raise CheckpointError(f"{index_path.name} lists shard file(s) that are absent from {index_path.parent}: "
                              f"{_short_list(missing)}; download the missing shard(s) (or the whole repo) again")
    return dict(weight_map)


def _short_list(items: list, limit: int = _LIST_LIMIT) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


class Checkpoint:
    """Named tensors of one checkpoint, read lazily from safetensors files.

    ``weight_map`` (tensor name -> file name) comes from the index; without an index the
    headers of ``files`` are read. Handles stay open until ``close()``.
    """

    def __init__(self, model_dir: Path, weight_map: dict[str, str] | None, files: list[str] | None = None):
        self.model_dir = Path(model_dir)
        self._handles: dict[str, object] = {}
        if weight_map is None:
            weight_map = {}
            for file in files or []:
                for name in self._handle(file).keys():
                    if name in weight_map:
                        raise CheckpointError(
                            f"tensor {name!r} is in both {weight_map[name]} and {file} in {self.model_dir}; "
                            f"expected each tensor in one file: add a {INDEX_FILE} or remove the extra file")
                    weight_map[name] = file
        self._weight_map = weight_map
        self._stored_names: dict[str, str] = {}       # name -> name in the file, where ``renamed`` changed it
        # (name, dtype as read, its count of NaN and infinite values on the read's device): what verify_finite checks
        self._unverified: list[tuple[str, torch.dtype, torch.Tensor]] = []

    # -- handles -----------------------------------------------------------------------
    def _handle(self, file: str):
        handle = self._handles.get(file)
        if handle is None:
            path = self.model_dir / file
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as err:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open {path} as safetensors ({err}); the file is corrupt or "
                                      f"truncated: download it again") from err
            self._handles[file] = handle
        return handle

    def _file_of(self, name: str) -> str:
        try:
            return self._weight_map[name]
        except KeyError:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.model_dir}; "
                                  f"it holds {len(self._weight_map)} tensors (see Checkpoint.names())") from None

    def _slice(self, name: str):
        file, stored = self._file_of(name), self._stored_names.get(name, name)
        handle = self._handle(file)         # a file that does not open says so itself
        try:
            return handle.get_slice(stored)
        except Exception as err:  # safetensors' own error: the file lacks the tensor its index names
            raise CheckpointError(f"{INDEX_FILE} in {self.model_dir} puts tensor {stored!r} in {file}, which does "
                                  f"not hold it ({err}): the index and its shards are from different downloads; "
                                  f"download the checkpoint again") from err

    def renamed(self, rename: Callable[[str], str]) -> "Checkpoint":
        """The same tensors (same open files) under ``rename(name)``: one naming for checkpoints that spell a
        model's names two ways (Bloom's with and without transformers' ``transformer.`` prefix)."""
        weight_map, stored = {}, {}
        for name, file in self._weight_map.items():
            new = rename(name)
            if new in weight_map:
                raise CheckpointError(f"tensors {stored[new]!r} and {name!r} in {self.model_dir} are both named "
                                      f"{new!r}: the checkpoint holds one tensor twice; remove one of them")
            weight_map[new], stored[new] = file, self._stored_names.get(name, name)
        view = Checkpoint(self.model_dir, weight_map)
        view._handles, view._stored_names, view._unverified = self._handles, stored, self._unverified
        return view

    # -- metadata ----------------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        code = self._slice(name).get_dtype()
        if code not in _DTYPES:
            raise CheckpointError(f"tensor {name!r} has safetensors dtype {code}, which torch {torch.__version__} "
                                  f"cannot hold; expected one of {sorted(_DTYPES)}")
        return _DTYPES[code]

    # -- reading -----------------------------------------------------------------------
    def read(self, name: str, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """The full tensor, cast to ``dtype`` and moved to ``device`` when given."""
        tensor = self._handle(self._file_of(name)).get_tensor(self._stored_names.get(name, name))
        return self._cast(name, tensor, dtype, device)

    def read_slice(self, name: str, dim: int, part: int, num_parts: int,
                   dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
        """Part ``part`` of ``num_parts`` equal parts of the tensor along ``dim`` (0 or 1).

        Only that part's bytes are read (``get_slice``).
        """
        source = self._slice(name)
        shape = tuple(source.get_shape())
        if dim not in (0, 1) or dim >= len(shape):
            raise CheckpointError(f"cannot slice {name!r} (shape {shape}) along dim {dim}; "
                                  f"expected dim 0 or 1 of a tensor that has it")
        if num_parts < 1 or not 0 <= part < num_parts:
            raise CheckpointError(f"part {part} of {num_parts} is out of range for {name!r}; "
                                  f"expected 0 <= part < num_parts")
        size = shape[dim]
        if size % num_parts:
            raise CheckpointError(f"{name!r} has size {size} along dim {dim} (shape {shape}), which does not divide "
                                  f"into {num_parts} equal parts; choose a --num-shard that divides {size}")
        step = size // num_parts
        window = slice(part * step, (part + 1) * step)
        tensor = source[window] if dim == 0 else source[:, window]
        return self._cast(name, tensor, dtype, device)

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None,
                  device=None) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of the tensor, reading only their bytes: one part of a fused
        tensor (Phi-3's ``qkv_proj``) that a tensor-parallel rank holds."""
        source = self._slice(name)
        rows = tuple(source.get_shape())[0]
        if not 0 <= start < stop <= rows:
            raise CheckpointError(f"rows {start}:{stop} are out of range for {name!r} with {rows} rows")
        return self._cast(name, source[start:stop], dtype, device)

    def _cast(self, name: str, tensor: torch.Tensor, dtype: torch.dtype | None, device) -> torch.Tensor:
        """The tensor on ``device`` in ``dtype``; its NaN and infinite values counted there for ``verify_finite``
        (queued on the device, no wait)."""
        if device is not None:
            tensor = tensor.to(device)
        if dtype is not None:
            tensor = tensor.to(dtype)
        tensor = tensor.contiguous()        # before the count: its flat view then copies nothing
        if tensor.is_floating_point():
            self._unverified.append((name, tensor.dtype, count_non_finite(tensor)))
        return tensor

    def verify_finite(self) -> None:
        """CheckpointError unless every floating-point value read since the last call is finite: a NaN weight makes
        every token garbage, where this names the tensor and says what to do. One wait for all the reads' counts;
        ``progress`` calls it after its last name, and ``close`` when no error is on its way."""
        pending = list(self._unverified)
        self._unverified.clear()
        counts = _to_host(count for _, _, count in pending)
        bad = [(name, dtype, count) for (name, dtype, _), count in zip(pending, counts) if count]
        if bad:
            raise CheckpointError(self._non_finite_message(*bad[0])
                                  + (f" {len(bad)} tensors hold such values: {_short_list([b[0] for b in bad])}."
                                     if len(bad) > 1 else ""))

    def _non_finite_message(self, name: str, dtype: torch.dtype, count: int) -> str:
        """Whether the checkpoint holds the values, or casting its finite values to ``dtype`` made them infinite."""
        stored = self._handle(self._file_of(name)).get_tensor(self._stored_names.get(name, name))
        read_as = str(dtype).removeprefix("torch.")
        if count_non_finite(stored).item():
            return (f"tensor {name!r} holds NaN or infinite values ({count} where this shard read it as {read_as}): "
                    "the checkpoint is broken (a diverged training run, a failed conversion or a damaged file). "
                    "Serve a checkpoint whose weights are all finite.")
        return (f"tensor {name!r} holds {count} values that are infinite in {read_as}: the checkpoint stores them in "
                f"{str(stored.dtype).removeprefix('torch.')} (largest magnitude {float(stored.float().abs().max()):.4g}"
                "). Serve it in a dtype that holds them (--dtype bfloat16 or float32).")

    # -- validation ----------------------------------------------------------------------
    def check(self, expected: dict[str, tuple[int, ...]], ignore_unexpected: tuple[str, ...] = ()) -> None:
        """Raise CheckpointError unless the checkpoint holds exactly ``expected`` (name -> shape, or a list
        of the shapes it may have).

        Names matching any regex in ``ignore_unexpected`` may be present in addition.
        """
        present = set(self._weight_map)
        missing = sorted(set(expected) - present)
        patterns = [re.compile(p) for p in ignore_unexpected]
        unexpected = sorted(n for n in present - set(expected) if not any(p.search(n) for p in patterns))
        misshaped = [f"{n} {self.shape(n)} (expected {_shapes_text(expected[n])})"
                     for n in sorted(set(expected) & present) if self.shape(n) not in _shape_choices(expected[n])]
        problems = []
        if missing:
            problems.append(f"{len(missing)} missing: {_short_list(missing)}")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected: {_short_list(unexpected)}")
        if misshaped:
            problems.append(f"{len(misshaped)} with the wrong shape: {_short_list(misshaped)}")
        if problems:
            raise CheckpointError(
                f"checkpoint {self.model_dir} does not match the model its config.json describes: "
                + "; ".join(problems)
                + ". Use a checkpoint whose weights match its config.json (same architecture and sizes).")

    def progress(self, names: Iterable[str], desc: str = "Loading weights") -> Iterator[str]:
        """``names`` wrapped in one tqdm bar on stderr (shown even when stderr is not a tty); after the last one,
        ``verify_finite``."""
        names = list(names)
        yield from tqdm(names, desc=desc, total=len(names), unit="tensor", file=sys.stderr,
                        disable=False, dynamic_ncols=True, mininterval=0.5)
        self.verify_finite()

    # -- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """``verify_finite``, then the files closed (also when it raises)."""
        try:
            self.verify_finite()
        finally:
            self._handles.clear()  # safe_open handles release their mmap when dropped

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:          # an error on its way: the reads' values are not what it is about
            self._unverified.clear()
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.model_dir)!r}, {len(self._weight_map)} tensors)"


def _shape_choices(expected) -> list[tuple[int, ...]]:
    """A shape, or a list of alternative shapes, as a list of shapes."""
    return [tuple(s) for s in expected] if isinstance(expected, list) else [tuple(expected)]


def _shapes_text(expected) -> str:
    return " or ".join(str(s) for s in _shape_choices(expected))


def count_non_finite(tensor: torch.Tensor) -> torch.Tensor:
    """How many NaN or infinite values a tensor holds (0 for integer dtypes): an int64 scalar on its device, counted
    in chunks with no wait. One-byte floats (float8) are tested as float16, which holds every one of their values.
    The elements less the finite ones: three operations a tensor (five before, with a zero to add to and a negation;
    a load reads thousands of tensors, each op a launch on a GPU). On one H200, loading random Llama-3.1-8B in
    bfloat16 (three loads each, alternating, stop 75): 2.07-2.25 s with this check, 2.08-2.18 with the five
    operations, 2.17-2.23 with none; no cost that a load shows."""
    if not tensor.is_floating_point() or not tensor.numel():
        return torch.zeros((), dtype=torch.int64, device=tensor.device)
    finite = None
    for chunk in tensor.reshape(-1).split(_FINITE_CHUNK):
        count = (chunk.to(torch.float16) if chunk.element_size() == 1 else chunk).isfinite().sum()
        finite = count if finite is None else finite + count
    return tensor.numel() - finite


def _to_host(counts: Iterable[torch.Tensor]) -> list[int]:
    """Device scalars as ints, in order: one copy (one wait) per device."""
    counts = list(counts)
    by_device: dict[torch.device, list[int]] = {}
    for i, count in enumerate(counts):
        by_device.setdefault(count.device, []).append(i)
    values = [0] * len(counts)
    for indices in by_device.values():
        for i, value in zip(indices, torch.stack([counts[i] for i in indices]).tolist()):
            values[i] = value
    return values
