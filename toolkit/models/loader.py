"""Load a Hugging Face MoE checkpoint from a local directory, through transformers, never a hub.

A model directory holds config.json, safetensors weights (one file or an index of shards) and a
tokenizer; VL families also hold preprocessor_config.json. Pickle checkpoints (.bin/.pt/.pth) are
refused: loading them runs arbitrary code. The models this project trained ship inside the package as
such directories and are named by a short name wherever a model directory is accepted: `embedded`
(the default, `embedded_model_dir()`) and `phone` (the phone-class model, `phone_model_dir()`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

# Nothing in the toolkit may reach a model hub at run time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from toolkit.artifacts import config_hash, read_json  # noqa: E402
from toolkit.models.shipped import EMBEDDED_DIR, PHONE_DIR  # noqa: E402
from toolkit.errors import SpecPrefetchError  # noqa: E402
from toolkit.models.checkpoint import TensorIndex, expert_keys, open_safetensors, read_header  # noqa: E402
from toolkit.models.families import Family, ModelGeometry, family_for  # noqa: E402
from toolkit.models.spec import ModelSpec  # noqa: E402  (re-exported: callers import it from here)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


# short name -> shipped model directory (docs/embedded-model.md)
SHIPPED_MODELS: dict[str, Path] = {"embedded": EMBEDDED_DIR, "phone": PHONE_DIR}
# short name of the shipped model assembled on first use into the cache (toolkit/embedded/vl.py)
ASSEMBLED_VL = "embedded-vl"


def embedded_model_dir() -> Path:
    """The embedded default model shipped with the toolkit (see docs/embedded-model.md)."""
    return SHIPPED_MODELS["embedded"]


def phone_model_dir() -> Path:
    """The phone-class model shipped with the toolkit: 16 MoE layers x 64 experts, top-8."""
    return SHIPPED_MODELS["phone"]


def shipped_model_name(path: str | Path | None) -> str | None:
    """The short name of a shipped model directory (`embedded`, `phone`, `embedded-vl`'s assembled
    checkpoint), or None for any other."""
    if path is None:
        return None
    try:
        p = Path(path).resolve()
    except (OSError, RuntimeError):
        return None
    from toolkit.models.embedded_vl import is_assembled

    if is_assembled(p):
        return ASSEMBLED_VL
    return next((name for name, d in SHIPPED_MODELS.items() if d.resolve() == p), None)


def resolve_model_dir(model: str | Path) -> Path:
    """The strings `embedded` (or an empty value), `phone` and `embedded-vl` name the shipped models
    (`embedded-vl` is assembled into the cache on first use); any other string, and every Path, is a
    directory (so a spec's own path never turns into a short name).

    A directory of such a name in the working directory is named with a path: `./phone`."""
    if isinstance(model, Path):
        return model
    if model in ("", "default"):
        return embedded_model_dir()
    if model in SHIPPED_MODELS:
        return SHIPPED_MODELS[model]
    if model == ASSEMBLED_VL:
        from toolkit.models.embedded_vl import model_dir

        return model_dir(progress=True)
    return Path(model)


def _weight_files(path: Path, allow_none: bool = False) -> tuple[Path, ...]:
    index = path / "model.safetensors.index.json"
    if index.exists() or index.is_symlink():
        if not index.is_file():  # a FIFO would hang the read
            raise SpecPrefetchError(f"{index}: not a regular file")
        data = read_json(index, "safetensors index")
        try:
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to shard file names")
            shards = sorted(set(weight_map.values()))
        except (KeyError, TypeError) as e:
            raise SpecPrefetchError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
        bad = [s for s in shards if not s or Path(s).is_absolute() or ".." in Path(s).parts]
        if bad:
            raise SpecPrefetchError(f"{index}: shard {bad[0]!r} is not a file inside {path}")
        files = tuple(path / s for s in shards)
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SpecPrefetchError(f"{index} lists shards that are missing: {', '.join(missing)}")
        heads = {s: read_header(path / s) for s in shards}  # every shard whole: a truncated one is named
        for name, shard in weight_map.items():
            if name not in heads[shard]:
                raise SpecPrefetchError(f"{index}: tensor {name!r} is not in its shard {path / shard}")
        return files
    files = tuple(sorted(path.glob("*.safetensors")))
    if files:
        for f in files:
            read_header(f)  # every shard whole: a truncated file is named here
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise SpecPrefetchError(f"{path}: only pickle checkpoints found ({', '.join(pickles)}); they are "
                                "refused because loading them can run arbitrary code. Convert the "
                                "model to safetensors first.")
    if allow_none:
        return ()
    raise SpecPrefetchError(f"{path}: no *.safetensors weights found")


# The sizes a family's geometry reads from the (text) config. transformers fills an absent key with
# its class default, which describes another model: each of these that the geometry reads must be
# written in config.json itself (under its own name or an alias of the config class).
SIZE_KEYS = frozenset({"num_hidden_layers", "hidden_size", "vocab_size", "num_experts_per_tok", "num_experts",
                       "num_local_experts", "n_routed_experts", "moe_intermediate_size", "intermediate_size"})
# far above any MoE model's (DeepSeek-V3: 61 layers, 256 experts, hidden 7168, vocabulary 129280)
SIZE_LIMITS = {"num_hidden_layers": 1 << 12, "hidden_size": 1 << 20, "vocab_size": 1 << 26,
               "num_experts_per_tok": 1 << 16, "num_experts": 1 << 16, "num_local_experts": 1 << 16,
               "n_routed_experts": 1 << 16, "moe_intermediate_size": 1 << 24, "intermediate_size": 1 << 24}


class _Reads:
    """A config whose attribute reads are recorded (to learn which keys a family's geometry needs)."""

    def __init__(self, tc: Any):
        object.__setattr__(self, "_tc", tc)
        object.__setattr__(self, "seen", [])

    def __getattr__(self, name: str) -> Any:
        self.seen.append(name)
        return getattr(self._tc, name)


def _require_sizes(family: Family, config: Any, cfg_dict: dict, cfg_path: Path) -> None:
    """config.json must state every size the geometry reads (a missing one is an error naming it)."""
    tc = family.text_config(config)
    raw, where = cfg_dict, ""
    if tc is not config:
        raw = cfg_dict.get("text_config")
        where = "text_config."
        if not isinstance(raw, dict):
            raise SpecPrefetchError(f"{cfg_path}: missing required key 'text_config' (the language model's config)")
    rec = _Reads(tc)
    for read in (family.moe_intermediate_size, family.routing):
        try:
            read(rec)
        except Exception:  # noqa: BLE001 - the keys it read are recorded; geometry() reports the rest
            pass
    needed = [k for k in dict.fromkeys(["num_hidden_layers", "hidden_size", "vocab_size", *rec.seen])
              if k in SIZE_KEYS]
    amap = dict(getattr(type(tc), "attribute_map", {}) or {})
    for k in needed:
        names = {k, amap.get(k)} | {a for a, b in amap.items() if b == k}
        if not any(n in raw for n in names if n):
            raise SpecPrefetchError(f"{cfg_path}: missing required key '{where}{amap.get(k, k)}' (transformers' "
                                    "default would describe another model)")
    # sizes are whole numbers of a plausible magnitude: the geometry loops over them (a config claiming
    # 2**40 layers would hang every command that opens the model)
    for name, v in raw.items():
        key = name if name in SIZE_KEYS else amap.get(name)
        if key not in SIZE_KEYS or v is None:
            continue
        limit = SIZE_LIMITS[key]
        if type(v) is not int or v > limit:
            raise SpecPrefetchError(f"{cfg_path}: {where}{name} is {json.dumps(v)[:40]}; it must be a whole number "
                                    f"(at most {limit})")


def inspect_model_dir(model: str | Path, *, config_only_ok: bool = False) -> ModelSpec:
    """Validate a model directory and read its config; loads no weights.

    With `config_only_ok`, a directory holding only config.json is accepted (weight_files empty):
    enough to study the geometry of a checkpoint you do not have on disk. Every safetensors shard's
    header is checked, and that the file is as long as the header says.
    """
    path = resolve_model_dir(model)
    if not path.exists():
        raise SpecPrefetchError(f"model directory not found: {path}")
    if not path.is_dir():
        raise SpecPrefetchError(f"model path is not a directory: {path}")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise SpecPrefetchError(f"{path}: no config.json (is this a Hugging Face model directory?)")
    if not cfg_path.is_file():  # a directory, or a FIFO that would hang the read
        raise SpecPrefetchError(f"{cfg_path}: not a regular file")
    cfg_dict = read_json(cfg_path, "model config")
    if not isinstance(cfg_dict, dict):
        raise SpecPrefetchError(f"{cfg_path}: expected a JSON object")
    model_type = cfg_dict.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise SpecPrefetchError(f"{cfg_path}: model_type must be a string, not {json.dumps(model_type)[:60]}")
    family = family_for(model_type, where=str(cfg_path))
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise SpecPrefetchError(f"{cfg_path}: transformers cannot read this config: {' '.join(str(e).split())}") \
            from None
    try:
        _require_sizes(family, config, cfg_dict, cfg_path)
        geometry = family.geometry(config)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, ArithmeticError) as e:
        raise SpecPrefetchError(f"{cfg_path}: incomplete {family.name} config: {e}") from None
    r = geometry.routing
    for what, v in (("num_hidden_layers", geometry.num_layers), ("hidden_size", geometry.hidden_size),
                    ("vocab_size", geometry.vocab_size), ("the number of experts", r.num_experts),
                    ("the experts' intermediate size", geometry.moe_intermediate_size)):
        if v < 1:
            raise SpecPrefetchError(f"{cfg_path}: {what} is {v}; it must be at least 1")
    if r.top_k > r.num_experts or r.top_k < 1:
        raise SpecPrefetchError(f"{cfg_path}: top-k {r.top_k} does not fit {r.num_experts} experts")
    vc = getattr(config, "vision_config", None)  # the tower's features replace text embeddings: one width
    out = getattr(vc, "out_hidden_size", None) if family.is_vision_language else None
    if isinstance(out, int) and out != geometry.hidden_size:
        given = isinstance(cfg_dict.get("vision_config"), dict) and "out_hidden_size" in cfg_dict["vision_config"]
        raise SpecPrefetchError(f"{cfg_path}: vision_config.out_hidden_size is {out}"
                                + ("" if given else " (transformers' default: config.json omits it)")
                                + f", the language model's hidden_size {geometry.hidden_size}: the image features "
                                "could not replace its token embeddings")
    weights = _weight_files(path, allow_none=config_only_ok)
    return ModelSpec(path=path, config=config, config_dict=cfg_dict, config_hash=config_hash(cfg_dict),
                     family=family, geometry=geometry, weight_files=weights)


@dataclasses.dataclass
class LoadedModel:
    spec: ModelSpec
    model: torch.nn.Module
    tokenizer: Any
    image_processor: Any = None
    placement: dict[str, str] | None = None  # --max-memory: accelerate's device map (module -> device)
    scratch: Any = None                      # its disk offload folder (a TemporaryDirectory), if any

    def close(self) -> None:
        """Remove the disk offload folder (the weights accelerate offloaded for this load)."""
        if self.scratch is not None:
            self.scratch.cleanup()
            self.scratch = None

    @property
    def family(self) -> Family:
        return self.spec.family

    @property
    def geometry(self) -> ModelGeometry:
        return self.spec.geometry

    @property
    def input_device(self) -> torch.device:
        emb = self.model.get_input_embeddings()
        if emb.weight.device.type != "meta":
            return emb.weight.device
        # offloaded by accelerate: computed on its hook's execution device (a SequentialHook holds several)
        hook = getattr(emb, "_hf_hook", None)
        for h in [hook, *getattr(hook, "hooks", ())]:
            dev = getattr(h, "execution_device", None)
            if dev is not None:
                return torch.device("cuda", dev) if isinstance(dev, int) else torch.device(dev)
        return torch.device("cpu")


def parse_max_memory(text: str, option: str = "--max-memory") -> dict[int | str, int]:
    """'0=40GiB,1=40GiB,cpu=200GiB' -> {0: bytes, 1: bytes, "cpu": bytes}: accelerate's max_memory.
    Sizes as accelerate reads them (KB/MB/GB, KiB/MiB/GiB) or a number of bytes; a GPU index must
    exist here. Without cpu= no module is placed in host memory (past the GPUs, all goes to disk)."""
    from accelerate.utils import convert_file_size_to_int

    out: dict[int | str, int] = {}
    for part in text.split(","):
        key, sep, val = (x.strip() for x in part.partition("="))
        if not sep or not key or not val:
            raise SpecPrefetchError(f"{option} {text!r}: expected DEVICE=SIZE pairs, e.g. 0=40GiB,cpu=200GiB")
        if key.isdigit():
            dev: int | str = int(key)
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if dev >= n:
                raise SpecPrefetchError(f"{option} {text!r}: GPU {dev} does not exist here "
                                        f"({n} CUDA device(s){', numbered from 0' if n else ''})")
        elif key == "cpu":
            dev = key
        elif key == "disk":   # accelerate never limits what it offloads to disk
            raise SpecPrefetchError(f"{option} {text!r}: disk takes no budget (what fits on no GPU and not in "
                                    "host memory goes to disk)")
        else:
            raise SpecPrefetchError(f"{option} {text!r}: {key!r} is not a GPU index or cpu")
        if dev in out:
            raise SpecPrefetchError(f"{option} {text!r}: {key} is given twice")
        try:
            size = int(val) if val.isdigit() else convert_file_size_to_int(val)
        except (ValueError, TypeError, ArithmeticError):   # "infGB": an overflow
            size = -1
        if not isinstance(size, int) or size < 1:
            raise SpecPrefetchError(f"{option} {text!r}: size {val!r} is not a size such as 512MiB or 40GiB")
        out[dev] = size
    return out


def _placement(spec: ModelSpec, cls, dtype: torch.dtype, max_memory: dict[int | str, int]) -> dict[str, Any]:
    """accelerate's device map for these budgets (GPUs in index order, then host memory, then disk),
    computed on an empty model. transformers' own device_map="auto" reserves room on the host for
    offloading and, with host memory alone, puts every module on disk; this is the plain fill. Tied
    weights (an LM head sharing the input embeddings) are tied on the empty model first, so accelerate
    keeps them on one device."""
    import copy

    from accelerate import infer_auto_device_map, init_empty_weights

    with init_empty_weights():
        empty = cls.from_config(copy.deepcopy(spec.config), dtype=dtype)   # from_config writes into its config
    empty.tie_weights()
    budget = dict(sorted(((k, v) for k, v in max_memory.items() if isinstance(k, int)))) | \
        {k: max_memory[k] for k in ("cpu",) if k in max_memory} | {"disk": 1 << 62}
    get = getattr(empty, "_get_no_split_modules", None)
    no_split = get("auto") if get is not None else getattr(empty, "_no_split_modules", None)
    return dict(infer_auto_device_map(empty, max_memory=budget, dtype=dtype,
                                      no_split_module_classes=list(no_split or [])))


OFFLOAD_PREFIX = ".specprefetch-offload-"   # + the pid of the process that made it + a random part


def _offload_folder(where: Path | None):
    """A scratch folder for accelerate's disk offload in `where` (its nearest existing ancestor; the
    system's temp directory if None), named after this process; folders of this name left by processes
    no longer alive there (a run killed before its cleanup) are removed first."""
    import shutil
    import tempfile

    where = Path(where) if where is not None else Path(tempfile.gettempdir())
    while not where.is_dir() and where != where.parent:
        where = where.parent
    for old in where.glob(OFFLOAD_PREFIX + "*"):
        pid = old.name[len(OFFLOAD_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)) and old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.TemporaryDirectory(prefix=f"{OFFLOAD_PREFIX}{os.getpid()}-", dir=where)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process
        return True
    return True


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise SpecPrefetchError(f"--dtype {name!r}: expected one of {', '.join(table)}")
    return table[name]


def load_model(model: str | Path, *, device: str = "cpu", dtype: str = "float32",
               max_memory: dict[int | str, int] | None = None, offload_dir: Path | None = None) -> LoadedModel:
    """Load weights, tokenizer and (VL) image processor.

    Args:
        device: "cpu", "cuda", "cuda:N", or "auto" to spread layers over every visible GPU with
            accelerate's device_map (how a 30B checkpoint is traced on a multi-GPU workstation).
        dtype: float32, float16 or bfloat16.
        max_memory: with device "auto", accelerate's per-device budgets (`parse_max_memory`): the
            layers fill the GPUs in order, then host memory, then a disk offload folder; modules on
            the host or disk are computed on the first GPU (accelerate's offload hooks), or on the
            CPU where there is none. The map is `placement`; call `close()` to remove the folder.
        offload_dir: where that folder is made (default: the system's temp directory).
    """
    spec = inspect_model_dir(model)
    torch_dtype = parse_dtype(dtype)
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    cls = AutoModelForImageTextToText if spec.family.is_vision_language else AutoModelForCausalLM
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "local_files_only": True, "use_safetensors": True}
    placement = scratch = None
    if max_memory is not None:
        if device != "auto":
            raise SpecPrefetchError(f"--max-memory needs --device auto (not --device {device})")
        placement = _placement(spec, cls, torch_dtype, max_memory)
        kwargs["device_map"] = placement
        if "disk" in placement.values():
            scratch = _offload_folder(offload_dir)
            kwargs["offload_folder"] = scratch.name
    elif device == "auto":
        if not torch.cuda.is_available():
            raise SpecPrefetchError("--device auto needs CUDA GPUs; none are visible (use --device cpu)")
        kwargs["device_map"] = "auto"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecPrefetchError(f"--device {device}: CUDA is not available on this machine")
    try:
        net = cls.from_pretrained(spec.path, **kwargs)
    except SpecPrefetchError:
        raise
    except Exception as e:
        if scratch is not None:
            scratch.cleanup()
        raise SpecPrefetchError(f"{spec.path}: loading the weights failed: {e}") from None
    if device != "auto":
        net = net.to(device)
    net.eval()
    try:
        tok = AutoTokenizer.from_pretrained(spec.path, local_files_only=True)
    except Exception as e:
        raise SpecPrefetchError(f"{spec.path}: no usable tokenizer ({e})") from None
    image_processor = None
    if spec.family.is_vision_language:
        image_processor = load_image_processor(spec.path)
    return LoadedModel(spec=spec, model=net, tokenizer=tok, image_processor=image_processor,
                       placement={k: str(v) for k, v in placement.items()} if placement is not None else None,
                       scratch=scratch)


