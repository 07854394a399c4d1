"""What transformers converts out of a GGUF file, kept for the next load of the same file: the model config, the
tokenizer, and the map from the file's tensor names to the model's.

Converting is most of a GGUF's load: on the embedded SmolLM2-135M, on 2 cores, the config takes 7 s and the tokenizer
6 s (each reads the file's metadata, its 49,152-entry vocabulary included, through gguf-py's reader) and the tensor
name map 12 s (transformers builds it by walking an empty model), against 0.3 s to read the three back. The weights
are never kept: they are read from the GGUF itself (gguf_weights.py).

An entry is a directory ``gguf/KEY`` under $PRUNE_HEADS_CACHE_DIR, else $XDG_CACHE_HOME/prune-heads, else
~/.cache/prune-heads. KEY digests the file's sha256 and path and the transformers and gguf versions: another file,
a moved one or another version converts again. It holds JSON and the tokenizer's own files only (nothing that runs
code), written whole into a temporary directory and renamed into place once the three are converted; an entry
that cannot be read is converted again, and a cache directory that cannot be written is left alone (the load goes on).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from prune_heads.console import LOG

CACHE_ENV = "PRUNE_HEADS_CACHE_DIR"
FORMAT = 1  # what an entry holds; a change converts every file again
CONFIG, NAMES, TOKENIZER = "config.json", "tensor_names.json", "tokenizer"


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def cache_root() -> Path:
    """Where prune-heads keeps what it can compute again: $PRUNE_HEADS_CACHE_DIR, else $XDG_CACHE_HOME/prune-heads,
    else ~/.cache/prune-heads."""
    named = os.environ.get(CACHE_ENV)
    if named:
        return Path(named).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "prune-heads"


class GgufConversion:
    """The cache entry of one GGUF file: what it holds (each ``None`` where it holds nothing readable) and ``keep``."""

    def __init__(self, gguf_path: str | os.PathLike, sha256: str):
        path = Path(gguf_path).resolve()
        key = hashlib.sha256(json.dumps([FORMAT, sha256, str(path), _version("transformers"),
                                         _version("gguf")]).encode()).hexdigest()[:32]
        self.directory = cache_root() / "gguf" / key

    def _read(self, what: str, read):
        if not (self.directory / NAMES).is_file():  # written last: the entry is complete
            return None
        try:
            return read(self.directory)
        except Exception as e:  # noqa: BLE001  (a damaged entry is converted again, whatever its damage)
            LOG.debug(f"the cached {what} in {self.directory} cannot be read ({type(e).__name__}: {e}); converting")
            shutil.rmtree(self.directory, ignore_errors=True)  # so that this load's conversion replaces it
            return None

    def config(self):
        from transformers import CONFIG_MAPPING

        def read(d: Path):
            values = json.loads((d / CONFIG).read_text())
            return CONFIG_MAPPING[values["model_type"]].from_dict(values)
        return self._read("config", read)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return self._read("tokenizer", lambda d: AutoTokenizer.from_pretrained(str(d / TOKENIZER)))

    def tensor_names(self) -> dict[str, str] | None:
        return self._read("tensor names", lambda d: dict(json.loads((d / NAMES).read_text())))

    def keep(self, config, tokenizer, names: dict[str, str]) -> None:
        """Write the entry (a directory renamed into place whole); nothing when one is there already or the cache
        cannot be written."""
        if (self.directory / NAMES).is_file():
            return
        try:
            self.directory.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{self.directory.name}.", dir=self.directory.parent))
        except OSError as e:
            LOG.debug(f"the GGUF's conversion is not kept: {e}")
            return
        try:
            (staging / CONFIG).write_text(config.to_json_string(use_diff=False))
            tokenizer.save_pretrained(str(staging / TOKENIZER))
            (staging / NAMES).write_text(json.dumps(names))
            os.rename(staging, self.directory)  # fails where another process put the entry first: theirs stays
        except OSError as e:
            LOG.debug(f"the GGUF's conversion is not kept: {e}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
