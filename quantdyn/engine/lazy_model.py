"""A model whose weights come and go one module at a time.

The block walker (``engine/walk.py``) needs, at any moment, only the modules it is
running: the embedding while it captures block 0's inputs, then one decoder block, then
the final norm and the head. :class:`BlockSource` is what it asks:

* :class:`LazyModel` — a checkpoint on disk. The model is built as a *skeleton*: every
  parameter on the ``meta`` device (no memory), every buffer real (rotary tables are
  computed from the config as usual). ``load(module, device)`` reads exactly that
  module's tensors from the checkpoint (``models/weights.py``) in the checkpoint's dtype
  (or the one asked for) onto ``device``; ``unload(module)`` puts them back on ``meta``.
  Memory is bounded by a block, not by the model.
* :class:`InMemoryModel` — a model that is already loaded (the in-training monitor,
  ``quantize_model``): ``load`` moves a module to the compute device if that differs from
  where the model lives, ``unload`` moves it back.

GPT-NeoX checkpoints become quantdyn's own GPT (its parameter names are the checkpoint's);
every other family is built by ``transformers`` from its config.
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn

from quantdyn.engine.phases import PhaseTimer, time_phase
from quantdyn.errors import QuantdynError, unknown_name
from quantdyn.models.adapters import FamilyAdapter, adapter_for
from quantdyn.models.gpt import GPT
from quantdyn.models.hf_io import model_config_from_hf
from quantdyn.models.weights import CheckpointWeights
from quantdyn.sources.hub import open_checkpoint

_COMPUTE_DTYPES = {"auto": None, "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def compute_dtype_of(name: str) -> torch.dtype | None:
    """'auto' -> None (chosen by :func:`auto_compute_dtype`), else the torch dtype; unknown names are an error."""
    if name not in _COMPUTE_DTYPES:
        raise unknown_name("dtype", name, [k for k in _COMPUTE_DTYPES if len(k) > 4])
    return _COMPUTE_DTYPES[name]


_NATIVE_CPU_CHECKS = {torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
                      torch.float16: ("_is_amx_fp16_supported",)}


def cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU has instructions that multiply ``dtype`` matrices natively (bf16: AVX512-BF16 or AMX;
    fp16: AMX-FP16), as torch's CPU probe reports them; float32 always."""
    if dtype == torch.float32:
        return True
    return any(getattr(torch.cpu, f, lambda: False)() for f in _NATIVE_CPU_CHECKS.get(dtype, ()))