def load_image_processor(path: Path) -> Any:
    """The Qwen-VL image processor, PIL backend.

    The full AutoProcessor of Qwen3-VL insists on a torchvision video processor, and PyPI's
    torchvision cannot be installed beside the CPU torch this toolkit pins; images need only the
    image processor, so we build the prompt's image placeholders ourselves (toolkit/traces/data.py).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if not (path / "preprocessor_config.json").exists():
        raise SpecPrefetchError(f"{path}: a vision-language model needs preprocessor_config.json")
    try:
        return Qwen2VLImageProcessorPil.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise SpecPrefetchError(f"{path}/preprocessor_config.json: unusable ({e})") from None


def build_on_meta(spec: ModelSpec) -> torch.nn.Module:
    """The model config.json describes, built on the meta device (no memory for weights). A config
    transformers cannot build (a value of the wrong type or range that the geometry does not read)
    is a one-line error naming config.json, whatever transformers raised."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cls = AutoModelForImageTextToText if spec.family.is_vision_language else AutoModelForCausalLM
    try:
        with torch.device("meta"):
            return cls.from_config(spec.config)
    except Exception as e:  # noqa: BLE001 - transformers raises many types for a config it cannot build
        raise SpecPrefetchError(f"{spec.path / 'config.json'}: transformers cannot build the model this config "
                                f"describes ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def load_dense_model(spec: ModelSpec) -> torch.nn.Module:
    """The model without its routed experts' weights: built on the meta device, then every
    checkpoint tensor except the experts' is loaded (read one at a time from the safetensors
    files), so a checkpoint larger than memory can run with its experts streamed. Experts stay on
    the meta device until the caller replaces those modules. Buffers computed at construction
    (rotary frequencies) are rebuilt on the CPU; a module that cannot be rebuilt is an error."""
    cfg = spec.path / "config.json"
    net = build_on_meta(spec)
    skip = set().union(*(expert_keys(spec, layer) for layer in spec.geometry.moe_layers))
    index = TensorIndex(spec)
    state: dict[str, torch.Tensor] = {}
    handles: dict = {}
    for key, (path, _, _) in index.entries.items():
        if key in skip:
            continue
        if path not in handles:
            handles[path] = open_safetensors(path)
        name = key
        for a, b in spec.family.key_renames:
            name = name.replace(a, b)
        try:
            state[name] = handles[path].get_tensor(key).float()
        except Exception as e:  # noqa: BLE001 - the library's errors on a damaged file
            raise SpecPrefetchError(f"{path}: cannot read tensor {key!r} ({' '.join(str(e).split())[:200]})") \
                from None
    try:
        missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:  # shapes that differ from the config's
        raise SpecPrefetchError(f"{spec.path}: the checkpoint's tensors do not fit the model {cfg} describes "
                                f"({' '.join(str(e).split())[:300]})") from None
    if unexpected:
        raise SpecPrefetchError(f"{spec.path}: checkpoint tensors the model does not know: {unexpected[:5]}")
    net.tie_weights()
    for name, mod in net.named_modules():
        metas = [b for b, t in mod.named_buffers(recurse=False) if t.is_meta]
        if not metas:
            continue
        try:
            fresh = type(mod)(config=mod.config)
        except Exception as e:  # noqa: BLE001 - any constructor failure means "cannot rebuild"
            raise SpecPrefetchError(f"{spec.path}: cannot rebuild buffers {metas} of {name} ({e})") from None
        for b in metas:
            setattr(mod, b, getattr(fresh, b))
    left = [n for n, p in net.named_parameters() if p.is_meta and ".experts." not in n]
    if left:
        raise SpecPrefetchError(f"{spec.path}: tensors missing from the checkpoint: {left[:5]}")
    net.eval()
    return net


def eos_token_ids(spec: ModelSpec, tokenizer) -> tuple[int, ...]:
    """Every id generation stops at: the generation config's (an int or a list, as transformers'
    `generate` reads it), else the tokenizer's."""
    ids, where = None, None
    gc = spec.path / "generation_config.json"
    if gc.is_file():
        gen = read_json(gc, "generation config")
        if not isinstance(gen, dict):
            raise SpecPrefetchError(f"{gc}: not a JSON object")
        ids = gen.get("eos_token_id")
        where = f"{gc}: eos_token_id"
    if ids is None:
        ids, where = tokenizer.eos_token_id, f"{spec.path}: the tokenizer's eos_token_id"
    ids = ids if isinstance(ids, list) else [ids]
    if not all(i is None or (type(i) is int and i >= 0) for i in ids):
        raise SpecPrefetchError(f"{where} must be a token id or a list of them, not {json.dumps(ids)[:60]}")
    return tuple(i for i in ids if i is not None)
