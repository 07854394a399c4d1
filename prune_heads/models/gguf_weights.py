"""A GGUF file's weights as a lazy state dict, so a GGUF model loads at the size of its weights.

transformers' GGUF loader (for the Llama, Qwen2, Gemma families) dequantises every tensor of the file into one state
dict and then copies it into the model: the weights twice over plus the float32 temporaries, 2.2x the weights at the
peak on SmolLM2-135M. Here the file's tensor table is read without its data, and each tensor is read, dequantised
(gguf-py, as transformers does) and passed through transformers' own per-architecture fix-ups (``TENSOR_PROCESSORS``:
llama.cpp's q/k row permutation, Gemma's ``norm - 1``) only when transformers' loader asks for it, one tensor at a
time: the peak is the model plus one tensor. transformers' newer GGUF path does the same (``LazyGgufTensor``) for the
architectures it has moved over; the values are the ones transformers' own loader produces, bit for bit
(tests/test_gguf_weights.py).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import struct
from dataclasses import dataclass
from math import prod

import numpy as np
import torch

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # GGUF kv types
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str  # GGUF name, e.g. blk.0.attn_q.weight
    shape: tuple[int, ...]  # torch order
    ggml_type: int
    start: int  # absolute byte offset in the file
    nbytes: int


class _Cursor:
    """Reads little-endian GGUF values from a memory-mapped header."""

    def __init__(self, blob: mmap.mmap):
        self.blob, self.pos = blob, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.blob, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.take("Q")
        self.pos += n
        return bytes(self.blob[self.pos - n : self.pos]).decode("utf-8")

    def value(self, kind: int):
        """A metadata value; arrays are skipped (None): the tensor table is all that is needed here."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.take("I"), self.take("Q")
            if inner == _STRING:
                for _ in range(count):
                    n = self.take("Q")  # (not `pos += take()`: that reads pos before take moves it)
                    self.pos += n
            else:
                self.pos += count * struct.calcsize("<" + _SCALAR[inner])
            return None
        return self.take(_SCALAR[kind])


def tensor_table(path: str) -> tuple[str, list[TensorEntry]]:
    """(llama.cpp architecture, the tensors with where they lie), reading the header only."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        c = _Cursor(blob)
        if c.take("I") != 0x46554747:  # b"GGUF"
            raise ValueError(f"{path} is not a GGUF file")
        _version, n_tensors, n_kv = c.take("I"), c.take("Q"), c.take("Q")
        meta = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.take("I"))
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take("Q") for _ in range(c.take("I"))]
            raw.append((name, tuple(reversed(dims)), c.take("I"), c.take("Q")))
        alignment = meta.get("general.alignment") or 32
        data_start = (c.pos + alignment - 1) // alignment * alignment
    entries = []
    for name, shape, kind, offset in raw:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        entries.append(TensorEntry(name, shape, kind, data_start + offset, prod(shape) // block * size))
    return meta["general.architecture"], entries


class LazyGgufTensor:
    """One tensor, read and dequantised to float32 when transformers' loader slices it (``tensor[...]``)."""

    def __init__(self, path: str, entry: TensorEntry, processor):
        self.path, self.entry, self.processor = path, entry, processor

    def __getitem__(self, _) -> torch.Tensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        e = self.entry
        kind = GGMLQuantizationType(e.ggml_type)
        block, size = GGML_QUANT_SIZES[kind]
        raw = np.fromfile(self.path, dtype=np.uint8, count=e.nbytes, offset=e.start)
        values = dequantize(raw.reshape(*e.shape[:-1], e.shape[-1] // block * size), kind)
        values = self.processor.process(weights=values, name=e.name, tensor_key_mapping={}, parsed_parameters={})
        return torch.from_numpy(np.ascontiguousarray(values.weights, dtype=np.float32))


def tensor_names(path: str, config) -> dict[str, str]:
    """``{GGUF name: transformers name}`` for the file's architecture: transformers' own GGUF name map, built on an
    empty ``meta`` model (seconds on 2 cores: gguf_cache.py keeps it)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    architecture, _ = tensor_table(path)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return dict(get_gguf_hf_weights_map(skeleton, processor))


def lazy_state_dict(path: str, config, names: dict[str, str]) -> dict[str, LazyGgufTensor]:
    """``{transformers name: LazyGgufTensor}`` for every tensor of the file the model has (``names``: tensor_names)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    architecture, entries = tensor_table(path)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    return {names[e.name]: LazyGgufTensor(path, e, processor) for e in entries if e.name in names}


@contextlib.contextmanager
def _one_tensor_at_a_time():
    """transformers' loader reads tensors on a thread pool and holds every result until it is placed (the whole
    state dict at once) unless HF_DEACTIVATE_ASYNC_LOAD is set: set it for the duration of one load."""
    before = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = before


def load_gguf_model(path: str, config, dtype: torch.dtype, names: dict[str, str]):
    """(model, loading info) from a GGUF file, tensor by tensor, through transformers' ``from_pretrained``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    state = lazy_state_dict(path, config, names)
    with _one_tensor_at_a_time():
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict=state, dtype=dtype, output_loading_info=True)