def auto_compute_dtype(stored: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """What ``dtype: auto`` computes in: the checkpoint's own dtype, except a 16-bit float on a CPU without
    native units for it, which computes in float32. Measured on one Llama-2-7B block (BENCHMARKS.md, issue 30):
    without AVX512-BF16 a bf16 forward is slower than a float32 one (oneDNN converts every tile), with it
    bf16 is faster; fp16 matmuls on a CPU without AMX-FP16 are slower than float32. ``device`` None: the
    checkpoint's dtype (no rule)."""
    if device is not None and torch.device(device).type == "cpu" and stored.is_floating_point \
            and stored.itemsize == 2 and not cpu_has_native(stored):
        return torch.float32
    return stored


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Inside: every ``nn.Parameter`` registered on a module is put on the ``meta`` device (buffers stay
    real). Building a 7B skeleton this way takes about a second and no memory."""
    register = nn.Module.register_parameter

    def on_meta(self, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_skeleton(weights: CheckpointWeights) -> nn.Module:
    """The checkpoint's model with parameters on ``meta`` and real buffers, in eval mode."""
    d = weights.config
    if d.get("model_type") == "gpt_neox":
        try:
            cfg = model_config_from_hf(d)
        except (KeyError, TypeError, ValueError) as e:
            raise QuantdynError(f"'{weights.path}/config.json' is not a usable GPT-NeoX config ({e}); "
                                "re-export the checkpoint") from None
        with params_on_meta():
            model = GPT(cfg)
        return model.eval()
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(weights.path))
    except (OSError, ValueError, KeyError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise QuantdynError(f"'{weights.path}/config.json' cannot be read by transformers ({first[:160]}); "
                            "check the model type or upgrade transformers") from None
    with params_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        except ValueError:  # a family without SDPA support
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


class BlockSource:
    """Interface of the modules a block walk loads and unloads (see module docstring)."""

    model: nn.Module
    adapter: FamilyAdapter
    dtype: torch.dtype

    def load(self, module: nn.Module, device: torch.device, timer: PhaseTimer | None = None) -> None:
        """Put ``module``'s parameters on ``device`` in the compute dtype (``timer``: adds read / convert time)."""
        raise NotImplementedError

    def unload(self, module: nn.Module) -> None:
        raise NotImplementedError

    @property
    def blocks(self) -> nn.ModuleList:
        return self.adapter.get_blocks(self.model)

    def pre_block(self) -> list[nn.Module]:
        return self.adapter.get_pre_block(self.model)

    def tail(self) -> tuple[nn.Module, nn.Module]:
        return self.adapter.get_final_norm(self.model), self.adapter.get_head(self.model)

    def block_bytes(self) -> int:
        """Bytes of the largest block's parameters in the compute dtype."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return max(sum(p.numel() for p in b.parameters()) for b in self.blocks) * size

    def edge_bytes(self) -> int:
        """Bytes of the embedding + final norm + head parameters in the compute dtype."""
        size = torch.empty((), dtype=self.dtype).element_size()
        mods = self.pre_block() + list(self.tail())
        seen: set[int] = set()
        n = 0
        for m in mods:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    n += p.numel()
        return n * size

    def largest_tensor(self) -> tuple[str, int]:
        """(name, bytes) of the parameter that needs the most memory to load: in the compute dtype, plus the
        buffer it is read into when that is another dtype."""
        size = torch.empty((), dtype=self.dtype).element_size()
        name, p = max(self.model.named_parameters(), key=lambda kv: kv[1].numel())
        return name, p.numel() * size

    def n_params(self, non_embedding: bool = True) -> int:
        """Parameter count (minus the input embedding: the N of scaling laws)."""
        total = sum(p.numel() for p in self.model.parameters())
        if non_embedding:
            emb = self.pre_block()[0]
            total -= sum(p.numel() for p in emb.parameters())
        return total


class LazyModel(BlockSource):
    """A checkpoint read one module at a time (see module docstring)."""

    def __init__(self, weights: CheckpointWeights, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        """``dtype`` None: :func:`auto_compute_dtype` of the checkpoint's dtype on ``device``."""
        self.weights = weights
        self.model = build_skeleton(weights)
        self.adapter = adapter_for(self.model)
        self.dtype = dtype or auto_compute_dtype(weights.weight_dtype(), device)
        self._names = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        self._keys = self._match_keys()

    # the checkpoint key of each parameter, checked before anything is computed
    def _match_keys(self) -> dict[str, str]:
        w = self.weights
        base = getattr(self.model, "base_model_prefix", "") or ""
        tied = bool(w.config.get("tie_word_embeddings", False))
        emb_params = [f"{self.adapter.pre_block[0]}.{n}" for n, _ in self.pre_block()[0].named_parameters()]
        head = self.adapter.head
        keys: dict[str, str] = {}
        for mod_name, mod in self.model.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is None:
                    continue
                full = f"{mod_name}.{pname}" if mod_name else pname
                cands = [full]
                if base and full.startswith(base + "."):
                    cands.append(full[len(base) + 1:])
                elif base:
                    cands.append(f"{base}.{full}")
                if full.startswith(("embed_out.", "lm_head.")):
                    rest = full.split(".", 1)[1]
                    cands += [f"embed_out.{rest}", f"lm_head.{rest}"]
                if full.startswith(head + ".") and (tied or not any(c in w for c in cands)):
                    cands += emb_params
                key = next((c for c in cands if c in w), None)
                if key is None:
                    raise QuantdynError(f"checkpoint '{w.path}' has no tensor for parameter '{full}' that its "
                                        f"config.json implies; the config does not match the weights")
                e = w.entry(key)
                if tuple(e.shape) != tuple(p.shape):
                    raise QuantdynError(f"checkpoint '{w.path}': tensor '{key}' in {e.file.name} has shape "
                                        f"{list(e.shape)} but config.json implies {list(p.shape)}; the config does "
                                        "not match the weights")
                keys[full] = key
        return keys

    def largest_tensor(self) -> tuple[str, int]:
        best = ("", 0)
        for key in self._keys.values():
            e = self.weights.entry(key)
            converted = e.dtype.is_floating_point and e.dtype != self.dtype  # read, then a compute-dtype copy
            need = e.nbytes + (math.prod(e.shape) * self.dtype.itemsize if converted else 0)
            if need > best[1]:
                best = (key, need)
        return best

    def checkpoint_key(self, param: str) -> str:
        """The checkpoint's tensor name of a model parameter (e.g. a tied head's is the embedding's)."""
        return self._keys[param]

    def load(self, module: nn.Module, device: torch.device, timer: PhaseTimer | None = None) -> None:
        prefix = self._names[id(module)]
        for mod_name, mod in module.named_modules(remove_duplicate=False):
            full_mod = ".".join(x for x in (prefix, mod_name) if x)
            for pname, p in list(mod._parameters.items()):
                if p is None or p.device.type != "meta":
                    continue
                with time_phase(timer, "read"):
                    t = self.weights.get(self._keys[f"{full_mod}.{pname}" if full_mod else pname])
                with time_phase(timer, "convert"):  # one tensor at a time: at most one extra copy exists
                    if t.dtype.is_floating_point:
                        t = t.to(self.dtype)
                    mod._parameters[pname] = nn.Parameter(t.to(device), requires_grad=False)
                    del t
            for bname, b in list(mod._buffers.items()):
                if b is not None and b.device != device:
                    mod._buffers[bname] = b.to(device)

    def unload(self, module: nn.Module) -> None:
        for mod in module.modules():
            for pname, p in list(mod._parameters.items()):
                if p is not None and p.device.type != "meta":
                    mod._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                          requires_grad=False)


class InMemoryModel(BlockSource):
    """A loaded model; ``load`` onloads a module to the compute device when the model lives elsewhere."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapter = adapter_for(model)
        first = next(model.parameters())
        self.home = first.device
        self.dtype = first.dtype if first.dtype.is_floating_point else torch.float32

    def load(self, module: nn.Module, device: torch.device, timer: PhaseTimer | None = None) -> None:
        if device != self.home:
            with time_phase(timer, "convert"):
                module.to(device)

    def unload(self, module: nn.Module) -> None:
        module.to(self.home)


def block_source(model: "str | Path | nn.Module | CheckpointWeights | BlockSource", dtype: torch.dtype | None,
                 device: torch.device) -> BlockSource:
    """The BlockSource of any model reference the engine takes: a BlockSource as it is; a model in memory as an
    InMemoryModel (its blocks compute as they are stored); CheckpointWeights or a checkpoint reference (a local
    directory, hub-id[@revision]) read lazily, its blocks computing in ``dtype`` on ``device`` (None: auto, see
    LazyModel)."""
    if isinstance(model, BlockSource):
        return model
    if isinstance(model, nn.Module):
        return InMemoryModel(model)
    weights = model if isinstance(model, CheckpointWeights) else open_checkpoint(model)
    return LazyModel(weights, dtype, device)
