"""The model side of a GPU worker: load once, run a padded batch, capture layers.

Contract (docs/architecture.md, rule 7): layer id i is the output of decoder layer i, i.e.
Hugging Face ``hidden_states[i + 1]``; for the last layer HF reports the
output after the final norm, and so do we. The forward stops after the last
layer it needs and ``lm_head`` never runs (it is not even loaded).

Rows are right-padded and no attention mask is passed: attention is causal,
so a real token never sees the padding after it, and the padded positions are
dropped. This keeps SDPA on its fused causal path. Where the forward runs fused
kernels that take sample bounds (gpu_worker/kernels.py ``packing_ready``), a plain
batch's samples run instead as one packed row of their real tokens
(``PackedBatch``): positions restart at each sample and attention and the Gated
DeltaNet see each sample alone, so no padding is computed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass

import torch

from hsx.batch import FP8, fp8_error, quantise_fp8
from hsx.batch import VALUE_DTYPES as DTYPES
from hsx.defaults import (
    DEFAULT_FP8_ACCUMULATION,
    DEFAULT_KERNELS,
    DEFAULT_PREFIX_FORWARD_TOKENS,
    GROUPWISE_PREFIX_FORWARD_TOKENS,
    PACK_MIN_PADDING,
)
from hsx.runspec import text_config

log = logging.getLogger(__name__)


def _decoder(model):
    """The module holding ``layers``, ``norm`` and ``embed_tokens``."""
    for candidate in (model, getattr(model, "model", None), getattr(model, "language_model", None),
                      getattr(getattr(model, "model", None), "language_model", None)):
        if candidate is not None and hasattr(candidate, "layers") and hasattr(candidate, "norm"):
            return candidate
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__}")


def cache_keyword(decoder) -> str:
    """The keyword ``decoder``'s forward takes a cache by: ``cache`` (newer transformers 5) or ``past_key_values``
    (5.17 and before). A forward that also takes ``**kwargs`` would swallow the wrong one and compute each
    continued row without its prefix, so the name is read from the signature (once a forward), never guessed."""
    return _keyword_of(getattr(decoder.forward, "__func__", decoder.forward), type(decoder).__name__)


@functools.lru_cache(maxsize=16)
def _keyword_of(forward, owner: str) -> str:
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise TypeError(f"{owner}.forward takes no cache (neither `cache` nor `past_key_values`): shared prefixes "
                    "cannot be continued on this model; run with --prefix-reuse off")


@contextlib.contextmanager
def _rows_not_packed():
    """transformers' mask code without its packed-rows check, for a forward whose rows are one sample each.

    With no cache and no attention mask, transformers (5.x, ``masking_utils._preprocess_mask_arguments``) asks
    ``find_packed_sequence_indices`` whether the position ids restart inside a row, and that ends in
    ``(mask[:, -1] == 0).all()`` read as a Python bool: a GPU -> host sync at the start of every forward, so the
    host cannot queue a forward's kernels while the last one runs (a tree batch's small forwards then pay their
    host work and their GPU work one after the other). hsx's rows are right-padded samples at positions 0 .. T-1,
    for which the check returns None; this returns None without computing it. Restored on exit; a transformers
    without the function is left as it is."""
    from transformers import masking_utils

    check = getattr(masking_utils, "find_packed_sequence_indices", None)
    if check is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _not_packed
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = check


def _not_packed(position_ids):
    return None


def _check_continued(model, layers: int, cache, start: int, width: int) -> None:
    """RuntimeError unless ``cache`` now holds ``start + width`` tokens (where the ``layers`` run, the decoder's
    first, have attention layers: their keys say it; a cache the model was not given is a row computed without its
    prefix, wrong data). Layers cut after the last stored one never run: with no attention layer among those
    that do, the keys say nothing (transformers 5.17 then counts 0 tokens)."""
    types = getattr(text_config(model.config), "layer_types", None)
    if types is not None and all(t == "linear_attention" for t in types[:layers]):
        return
    held = cache.get_seq_length()
    if held != start + width:
        raise RuntimeError(f"the model's cache holds {held} tokens after a forward of {width} from {start}: it did "
                           "not continue the shared prefix (is the cache passed by the keyword its forward takes?)")


@dataclass
class PaddedBatch:
    """A batch ready for the GPU: built off the GPU thread, pinned when the target is CUDA."""

    input_ids: torch.Tensor   # [B, T] int64, right-padded
    flat_index: torch.Tensor  # [N] int64: positions b*T + t of real tokens, in sample order
    n_tokens: int


def pad_batch(packed_ids: torch.Tensor, cu_seqlens: torch.Tensor, padded_len: int, pad_id: int, pin: bool) -> PaddedBatch:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    rows = lengths.shape[0]
    if int(lengths.max()) > padded_len:
        raise ValueError(f"a sample of {int(lengths.max())} tokens does not fit the padded length {padded_len}")
    real = torch.arange(padded_len).unsqueeze(0) < lengths.unsqueeze(1)       # [B, T]
    ids = torch.full((rows, padded_len), pad_id, dtype=torch.int64)
    ids[real] = packed_ids.to(torch.int64)
    flat_index = real.reshape(-1).nonzero().squeeze(1)
    if pin:
        ids, flat_index = ids.pin_memory(), flat_index.pin_memory()
    return PaddedBatch(ids, flat_index, int(lengths.sum()))


@dataclass
class PackedBatch:
    """A batch as one row of its samples' real tokens, no padding (pinned on a CUDA target)."""

    input_ids: torch.Tensor   # [1, N] int64
    positions: torch.Tensor   # [1, N] int64: 0 .. length - 1 within each sample
    cu_seqlens: torch.Tensor  # [B + 1] int64 on the host: sample b is tokens cu[b]:cu[b + 1]
    max_len: int
    n_tokens: int


