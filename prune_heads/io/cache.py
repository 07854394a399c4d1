"""Content-addressed cache of finished work (head scores, per-question evaluation results).

Each entry is a safetensors file (no pickle) named by the sha256 of its key, which lists everything the result
depends on: model fingerprint and dtype, the exact token ids evaluated, the ablation, batch size, versions. A
changed setting changes only the keys it enters, so only the affected work is redone. Entries carry a checksum
of their tensors; a corrupted or truncated entry is detected, reported and recomputed. Writes are atomic.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from prune_heads.io.files import atomic_path


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def tokens_digest(sequences) -> str:
    h = hashlib.sha256()
    for seq in sequences:
        h.update(len(seq).to_bytes(4, "little"))
        h.update(torch.tensor(list(seq), dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class ResultCache:
    def __init__(self, directory: str | os.PathLike | None):
        self.directory = Path(directory) if directory else None
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.stats = {"computed": 0, "loaded": 0, "corrupt": 0}

    def _path(self, kind: str, key: dict) -> Path:
        return self.directory / f"{kind}-{digest(key)[:32]}.safetensors"

    def get(self, kind: str, key: dict) -> dict[str, torch.Tensor] | None:
        if not self.directory:
            return None
        path = self._path(kind, key)
        if not path.is_file():
            return None
        try:
            from safetensors import safe_open

            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
            if meta.get("key") != digest(key) or meta.get("checksum") != _checksum(tensors):
                raise ValueError("checksum mismatch")
        except Exception as e:  # truncated or garbled files fail in safetensors' parser in several ways
            self.stats["corrupt"] += 1
            print(f"cache entry {path.name} is corrupt ({type(e).__name__}); recomputing it", flush=True)
            path.unlink(missing_ok=True)
            return None
        self.stats["loaded"] += 1
        return tensors

    def put(self, kind: str, key: dict, tensors: dict[str, torch.Tensor]) -> None:
        self.stats["computed"] += 1
        if not self.directory:
            return
        tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
        meta = {"key": digest(key), "checksum": _checksum(tensors), "kind": kind, "created": str(time.time())}
        with atomic_path(self._path(kind, key)) as tmp:
            save_file(tensors, tmp, metadata=meta)
        pause = os.environ.get("PRUNE_HEADS_TEST_PAUSE_AFTER_CACHE_WRITE")  # lets the kill -9 tests land mid-run
        if pause:
            time.sleep(float(pause))
