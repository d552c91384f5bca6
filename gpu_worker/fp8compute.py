"""FP8 compute for the target's linear layers (``hsx produce --compute-dtype float8``).

Every ``nn.Linear`` of the decoder layers becomes an :class:`Fp8Linear`: float8_e4m3fn weights with one
float32 scale per output row, activations quantised per row (per token) on the fly, and one
``torch._scaled_mm`` (rowwise-scaled e4m3 GEMM, bf16 out). Attention and recurrent kernels (SDPA, flash-
linear-attention's Gated DeltaNet), norms and embeddings are untouched and stay bf16.

Checkpoints that are already FP8 (``quantization_config`` with ``quant_method: fp8``, e4m3 weights and a
``weight_scale_inv`` per 128x128 block, as the published Qwen3 FP8 releases) load without going through
bf16: each weight's block scales become one scale per output row (the largest of the row's blocks) and
the e4m3 values are rescaled by ``block / row`` (<= 1; a float format keeps its relative precision under
that, short of the subnormal range: one more e4m3 rounding, ~1.5 % rel L2 of a weight whose row's blocks
differ in scale, none where they agree), one layer at a time. Only the GEMM needs FP8 tensor cores (compute
capability >= 8.9); the conversion and loading also run on the CPU (tests).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from gpu_worker.fp8linear import FP8, FP8_MAX, MIN_SCALE, Fp8Linear
from hsx.runspec import ComputeDtypeError, check_compute_dtype, check_fp8_accumulation  # noqa: F401 (re-exported)

FP8_CAPABILITY = (8, 9)  # Ada / Hopper and later: FP8 tensor cores


def require_fp8_device(device) -> None:
    """Refuse (ComputeDtypeError, one line) unless ``device`` is a GPU with FP8 tensor cores."""
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ComputeDtypeError(f"run has compute dtype float8, which needs a GPU with FP8 tensor cores (compute "
                                f"capability >= 8.9: Ada, Hopper, Blackwell); this worker's device is {dev}. Plan the "
                                "run with --compute-dtype bfloat16, or run its workers on such GPUs")
    cap = torch.cuda.get_device_capability(dev)
    if tuple(cap) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(dev)
        raise ComputeDtypeError(f"run has compute dtype float8, which needs FP8 tensor cores (compute capability "
                                f">= 8.9); {dev} is {name} ({cap[0]}.{cap[1]}). Plan the run with --compute-dtype "
                                "bfloat16, or run its workers on Ada/Hopper/Blackwell GPUs")


def rows_from_blocks(qweight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                     chunk_rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 (``w = q * scale_inv[r // bo, c // bi]``) -> rowwise e4m3 + float32 row scales.

    Works a few rows at a time (float32 of ``chunk_rows`` rows), never the whole weight in a wider dtype.
    """
    out_f, in_f = qweight.shape
    bo, bi = block
    if scale_inv.shape != (-(-out_f // bo), -(-in_f // bi)):
        raise ValueError(f"weight {tuple(qweight.shape)} with block {block} needs scales "
                         f"{(-(-out_f // bo), -(-in_f // bi))}, the checkpoint has {tuple(scale_inv.shape)}")
    scales = scale_inv.float()
    row_scale = scales.amax(dim=1).repeat_interleave(bo)[:out_f].clamp_min(MIN_SCALE)  # [out]
    q = torch.empty_like(qweight, dtype=FP8)
    for start in range(0, out_f, chunk_rows):
        stop = min(out_f, start + chunk_rows)
        per_col = scales.repeat_interleave(bo, 0)[start:stop].repeat_interleave(bi, 1)[:, :in_f]
        ratio = per_col / row_scale[start:stop, None]
        q[start:stop] = (qweight[start:stop].float() * ratio).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, row_scale[:, None].contiguous()


# ---- FP8 checkpoints ----------------------------------------------------------
def fp8_block_config(config) -> tuple[int, int] | None:
    """The weight block of an e4m3 block-scaled checkpoint's config, else None."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("quant_method") != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3" or not q.get("weight_block_size"):
        raise ComputeDtypeError(f"FP8 checkpoint with quantization_config {json.dumps(q)}: hsx loads e4m3 weights "
                                "with a weight_scale_inv per block (weight_block_size) only")
    bo, bi = q["weight_block_size"]
    return int(bo), int(bi)


def _checkpoint_tensors(model_path: Path):
    from safetensors import safe_open

    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ComputeDtypeError(f"model {model_path}: no *.safetensors files (FP8 checkpoints load from safetensors)")
    for file in files:
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield key, fh


def load_fp8_checkpoint(model_path: str, device, attn_implementation: str = "sdpa",
                        fast_accum: bool = False) -> nn.Module:
    """The body (AutoModel) of an e4m3 block-scaled checkpoint with Fp8Linear layers, never a bf16 copy of them.

    The body is built on the meta device; each quantised linear becomes an Fp8Linear from its e4m3 values
    and block scales (converted layer by layer on ``device``; its GEMMs accumulate fast or in fp32 as
    ``fast_accum`` says), every other tensor is read as stored (bf16), and rotary tables are rebuilt on ``device``.
    """
    from transformers import AutoConfig, AutoModel

    path = Path(model_path)
    config = AutoConfig.from_pretrained(str(path))
    block = fp8_block_config(config)
    if block is None:
        raise ComputeDtypeError(f"model {model_path} is not an FP8 (e4m3, block-scaled) checkpoint")
    config.quantization_config = None
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    device = torch.device(device)
    with torch.device("meta"):
        model = AutoModel.from_config(config, dtype=torch.bfloat16, attn_implementation=attn_implementation)
    modules = dict(model.named_modules())
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""

    def local(key: str) -> str | None:
        for k in (key, key.removeprefix(prefix)):
            owner = k.rsplit(".", 1)[0]
            if owner in modules:
                return k
        return None

    scales = {}
    pending: dict[str, torch.Tensor] = {}
    for key, fh in _checkpoint_tensors(path):
        name = local(key)
        if name is None:
            continue  # lm_head, MTP layers, vision tower: not part of the body
        if name.endswith(".weight_scale_inv"):
            scales[name.removesuffix("_scale_inv")] = fh.get_tensor(key)
        else:
            pending[name] = fh.get_tensor(key)
    converted = 0
    for name, tensor in pending.items():
        owner_name, attr = name.rsplit(".", 1)
        owner = modules[owner_name]
        if tensor.dtype == FP8 and attr == "weight":
            if name not in scales:
                raise ComputeDtypeError(f"FP8 weight {name} has no weight_scale_inv in {model_path}")
            q, row_scale = rows_from_blocks(tensor.to(device), scales[name].to(device), block)
            bias = pending.get(f"{owner_name}.bias")
            parent_name, child = owner_name.rsplit(".", 1)
            setattr(modules[parent_name], child, Fp8Linear(q, row_scale, bias.to(device) if bias is not None else None,
                                                           fast_accum=fast_accum))
            converted += 1
            continue
        if attr == "bias" and pending.get(f"{owner_name}.weight") is not None \
                and pending[f"{owner_name}.weight"].dtype == FP8:
            continue
        value = tensor.to(device=device, dtype=torch.bfloat16 if tensor.is_floating_point() else tensor.dtype)
        if attr in owner._parameters:
            owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
        else:
            owner._buffers[attr] = value
    _rebuild_meta(model, config, device)
    model.config.hsx_fp8_linears = converted
    return model.eval()


def _rebuild_meta(model: nn.Module, config, device: torch.device) -> None:
    """Rotary tables (non-persistent buffers) are rebuilt; any other tensor still on meta is an error."""
    for name, module in list(model.named_modules()):
        if "rotary" in type(module).__name__.lower() and any(b.is_meta for b in module.buffers()):
            with torch.device(device):  # built where it computes (signatures differ across transformers versions)
                fresh = type(module)(config=module.config)
            parent_name, child = name.rsplit(".", 1) if "." in name else ("", name)
            setattr(model.get_submodule(parent_name) if parent_name else model, child, fresh)
    missing = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if missing:
        raise ComputeDtypeError(f"FP8 checkpoint lacks {len(missing)} tensor(s) of the body, e.g. {missing[:3]}")


def quantise_blocks(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` -> (e4m3 values, float32 ``scale_inv`` per block) with ``w ~= q * scale_inv[r // bo, c // bi]``."""
    out_f, in_f = w.shape
    bo, bi = block
    rows, cols = -(-out_f // bo), -(-in_f // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.reshape(rows, bo, cols, bi)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(rows * bo, cols * bi)[:out_f, :in_f]
    return q.to(FP8).contiguous(), scale


def fp8_tensors(tensors, block: tuple[int, int] = (128, 128)):
    """(key, tensor) pairs of an e4m3 block-scaled checkpoint from a bf16 one's ``tensors`` (key -> tensor):
    every 2-D ``*.weight`` of the decoder layers (not norms, embeddings or lm_head) as float8_e4m3fn plus a
    float32 ``weight_scale_inv`` per block, the rest as they are. One weight at a time, on the tensors' device."""
    for key, t in tensors.items():
        if ".layers." in key and key.endswith(".weight") and t.dim() == 2 and "norm" not in key:
            q, scale_inv = quantise_blocks(t, block)
            yield key, q
            yield key.removesuffix("weight") + "weight_scale_inv", scale_inv
        else:
            yield key, t.contiguous()


def fp8_config(config: dict, block: tuple[int, int] = (128, 128)) -> dict:
    """``config`` (config.json's dict) with the ``quantization_config`` of an e4m3 block-scaled checkpoint."""
    return {**config, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": list(block)}}


def write_fp8_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> int:
    """An e4m3 block-scaled copy of a bf16 checkpoint, laid out as the published FP8 releases
    (:func:`fp8_tensors`, :func:`fp8_config`). For tests and benchmarks; returns how many weights were quantised."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    quantised = 0
    for file in sorted(src.glob("*.safetensors")):
        out = dict(fp8_tensors(load_file(str(file)), block))
        quantised += sum(key.endswith(".weight_scale_inv") for key in out)
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(fp8_config(config, block), indent=2))
    return quantised