def pack_batch(packed_ids: torch.Tensor, cu_seqlens: torch.Tensor, pin: bool) -> PackedBatch:
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    n = int(cu[-1])
    if int(cu[0]) != 0 or bool((lengths < 1).any()) or packed_ids.shape[0] != n:
        raise ValueError(f"cu_seqlens {cu.tolist()[:8]}... does not cut {packed_ids.shape[0]} tokens into samples")
    positions = torch.arange(n, dtype=torch.int64) - torch.repeat_interleave(cu[:-1], lengths)
    ids = packed_ids.to(torch.int64).reshape(1, n)
    positions = positions.reshape(1, n)
    if pin:
        ids, positions = ids.pin_memory(), positions.pin_memory()
    return PackedBatch(ids, positions, cu, int(lengths.max()), n)


def decoder_packed(decoder, kernel_set, batch: PackedBatch, device, past=None):
    """``decoder``'s forward of a packed batch with ``kernel_set`` installed: the samples' bounds to every mixer
    (gpu_worker/kernels.py ``packed_rows``), the batch's positions, no mask. ``past``: the cached states each
    sample continues (``kernels.Pasts``; its positions then start at its past)."""
    from gpu_worker import kernels

    cu = kernels.to_device(batch.cu_seqlens, device)   # pinned and async: a pageable copy would wait for the GPU
    rows = kernels.Rows(cu.to(torch.int32), cu, batch.cu_seqlens, batch.max_len, past=past)
    types = getattr(decoder.config, "layer_types", None) or ["full_attention"]
    with kernels.packed_rows(decoder, rows, kernel_set):
        return decoder(input_ids=batch.input_ids.to(device, non_blocking=True),
                       position_ids=batch.positions.to(device, non_blocking=True),
                       attention_mask=dict.fromkeys(set(types)), use_cache=False)


class Extractor:
    """Holds the model; ``run`` maps a PaddedBatch or a PackedBatch to packed hidden states on the device."""

    def __init__(self, model, layer_ids: list[int], store_final: bool, out_dtype: str = "bfloat16",
                 store_dtype: str | None = None, fp8_fast_accum: bool = False, kernels: str = DEFAULT_KERNELS):
        """Wrap a built model (``load`` reads one from disk; benchmarks build real shapes from a config).

        ``store_dtype``: what batch files hold (default ``out_dtype``); FP8 is quantised here, on the device.
        ``kernels``: auto (fused kernels where available: gpu_worker/kernels.py) or eager (transformers' forward).
        """
        self.device = next(model.parameters()).device
        self.out_dtype = DTYPES[out_dtype]
        self.store_dtype = store_dtype or out_dtype
        self.num_layers = text_config(model.config).num_hidden_layers
        self.layer_ids, self.store_final = sorted(layer_ids), store_final
        self.fp8_pending = False  # float8 run whose linears are kept until the compute error is measured
        self.fp8_fast_accum = fp8_fast_accum  # float8 GEMMs converted here accumulate fast (else promoted to fp32)
        self.kernels = kernels
        self.kernels_line = ""  # what the forward runs, in words (the worker's start line)
        self.kernel_set = None  # the fused kernels installed (gpu_worker/kernels.py), None: transformers' forward
        self.packs = False      # a plain batch runs as one packed row (``batch``)
        # tokens a forward costs this worker where it runs tree batches group by group: such a batch runs its
        # samples alone where that costs less (gpu_worker/prefixrun.py ``cheaper_alone``); 0: trees as planned
        self.groupwise_price = 0
        self.continues = False  # packed rows may continue cached states (gpu_worker/prefixrun.py)
        self.tokens_fed = 0     # token positions every forward so far ran (padding in): what the GPU computed
        self._setup(model)

    @classmethod
    def load(cls, model_path: str, layer_ids: list[int], store_final: bool, device: str, out_dtype: str = "bfloat16",
             model_dtype: str | None = None, attn_implementation: str = "sdpa",
             store_dtype: str | None = None, compute_dtype: str = "bfloat16",
             fp8_accumulation: str = DEFAULT_FP8_ACCUMULATION, measure_compute: bool = False,
             kernels: str = DEFAULT_KERNELS) -> Extractor:
        """Load the model body (no lm_head) once; compute in fp32 on the CPU, bf16 on a GPU unless told.

        ``compute_dtype`` float8: the decoder layers' linears as rowwise e4m3 GEMMs (gpu_worker/fp8compute.py); refused
        (ComputeDtypeError) on a device without FP8 tensor cores. An FP8 checkpoint is loaded as it is stored.
        ``fp8_accumulation``: fp32 (partial sums promoted to fp32) or fast, the run's (manifest) choice.
        ``measure_compute``: a bf16 checkpoint's linears are converted at the first batch instead of here,
        so that ``run_measured`` can run that batch through them first (hsx/life/computeerror.py).
        """
        from transformers import AutoConfig, AutoModel

        from gpu_worker import fp8compute

        fast = fp8compute.check_fp8_accumulation(fp8_accumulation, compute_dtype) == "fast"
        if fp8compute.check_compute_dtype(compute_dtype) == "float8":
            fp8compute.require_fp8_device(device)
            if fp8compute.fp8_block_config(AutoConfig.from_pretrained(model_path)) is not None:
                model = fp8compute.load_fp8_checkpoint(model_path, device, attn_implementation, fast_accum=fast)
                return cls(model, layer_ids, store_final, out_dtype, store_dtype, fast, kernels)
        cpu = torch.device(device).type == "cpu"
        compute = DTYPES[model_dtype] if model_dtype else (torch.float32 if cpu else torch.bfloat16)
        model = AutoModel.from_pretrained(model_path, dtype=compute, attn_implementation=attn_implementation)
        model = model.to(device)
        extractor = cls(model, layer_ids, store_final, out_dtype, store_dtype, fast, kernels)
        if compute_dtype == "float8":
            extractor.fp8_pending = True
            if not measure_compute:
                extractor.convert_to_fp8()
        return extractor

    def convert_to_fp8(self) -> None:
        """The (kept) decoder layers' linears become rowwise e4m3 GEMMs, once."""
        from gpu_worker import fp8linear

        if self.fp8_pending:
            converted = fp8linear.convert_linears(self.decoder.layers, fast_accum=self.fp8_fast_accum)
            self.fp8_pending = False
            if self.device.type == "cuda":   # the bf16 weights' blocks back to the driver: a 27B on an 80 GB
                torch.cuda.empty_cache()     # card had none left for Triton to load its kernels (CUDA OOM)
            log.info("float8 compute: %d linear layers as rowwise e4m3 GEMMs (%s accumulation)", converted,
                     "fast" if self.fp8_fast_accum else "fp32")

    def _setup(self, model) -> None:
        from gpu_worker import kernels

        decoder = _decoder(model)
        prepared = kernels.prepare(decoder, self.kernels, self.device)  # before the cut: a bench's full body too
        self.kernels_line, self.kernel_set = prepared.line, prepared.kernels
        self.packs, self.continues = prepared.packs, prepared.continues
        self.hidden_size = text_config(model.config).hidden_size
        last = self.layer_ids[-1]
        # The normed final output is needed when the last layer or the final hidden state is asked for.
        self.use_final_norm = self.store_final or last == self.num_layers - 1
        if not self.use_final_norm:
            decoder.layers = decoder.layers[: last + 1]
        self.model = model.eval()
        self.decoder = decoder
        self._capture: dict[int, torch.Tensor] = {}
        self._out: torch.Tensor | None = None
        self._flat_index: torch.Tensor | None = None
        hooked = [i for i in self.layer_ids if not (self.use_final_norm and i == self.num_layers - 1)]
        for slot, layer_id in enumerate(self.layer_ids):
            if layer_id in hooked:
                decoder.layers[layer_id].register_forward_hook(self._make_hook(slot))

    def _make_hook(self, slot: int):
        H = self.hidden_size

        def hook(module, args, output):
            if self._out is None:  # a forward outside ``run`` (a benchmark's bare forward) captures nothing
                return
            h = output[0] if isinstance(output, tuple) else output
            # Pack real tokens of this layer straight into its column block; the padded
            # activation of the layer is freed as soon as the next layer is done with it.
            self._out[:, slot * H:(slot + 1) * H] = self._real(h)

        return hook

    def _real(self, h: torch.Tensor) -> torch.Tensor:
        """The real tokens of a layer's output [N, H], in sample order (a packed row holds nothing else)."""
        flat = h.reshape(-1, self.hidden_size)
        return flat if self._flat_index is None else flat.index_select(0, self._flat_index)

    def batch(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, padded_len: int, pad_id: int,
              pin: bool) -> PaddedBatch | PackedBatch:
        """A plan's batch (packed ids and bounds) laid out as this forward runs it: one packed row where the
        forward packs and the padded rows would compute more than PACK_MIN_PADDING of padding, else padded."""
        rows, real = cu_seqlens.shape[0] - 1, input_ids.shape[0]
        if self.packs and rows * padded_len > (1 + PACK_MIN_PADDING) * real:
            return pack_batch(input_ids, cu_seqlens, pin)
        return pad_batch(input_ids, cu_seqlens, padded_len, pad_id, pin)

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def stored(self, hidden: torch.Tensor, final: torch.Tensor | None,
               measure_error: bool = False) -> dict[str, torch.Tensor]:
        """The device tensors a batch file stores, by name; FP8 is quantised here on the GPU (one scale a
        token a layer), and with ``measure_error`` its error against ``hidden`` is added as ``fp8_error`` [2, n]."""
        if self.store_dtype != FP8:
            out = {"hidden_states": hidden}
            if final is not None:
                out["final_hidden_states"] = final
            return out
        with torch.inference_mode():
            q, scales = quantise_fp8(hidden, len(self.layer_ids))
            out = {"hidden_states": q, "hidden_scales": scales}
            if final is not None:
                out["final_hidden_states"], out["final_scales"] = quantise_fp8(final, 1)
            if measure_error:
                error = fp8_error(hidden, q, scales)
                if final is not None:
                    error = torch.cat([error, fp8_error(final, out["final_hidden_states"], out["final_scales"])], dim=1)
                out["fp8_error"] = error
        return out

    def run_measured(self, batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, str]:
        """``run`` on a float8 model, plus the compute error of that batch: the same batch first through the
        reference linears (a bf16 checkpoint's own, before they are converted; an FP8 checkpoint's dequantised),
        then as FP8 GEMMs. Returns (hidden, final, error [2, n stored columns] on the device, reference)."""
        from gpu_worker.fp8reference import compare, reference_linears
        from hsx import life

        dtype = str(next(p.dtype for p in self.model.parameters() if p.is_floating_point())).removeprefix("torch.")
        if self.fp8_pending:
            reference = life.Run.BF16_REFERENCE.format(dtype=dtype)
            try:
                ref_hidden, ref_final = self.run(batch, convert=False)
            finally:
                self.convert_to_fp8()
        else:
            reference = life.Run.DEQUANTISED_REFERENCE.format(dtype=dtype)
            with reference_linears(self.decoder.layers):
                ref_hidden, ref_final = self.run(batch)
        hidden, final = self.run(batch)
        with torch.inference_mode():
            error = compare(ref_hidden, hidden, len(self.layer_ids))
            if final is not None:
                error = torch.cat([error, compare(ref_final, final, 1)], dim=1)
        return hidden, final, error, reference

    @torch.inference_mode()
    def run_shared(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, groups, chunk_tokens: int,
                   cache_tokens: int = 0, forward_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``run`` for a batch planned with prefix groups ([first, count, spine] each): every shared spine computed
        once, every sample stored whole (gpu_worker/prefixrun.py). ``chunk_tokens``, ``cache_tokens`` and
        ``forward_tokens``: the plan's token budget, cached tokens and price of a forward (0: the defaults)."""
        from gpu_worker.prefixrun import run_prefix_batch
        from hsx.prep import PrefixGroup

        if self.fp8_pending:
            self.convert_to_fp8()
        return run_prefix_batch(self, input_ids, cu_seqlens, [PrefixGroup(*g) for g in groups], chunk_tokens,
                                cache_tokens, forward_tokens or DEFAULT_PREFIX_FORWARD_TOKENS)

    @torch.inference_mode()
    def run_shared_checked(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, groups, chunk_tokens: int,
                           cache_tokens: int = 0, forward_tokens: int = 0,
                           pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """``run_shared``, and the same samples computed alone: ``run`` of them as plain batches of at most
        ``chunk_tokens`` each (a batch of trees may store more: --prefix-stored-budgets), padded with ``pad_id``.
        Returns (hidden, final, [2, n] rel L2 and mean cosine of the shared against the lone, per stored layer and
        the final state)."""
        from gpu_worker.fp8reference import compare
        from gpu_worker.prefixrun import budget_pieces

        hidden, final = self.run_shared(input_ids, cu_seqlens, groups, chunk_tokens, cache_tokens, forward_tokens)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        parts = []
        for piece in budget_pieces(lengths, chunk_tokens, padded=not self.packs):
            a, b = int(cu_seqlens[piece[0]]), int(cu_seqlens[piece[-1] + 1])
            parts.append(self.run(self.batch(input_ids[a:b], cu_seqlens[piece[0]:piece[-1] + 2] - a,
                                             max(lengths[i] for i in piece), pad_id, pin=self.device.type == "cuda")))
        lone = torch.cat([p[0] for p in parts])
        lone_final = None if final is None else torch.cat([p[1] for p in parts])
        error = compare(lone, hidden, len(self.layer_ids))
        if final is not None:
            error = torch.cat([error, compare(lone_final, final, 1)], dim=1)
        return hidden, final, error

    def prefix_line(self, manifest) -> str:
        """The start line's words for shared prefixes: on or off, and the snapshot memory a batch may hold."""
        from gpu_worker.prefixrun import snapshot_bytes

        if manifest.prefix_reuse == "off":
            return "off (--prefix-reuse off: every sample computed alone)"
        nbytes = snapshot_bytes(self.model.config, manifest.prefix_cache_tokens, manifest.max_batch_rows,
                                torch.finfo(next(self.model.parameters()).dtype).bits // 8)
        gdn = "" if "GDN:" not in self.kernels_line else "; the fused GDN continues cached states"
        wide = manifest.prefix_stored_tokens   # batches of trees storing more than a budget
        stored = "" if not wide else (
            f"; a batch of trees stores up to {wide} tokens ({self.stored_bytes(wide) / 2**30:.2f} GiB of hidden "
            "states on the device, as many pinned on the host)")
        return (f"on, spines of >= {manifest.prefix_min_tokens} tokens computed once; snapshots at most "
                f"{nbytes / 2**20:.1f} MiB a batch ({manifest.prefix_cache_tokens} cached tokens){gdn}{stored}")

    def prefix_plan_warning(self, manifest) -> str:
        """What to say where this worker runs tree batches group by group (no packed waves) on a plan priced for
        the waves (under GROUPWISE_PREFIX_FORWARD_TOKENS a forward, as the default is): such a worker pays a forward
        a spine, and on per-turn data such a plan can run slower than none (docs/data.md); "" otherwise."""
        if manifest.prefix_reuse != "on" or self.continues:
            return ""
        price, packed = manifest.forward_tokens, manifest.rows_packed
        if price >= GROUPWISE_PREFIX_FORWARD_TOKENS and not packed:
            return ""
        alone = (f"; it runs a batch's samples alone where its trees cost more at {self.groupwise_price} tokens a "
                 "forward (hsx worker --prefix-forward-tokens), which does not undo the plan" if self.groupwise_price
                 else "")
        rows = ", rows packed" if packed else ""
        return (f"this run's trees were planned at {price} token{'s' * (price != 1)} a forward{rows}, for workers "
                "that run them in packed waves; this one runs them group by group (no packed rows here: fla's varlen "
                "kernels on a GPU, the gpu extra), a forward a spine and a group's rows padded, where such a plan can "
                f"be slower than none (modelled: docs/data.md){alone}; plan runs for such workers with hsx produce "
                f"--prefix-rows padded --prefix-forward-tokens {GROUPWISE_PREFIX_FORWARD_TOKENS}")

    def wide_batch_warning(self, manifest, free_bytes: int) -> str:
        """What to say where this run's batches of trees store more than a budget (--prefix-stored-budgets) and
        their stored states alone would take more than half of the device memory free after the model
        (``free_bytes``): the rest is the forward's own; "" otherwise."""
        wide = manifest.prefix_stored_tokens
        need = self.stored_bytes(wide) if manifest.prefix_reuse == "on" and wide else 0
        if need <= free_bytes / 2:
            return ""
        return (f"a batch of trees stores up to {wide} tokens, {need / 2**30:.2f} GiB of hidden states on the device, "
                f"where {free_bytes / 2**30:.2f} GiB are free after the model: such a batch may run out of memory "
                f"(plan the run with a lower --prefix-stored-budgets, or --token-budget; docs/data.md)")

    def stored_bytes(self, tokens: int) -> int:
        """Bytes of the stored hidden states (and final state) of ``tokens`` tokens on the device."""
        width = self.width + (self.hidden_size if self.store_final else 0)
        return tokens * width * self.out_dtype.itemsize

    @torch.inference_mode()
    def run(self, batch: PaddedBatch, convert: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (hidden_states [N, n*H], final_hidden_states [N, H] or None) on the device.
        A float8 model whose linears are still kept for a measurement converts them first, unless ``convert``
        is False (``run_measured``'s reference pass)."""
        if convert and self.fp8_pending:
            self.convert_to_fp8()
        if isinstance(batch, PackedBatch):
            return self.forward_rows(batch)
        return self.forward_packed(batch.input_ids.to(self.device, non_blocking=True),
                                   batch.flat_index.to(self.device, non_blocking=True), batch.n_tokens)

    def forward_rows(self, batch: PackedBatch, capture: bool = True,
                     past=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder forward of a packed batch (its samples in one row, each seen alone: gpu_worker/kernels.py
        ``packed_rows``); the stored layers as ``forward_packed`` gives them. ``capture`` False: the forward only
        (a benchmark's bare pass), returning nothing. ``past``: each sample continues cached states
        (``kernels.Pasts``: gpu_worker/prefixrun.py's rows going on)."""
        if self.kernel_set is None:
            raise RuntimeError("a packed batch needs the fused kernels (this forward runs transformers')")
        self.tokens_fed += batch.input_ids.numel()
        self._flat_index = None
        self._out = (torch.empty((batch.n_tokens, self.width), dtype=self.out_dtype, device=self.device)
                     if capture else None)
        try:
            return self._finish(decoder_packed(self.decoder, self.kernel_set, batch, self.device, past))
        finally:
            self._out = self._flat_index = None

    def _finish(self, result) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, final) of a forward whose hooks filled ``_out``: the normed last layer and final state added."""
        final = None
        if self.use_final_norm and self._out is not None:
            H = self.hidden_size
            normed = self._real(result.last_hidden_state).to(self.out_dtype)
            if self.layer_ids[-1] == self.num_layers - 1:
                self._out[:, (len(self.layer_ids) - 1) * H:] = normed
            if self.store_final:
                final = normed
        return self._out, final

    def forward_packed(self, ids: torch.Tensor, flat_index: torch.Tensor, n_tokens: int, cache=None,
                       start: int = 0, positions: torch.Tensor | None = None,
                       attention_mask: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decoder forward of ``ids`` [B, T] on the device; the stored layers of the positions ``flat_index``
        (b*T + t, in that order) as (hidden [n_tokens, n*H], final [n_tokens, H] or None). ``cache``: a
        transformers cache holding ``start`` tokens of every row, continued at positions start .. start + T - 1
        (gpu_worker/prefixrun.py continues a shared prefix); RuntimeError if the model did not append to it.
        Rows of different pasts (left-padded in the cache) come with their ``positions`` [B, T] and the
        ``attention_mask`` by layer type (prefixrun ``row_pasts``)."""
        self.tokens_fed += ids.numel()
        self._flat_index = flat_index
        self._out = torch.empty((n_tokens, self.width), dtype=self.out_dtype, device=self.device)
        kwargs: dict = {"use_cache": False}
        if cache is not None:
            rows, width = ids.shape
            if positions is None:
                positions = torch.arange(start, start + width, device=ids.device).unsqueeze(0).expand(rows, -1)
            kwargs = {cache_keyword(self.decoder): cache, "use_cache": True, "position_ids": positions}
            if attention_mask is not None:
                kwargs["attention_mask"] = attention_mask
        try:
            with _rows_not_packed() if cache is None else contextlib.nullcontext():
                result = self.decoder(input_ids=ids, **kwargs)
            if cache is not None:
                _check_continued(self.model, len(self.decoder.layers), cache, start, ids.shape[1])
            return self._finish(result)
        finally:
            self._out = self._flat_index = None
