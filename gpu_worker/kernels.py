"""The target's forward on maintained fused kernels where they exist, else exactly transformers' own.

A profile of the 27B hybrid FP8 step on an H200 put more than half of the GPU's time outside the GEMMs, in
transformers' eager code around them: layout copies and fp32 casts of the Gated DeltaNet path, a torch fallback
for its 4-tap convolution, eager fp32 RMSNorms, gating, SiLU x up and residual adds as separate kernels. This
module replaces that glue, per module instance, with flash-linear-attention's (``fla-core``) Triton kernels, the
set vLLM and SGLang run in their Qwen3-Next models:

| module (transformers class)        | eager (transformers)                              | fused (fla)                         |
|------------------------------------|---------------------------------------------------|-------------------------------------|
| RMSNorm (Qwen3, Qwen3.5 zero-centred) | fp32 cast, pow, mean, rsqrt, mul, (1 + w), cast | ``rms_norm``, weight (1 + w) in fp32 |
| decoder layer, after the mixer     | ``residual + h``, then the RMSNorm above          | one ``rms_norm`` with the residual   |
| MLP                                | ``silu(gate) * up``: two kernels                  | ``swiglu``                           |
| Gated DeltaNet convolution         | transpose, ``F.conv1d`` (depthwise), silu, transpose | ``causal_conv1d`` on [B, T, D]   |
| Gated DeltaNet gates and heads     | fp32 gate, sigmoid, ``repeat_interleave`` of q, k | in ``chunk_gated_delta_rule``      |
| Gated DeltaNet output norm         | gated RMSNorm in fp32, six kernels               | ``rms_norm_gated``                   |

The GEMMs (bf16, or hsx's FP8 linears: gpu_worker/fp8linear.py), attention, rotary and embeddings are untouched,
and the linears are still called one by one on the same activation object, so the FP8 path quantises it once.

(The chunk kernel computes the gate -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b) itself, and reads q and k
once per group of value heads instead of copies made by ``repeat_interleave``.)

Numbers: each fused kernel computes in fp32 and rounds once where the eager code rounds to bf16 between steps
(e.g. ``weight * h.to(bf16)``, the bf16 residual sum before the norm); the outputs differ from transformers' by
bf16 rounding, not by formula. bench/kernel_parity.py compares every replaced module with the code it replaces on
the shapes it will see (padding, length 1, a sample ending mid-chunk) and bench/fp8_fidelity.py the whole model
against an fp32 forward.

Packed rows (``--kernels auto``). A plain batch's samples run as one row of their real tokens, no padding: the
positions restart at each sample, the Gated DeltaNet's conv and chunk kernels take the samples' ``cu_seqlens``
(fla's varlen form) and attention runs torch's varlen flash attention over the same bounds, so no token sees
another sample's. The mix-32k batches pad 10-25 % of their tokens; packed, the GPU computes only real ones.
``packing_ready`` says whether a model can (every mixer of a known class, fused, sdpa, no sliding window, the
varlen kernel checked on the device against SDPA at start), ``packed_rows`` routes one forward, and refuses
the result (RuntimeError) unless every attention and GDN layer ran varlen.

When anything is missing (no CUDA, no fla, an fla whose kernels lack the arguments used here, a model class not
in the tables below), that module keeps transformers' forward: the fallback is exactly today's path. A forward
with a padding mask (not hsx's: right-padded, no mask) takes the eager forward too; one with a cache (a shared prefix
continued) runs the fused GDN from the cached conv window and recurrent state (fla's kernels take
``initial_state`` / ``output_final_state``), a one-token decode step the eager one.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import logging
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hsx.defaults import KERNEL_MODES as KERNELS
from hsx.defaults import PACK_MIN_PADDING

log = logging.getLogger(__name__)

# The worker's --kernels (hsx/defaults.py): fused kernels and packed rows where available; fused kernels on padded
# rows; or transformers' forward only.

# transformers' classes whose forward is replaced, by what their weight means.
ZERO_CENTRED_NORMS = {"Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm"}   # out = norm(x) * (1 + w)
PLAIN_NORMS = {"Qwen3RMSNorm"}                                                      # out = w * norm(x)
DECODER_LAYERS = {"Qwen3_5DecoderLayer", "Qwen3DecoderLayer"}
GATED_MLPS = {"Qwen3_5MLP", "Qwen3MLP"}
GATED_DELTANETS = {"Qwen3_5GatedDeltaNet"}   # in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3.5's layout)
# Attention modules that hand q, k, v to transformers' attention interface ([B, H, T, D]) and take [B, T, H, D] back.
ATTENTIONS = {"Qwen3_5Attention", "Qwen3Attention"}
MIXER_TYPES = {"full_attention", "linear_attention"}   # layer types a packed forward can route


@dataclass
class Rows:
    """The sample bounds of one packed forward ([1, T] tokens): ``cu32`` on the device for flash attention, ``cu64``
    on the device and ``cu_host`` on the host for fla (its varlen kernels read the host copy instead of syncing),
    ``max_len`` the longest sample. The counters say which layers ran varlen (``packed_rows`` checks them)."""

    cu32: torch.Tensor
    cu64: torch.Tensor
    cu_host: torch.Tensor
    max_len: int
    kernels: KernelSet | None = None
    attention_calls: int = 0
    gdn_calls: int = 0
    seen: set = field(default_factory=set)
    past: Pasts | None = None   # the cached states each sample continues (None: every sample from token 0)
    chunks: torch.Tensor | None = field(default=None, repr=False)

    def chunk_indices(self) -> torch.Tensor:
        """fla's varlen chunk table ([chunks, 2]: each FLA_CHUNK-token chunk's sample and its index in it, int64 on
        the device), built here from the host bounds and copied pinned and asynchronously. fla builds the same
        table when given none, but copies it from pageable memory (``.to(cu_seqlens)``): a copy that waits for the
        GPU's queue to drain, twice a forward (conv and chunk rule), so the host could not queue a forward's
        kernels while the one before it ran."""
        if self.chunks is None:
            counts = (self.cu_host[1:] - self.cu_host[:-1] + FLA_CHUNK - 1) // FLA_CHUNK
            sample = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int64), counts)
            first = torch.cumsum(counts, 0) - counts
            table = torch.stack([sample, torch.arange(len(sample), dtype=torch.int64) - first[sample]], 1)
            self.chunks = to_device(table, self.cu64.device)
        return self.chunks


class State:
    """One row's cached states at a branch point of a shared prefix, as packed rows leave them (``Pasts`` with
    ``record``): a node of a tree, holding only what its own tokens added. Its attention keys and values are its
    ``parent``'s (and theirs, up to the root) followed by its own ``keys[layer]`` / ``values[layer]`` ([n, Hkv, D]),
    so a spine's tokens are held once however many rows continue them; a Gated DeltaNet layer's ``conv[layer]``
    (the last W conv inputs, [W, D]) and ``recurrent[layer]`` ([HV, K, V] fp32) are the whole row's, dropped
    (``release``) once every row continuing them has run. ``past``: the tokens it holds."""

    def __init__(self, parent: State | None, tokens: int):
        self.parent, self.past = parent, (parent.past if parent is not None else 0) + tokens
        self.tokens = tokens
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] | None = {}
        self.recurrent: dict[int, torch.Tensor] | None = {}

    def chain(self) -> list[State]:
        """The nodes whose keys make this row's past, root first."""
        out, node = [], self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def release(self) -> None:
        """Drop the Gated DeltaNet states (the keys stay: rows continuing a child read them)."""
        self.conv = self.recurrent = None


class Pasts:
    """The cached states the samples of a packed forward continue: sample i goes on from ``states[i]`` (a
    ``State``: a shared prefix's keys and values, conv window and recurrent state; None: from token 0), its own
    tokens at positions past .. past + n - 1. Per layer, on demand (one layer's copies at a time):

    - attention: the held keys and values of every node on the samples' chains stacked once, and each sample's
      keys as its chain's then its own (``keys_values``: one gather into [sum(past + n), Hkv, D], bounds ``cu_k``);
    - Gated DeltaNet: each sample's conv input as its state's window (the last W inputs; zeros from token 0) then
      its own (``conv_input``: [sum(W + n), D] in bounds ``conv_rows``; ``conv_new`` picks the outputs of its own
      tokens), and its recurrent state (``initial``: [samples, HV, K, V] fp32, zeros from token 0).

    ``record``: the samples whose states at their last token are kept, as ``recorded[i]`` (a child ``State`` of
    ``states[i]``): their own keys and values, the last W conv inputs and the final recurrent state, filled as
    the layers run; ``check_recorded`` says whether every layer filled them."""

    def __init__(self, states: list[State | None], lengths: list[int], window: int, device,
                 record: Sequence[int] = ()):
        self.window = window
        n = len(states)
        length_t = torch.tensor(lengths, dtype=torch.int64)
        past_t = torch.tensor([0 if s is None else s.past for s in states], dtype=torch.int64)
        self.q_start = [0, *itertools.accumulate(lengths)]
        # the nodes whose keys any sample reads, each once; key row j of sample i: its chain's, then its own
        chains = [() if s is None else s.chain() for s in states]
        self.nodes = list({id(node): node for chain in chains for node in chain}.values())
        at = dict(zip(map(id, self.nodes), itertools.accumulate([0, *(node.tokens for node in self.nodes)]),
                      strict=False))
        held_keys = sum(node.tokens for node in self.nodes)
        spans = []
        for i, chain in enumerate(chains):
            spans += [(at[id(node)], node.tokens) for node in chain]
            spans.append((held_keys + self.q_start[i], lengths[i]))
        self.kv_index = to_device(_spans(spans), device)
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), (past_t + length_t).cumsum(0)])
        self.cu_k32 = to_device(cu_k.to(torch.int32), device)
        self.max_k = int((past_t + length_t).max())
        # conv input row j of sample i: its state's window (zeros: the block after the held windows), then its own
        self.gdn = list({id(s): s for s in states if s is not None}.values())
        slot = {id(s): k for k, s in enumerate(self.gdn)}
        entry = [len(self.gdn) if s is None else slot[id(s)] for s in states]
        self.entry = to_device(torch.tensor(entry, dtype=torch.int64), device)
        cu_conv = torch.cat([torch.zeros(1, dtype=torch.int64), (window + length_t).cumsum(0)])
        cu_conv_device = to_device(cu_conv, device)
        self.conv_rows = Rows(cu_conv_device.to(torch.int32), cu_conv_device, cu_conv, int(window + length_t.max()))
        held = (len(self.gdn) + 1) * window
        self.conv_index = to_device(_spans([span for i in range(n) for span in (
            (entry[i] * window, window), (held + self.q_start[i], lengths[i]))]), device)
        self.conv_new = to_device(torch.cat([torch.arange(int(cu_conv[i]) + window, int(cu_conv[i + 1]))
                                             for i in range(n)]), device)
        self.conv_last = to_device(torch.cat([torch.arange(int(cu_conv[i + 1]) - window, int(cu_conv[i + 1]))
                                              for i in record]) if record else torch.zeros(0, dtype=torch.int64),
                                   device)
        self.record = list(record)
        self.recorded = {i: State(states[i], lengths[i]) for i in self.record}
        self.record_index = to_device(torch.tensor(self.record, dtype=torch.int64), device)

    def keys_values(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sample's keys and values [sum(past + n), Hkv, D]: its chain's held ones, then ``keys`` / ``values``
        [N, Hkv, D] of its own tokens (the recorded samples' own kept)."""
        for i, state in self.recorded.items():
            state.keys[layer] = keys[self.q_start[i]:self.q_start[i + 1]].clone()
            state.values[layer] = values[self.q_start[i]:self.q_start[i + 1]].clone()
        if not self.nodes:
            return keys, values
        out = []
        for new, held in ((keys, [node.keys[layer] for node in self.nodes]),
                          (values, [node.values[layer] for node in self.nodes])):
            out.append(torch.cat([*held, new]).index_select(0, self.kv_index))
        return out[0], out[1]

    def conv_input(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """[1, sum(W + n), D]: each sample's state's conv window (the last W inputs; zeros from token 0), then its
        own ``x`` [1, N, D] (the recorded samples' last W kept)."""
        zeros = x.new_zeros((self.window, x.shape[-1]))
        held = [s.conv[layer].to(x.dtype) for s in self.gdn]
        extended = torch.cat([*held, zeros, x[0]]).index_select(0, self.conv_index)
        if self.record:
            last = extended.index_select(0, self.conv_last).reshape(len(self.record), self.window, -1)
            for k, i in enumerate(self.record):
                self.recorded[i].conv[layer] = last[k]
        return extended.unsqueeze(0)

    def initial(self, layer: int) -> torch.Tensor | None:
        """[samples, HV, K, V] fp32: each sample's state's recurrent state (zeros from token 0); None where no
        sample has a state (the kernel's own zero start)."""
        if not self.gdn:
            return None
        held = torch.stack([s.recurrent[layer] for s in self.gdn]).float()
        return torch.cat([held, held.new_zeros((1, *held.shape[1:]))]).index_select(0, self.entry)

    def keep_final(self, layer: int, final: torch.Tensor | None) -> None:
        """The recorded samples' final recurrent states [samples, HV, K, V] (the delta rule's output)."""
        if self.record:
            if final is None:
                raise RuntimeError("packed rows: the delta rule gave no final state for the recorded samples")
            for k, state in enumerate(final.index_select(0, self.record_index)):
                self.recorded[self.record[k]].recurrent[layer] = state

    def check_recorded(self, attention: set[int], gdn: set[int]) -> None:
        """RuntimeError unless every recorded sample holds the states of the layers ``attention`` and ``gdn``."""
        for i, state in self.recorded.items():
            if set(state.keys) != attention or set(state.conv) != gdn or set(state.recurrent) != gdn:
                raise RuntimeError(f"packed rows: sample {i}'s states were recorded for attention layers "
                                   f"{sorted(state.keys)} and GDN layers {sorted(state.conv)}, not {sorted(attention)}"
                                   f" and {sorted(gdn)}")


def _spans(spans: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenated ranges start .. start + n - 1 of each (start, n)."""
    return torch.cat([torch.arange(a, a + n) for a, n in spans] or [torch.zeros(0)]).to(torch.int64)


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on the device without a host sync on CUDA (a pageable copy waits for the GPU's queue to drain, so the
    host could not queue the next forward's kernels while this one runs): pinned, then copied asynchronously; the
    pinned block is not reused before the copy is done (torch's caching host allocator records it)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


@dataclass(frozen=True)
class KernelSet:
    """The fused operations, as functions of tensors; ``fla`` on a GPU, ``reference`` (the same maths in torch)
    for tests of the glue on the CPU. Shapes: x [..., D]; q, k [B, T, H, K]; v [B, T, HV, V]; a, b [B, T, HV]."""

    name: str
    rms_norm: Callable          # (x, weight, residual | None, eps) -> y | (y, x + residual)
    rms_norm_gated: Callable    # (x, gate, weight, eps) -> norm(x) * weight * silu(gate)
    swiglu: Callable            # (gate, up) -> silu(gate) * up
    # (x [B, T, D], weight [D, W], bias | None, activation, rows=None) -> [B, T, D]; rows: packed samples (B = 1)
    causal_conv1d: Callable
    # (q, k, v, a, b, A_log, dt_bias, initial_state=None, output_final_state=False, rows=None) -> (o [B, T, HV, V],
    # final state [B, HV, K, V] fp32 or None); l2-normed q, k inside; initial_state: a cached prefix's state
    gated_delta_rule: Callable
    # (q [T, Hq, D], k, v [T, Hkv, D], rows, scale) -> [T, Hq, D]: causal attention within each sample; None where
    # this kernel set has none (then no packed rows)
    varlen_attention: Callable | None = None


FLA_CHUNK = 64     # fla 0.6's varlen conv and chunk rule: their default chunk size, the one hsx runs them at
FLA_MIN = (0, 6)   # fla-core 0.6: chunk_gated_delta_rule takes use_gate_in_kernel, A_log, dt_bias and beta logits


def fla_kernels() -> KernelSet:
    """flash-linear-attention's Triton kernels; ImportError (or PackageNotFoundError) where fla-core is missing,
    TypeError where it is older than FLA_MIN (its chunk kernel takes the in-kernel gate as **kwargs, so an older
    one would not refuse the arguments: it would ignore them)."""
    version = importlib.metadata.version("fla-core")
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < FLA_MIN:
        raise TypeError(f"fla-core {version} is older than {'.'.join(map(str, FLA_MIN))}: no in-kernel gate")

    from fla.modules.activations import swiglu
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils.index import prepare_chunk_indices

    def plain_norm(x, weight, eps):
        return rms_norm(x, weight, None, eps=eps)

    small_norm = few_row_counts(plain_norm, NORM_ROWS_BLOCK)
    gated = few_row_counts(lambda x, gate, weight, eps: rms_norm_gated(x, gate, weight, None, activation="silu",
                                                                        eps=eps), GATED_NORM_ROWS_BLOCK)

    def norm(x, weight, residual, eps):
        if residual is None and x.shape[-1] <= SMALL_ROW:   # the attention's per-head q and k norms
            return small_norm(x, weight, eps)
        return rms_norm(x, weight, None, residual=residual, eps=eps, prenorm=residual is not None)

    own_table = same_chunk_table(prepare_chunk_indices)   # else fla builds it (one host wait each)
    if not own_table:
        log.warning("fla %s builds its varlen chunk table unlike hsx's: fla's own is used (a host wait a call)",
                    version)

    def varlen(rows):
        bounds = {"cu_seqlens": rows.cu64, "cu_seqlens_cpu": rows.cu_host}
        return {**bounds, "chunk_indices": rows.chunk_indices()} if own_table else bounds

    def conv(x, weight, bias, activation, rows=None):
        bounds = {} if rows is None else varlen(rows)
        return causal_conv1d(x, weight=weight, bias=bias, activation=activation, **bounds)[0]

    def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state=None, output_final_state=False, rows=None):
        bounds = {} if rows is None else varlen(rows)
        return chunk_gated_delta_rule(q, k, v, g=a, beta=b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                      A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                                      initial_state=initial_state, output_final_state=output_final_state, **bounds)

    return KernelSet(f"fla {version}", norm, gated, swiglu, conv, delta_rule, flash_varlen_attention)


def same_chunk_table(fla_table: Callable) -> bool:
    """Whether ``Rows.chunk_indices`` gives what fla's own ``fla_table(cu_seqlens, FLA_CHUNK)`` gives, on bounds
    with a sample of 1 token, one ending on a chunk boundary, one just past it and a long one (on the host)."""
    cu = torch.tensor([0, 1, 65, 130, 1130, 1131], dtype=torch.int64)
    ours = Rows(cu.to(torch.int32), cu, cu, 1000).chunk_indices()
    try:
        theirs = fla_table(cu, FLA_CHUNK)
    except Exception:   # a self-check: whatever it raises means fla's own table is used
        return False
    return theirs.shape == ours.shape and bool(torch.equal(theirs.to(torch.int64), ours))


def flash_varlen_attention(q, k, v, rows: Rows, scale: float):
    """torch's flash attention (FA2) over packed samples: causal within each, grouped kv heads as they are. With
    ``rows.past`` each sample's keys are its past's then its own (``k``, ``v`` in ``past.cu_k32``): FA2's causal
    mask is aligned to the end of the keys, so a token sees its past and its sample up to itself."""
    cu_k, max_k = (rows.cu32, rows.max_len) if rows.past is None else (rows.past.cu_k32, rows.past.max_k)
    return torch.ops.aten._flash_attention_forward(q, k, v, rows.cu32, cu_k, rows.max_len, max_k, 0.0,
                                                   True, False, scale=scale)[0]


def sdpa_varlen_attention(q, k, v, rows: Rows, scale: float):
    """The same as ``flash_varlen_attention`` sample by sample through SDPA: the reference, and the CPU's."""
    bounds = rows.cu_host.tolist()
    keys = bounds if rows.past is None else rows.past.cu_k32.cpu().tolist()
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        qs = q[s:e].transpose(0, 1)
        ks, vs = (t[keys[i]:keys[i + 1]].transpose(0, 1).repeat_interleave(group, dim=0) for t in (k, v))
        past = ks.shape[1] - qs.shape[1]   # keys before the sample's own: all seen (the end-aligned causal mask)
        mask = torch.arange(ks.shape[1]).unsqueeze(0) <= past + torch.arange(qs.shape[1]).unsqueeze(1)
        out[s:e] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(qs.device),
                                                  scale=scale).transpose(0, 1)
    return out


# fla 0.6's norms for rows of at most SMALL_ROW features take NB = cdiv(rows, block) as a Triton constexpr (and
# autotune key): every new value compiles the kernel's 9 configs again. The 27B's q norm sees tokens x 24 rows, a
# new NB every ~85 tokens of batch size (~380 values up to 32k-token batches); its gated GDN norm tokens x 48 rows
# in blocks of 65,536. few_row_counts pads the rows so NB takes about 4 values an octave.
SMALL_ROW = 512
NORM_ROWS_BLOCK = 2048             # fla/modules/norm/layernorm.py: layer_norm_fwd
GATED_NORM_ROWS_BLOCK = 2048 * 32  # fla/modules/norm/fused_norm_gate.py: layer_norm_gated_fwd


def bucketed_blocks(blocks: int) -> int:
    """``blocks`` rounded up to one of few values: exact up to 8, then 4 values an octave (at most 25 % more)."""
    if blocks <= 8:
        return blocks
    step = 1 << (blocks.bit_length() - 3)
    return -(-blocks // step) * step


def few_row_counts(fn: Callable, block: int) -> Callable:
    """``fn(x, *rest)`` of a row-wise op whose kernel specialises on cdiv(rows, block): tensor arguments of x's
    shape get zero rows appended so that count is ``bucketed_blocks``'s (the fewest rows that give it), the
    result's real rows are returned in x's shape. A zero row normalises to zero and no real row reads it."""
    def padded(x, *rest):
        width = x.shape[-1]
        rows = x.numel() // width
        blocks = -(-rows // block)
        target = blocks if rows == 0 else bucketed_blocks(blocks)
        if target == blocks:
            return fn(x, *rest)
        extra = (target - 1) * block + 1 - rows
        grown = [F.pad(t.reshape(rows, width), (0, 0, 0, extra)) if torch.is_tensor(t) and t.shape == x.shape else t
                 for t in (x, *rest)]
        return fn(*grown)[:rows].reshape(x.shape)
    return padded


def reference_kernels(chunk_rule: Callable) -> KernelSet:
    """The fused operations written in torch (fp32 inside, one rounding), to test the glue where Triton cannot
    run; ``chunk_rule`` is transformers' torch ``chunk_gated_delta_rule`` of the model's own module."""

    def norm(x, weight, residual, eps):
        s = x.float() if residual is None else x.float() + residual.float()
        y = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
        return y if residual is None else (y, s.to(x.dtype))

    def gated(x, gate, weight, eps):
        s = x.float()
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return (y * F.silu(gate.float())).to(x.dtype)

    def swiglu(gate, up):
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)

    def one_conv(x, weight, bias, activation):
        out = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                       groups=x.shape[-1])[..., : x.shape[1]]
        return (F.silu(out) if activation in ("silu", "swish") else out).transpose(1, 2)

    def one_rule(q, k, v, a, b, A_log, dt_bias, initial_state=None, output_final_state=False):
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        group = v.shape[2] // q.shape[2]
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        return chunk_rule(q, k, v, g=g, beta=b.float().sigmoid().to(v.dtype), use_qk_l2norm_in_kernel=True,
                          initial_state=initial_state, output_final_state=output_final_state)

    def conv(x, weight, bias, activation, rows=None):
        if rows is None:
            return one_conv(x, weight, bias, activation)
        return torch.cat([one_conv(x[:, s:e], weight, bias, activation) for s, e in _segments(rows)], dim=1)

    def delta_rule(q, k, v, a, b, A_log, dt_bias, initial_state=None, output_final_state=False, rows=None):
        if rows is None:
            return one_rule(q, k, v, a, b, A_log, dt_bias, initial_state, output_final_state)
        outs = [one_rule(q[:, s:e], k[:, s:e], v[:, s:e], a[:, s:e], b[:, s:e], A_log, dt_bias,
                         None if initial_state is None else initial_state[i:i + 1], output_final_state)
                for i, (s, e) in enumerate(_segments(rows))]
        final = torch.cat([o[1] for o in outs]) if output_final_state else None
        return torch.cat([o[0] for o in outs], dim=1), final

    return KernelSet("reference (torch)", norm, gated, swiglu, conv, delta_rule, sdpa_varlen_attention)


def reference_for(model) -> KernelSet:
    """``reference_kernels`` with the chunk rule of ``model``'s own Gated DeltaNet module (transformers' torch
    ``torch_chunk_gated_delta_rule``; None for a model without one): the fused glue on the CPU."""
    import sys

    gdn = next((m for m in model.modules() if type(m).__name__ in GATED_DELTANETS), None)
    rule = getattr(sys.modules[type(gdn).__module__], "torch_chunk_gated_delta_rule", None) if gdn else None
    return reference_kernels(rule)


def _segments(rows: Rows) -> list[tuple[int, int]]:
    bounds = rows.cu_host.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


# ---- the replaced forwards (bound to each module instance as ``forward``) ---------------------------------------

def _norm_forward(self, x):
    return self._hsx_kernels.rms_norm(x, self._hsx_weight, None, self._hsx_eps)


def _mlp_forward(self, x):
    return self.down_proj(self._hsx_kernels.swiglu(self.gate_proj(x), self.up_proj(x)))


def _layer_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None, **kwargs):
    """transformers' decoder layer with the post-mixer residual add fused into the norm. The cache keyword is
    passed on as the layer got it (``past_key_values`` before transformers 5.2x, ``cache`` after); a Gated
    DeltaNet of the older API calls it ``cache_params``."""
    residual = hidden_states
    h = self.input_layernorm(hidden_states)
    if getattr(self, "block_type", "full_attention") == "linear_attention":
        if "past_key_values" in kwargs:
            kwargs["cache_params"] = kwargs.pop("past_key_values")
        h = self.linear_attn(hidden_states=h, attention_mask=attention_mask, **kwargs)
    else:
        h, _ = self.self_attn(hidden_states=h, attention_mask=attention_mask, position_ids=position_ids,
                              position_embeddings=position_embeddings, **kwargs)
    post = self.post_attention_layernorm
    h, residual = self._hsx_kernels.rms_norm(h, post._hsx_weight, residual, post._hsx_eps)
    return residual + self.mlp(h)


def _gdn_forward(self, hidden_states, attention_mask=None, **kwargs):
    """The fused Gated DeltaNet. With a cache (a shared prefix continued: gpu_worker/prefixrun.py) it reads and
    writes the layer's states as transformers' forward does: the conv window (the last kernel-size inputs, layout
    [B, D, W]) is put before this call's inputs, and the recurrent state is the delta rule's initial state and
    is replaced by its final one. A single-token decode step (``seq_len == 1`` with a state) stays eager."""
    cache = kwargs.get("cache_params", kwargs.get("cache"))
    if (attention_mask is not None or kwargs.get("cu_seq_lens_q") is not None
            or (cache is not None and (hidden_states.shape[1] == 1 or _recording_past(cache, self.layer_idx)))):
        return self._hsx_eager(hidden_states, attention_mask=attention_mask, **kwargs)
    kernels = self._hsx_kernels
    rows = getattr(self, "_hsx_rows", None) if cache is None else None   # packed samples: their bounds
    batch, seq_len, _ = hidden_states.shape
    mixed_qkv = self.in_proj_qkv(hidden_states)          # the four projections read one activation object:
    z = self.in_proj_z(hidden_states)                    # the FP8 path quantises it once
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    initial = None
    if rows is not None and rows.past is not None:   # each sample after its entry's conv window, its state
        past = rows.past
        extended = kernels.causal_conv1d(past.conv_input(self.layer_idx, mixed_qkv), self._hsx_conv_weight,
                                         self.conv1d.bias, self.activation, rows=past.conv_rows)
        mixed_qkv = extended[0].index_select(0, past.conv_new).unsqueeze(0)
        initial = past.initial(self.layer_idx)
    elif rows is not None:
        mixed_qkv = kernels.causal_conv1d(mixed_qkv, self._hsx_conv_weight, self.conv1d.bias, self.activation,
                                          rows=rows)
    elif cache is not None:   # the recurrent state first: updating the conv window marks the layer as started
        initial = _recurrent_state(cache, self.layer_idx)
        full = cache.update_conv_state(mixed_qkv.transpose(1, 2), self.layer_idx,
                                       conv_kernel_size=self.conv_kernel_size)       # [B, D, W + T] (or padded)
        mixed_qkv = kernels.causal_conv1d(full.transpose(1, 2).contiguous(), self._hsx_conv_weight, self.conv1d.bias,
                                          self.activation)[:, -seq_len:]
    else:
        mixed_qkv = kernels.causal_conv1d(mixed_qkv, self._hsx_conv_weight, self.conv1d.bias, self.activation)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch, seq_len, -1, self.head_v_dim)
    records = rows is not None and rows.past is not None and bool(rows.past.record)
    out, final = kernels.gated_delta_rule(query, key, value, a, b, self.A_log, self.dt_bias, initial_state=initial,
                                          output_final_state=cache is not None or records,
                                          **({} if rows is None else {"rows": rows}))
    if records:
        rows.past.keep_final(self.layer_idx, final)
    if rows is not None:
        rows.gdn_calls += 1
        rows.seen.add(id(self))
    if cache is not None:
        cache.update_recurrent_state(final, self.layer_idx)
    out = kernels.rms_norm_gated(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim),
                                 self.norm.weight, self.norm.variance_epsilon)
    return self.out_proj(out.reshape(batch, seq_len, -1))


def _routed(previous: Callable) -> Callable:
    """transformers' attention function ``previous``, except for a module inside ``packed_rows``: varlen attention
    over its samples. Takes and gives transformers' layouts: q, k, v [1, H, T, D] in, [1, T, H, D] out."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        rows = getattr(module, "_hsx_rows", None)
        if rows is None:
            return previous(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if query.shape[0] != 1 or kwargs.get("sliding_window") is not None or dropout:
            raise RuntimeError(f"packed rows: {type(module).__name__} asked for what varlen attention here does not "
                               "do (one row, causal, no sliding window, no dropout)")
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        if rows.past is not None:   # each sample's keys: its entry's cached ones, then its own
            k, v = rows.past.keys_values(module.layer_idx, k, v)
        out = rows.kernels.varlen_attention(q, k, v, rows, scaling if scaling is not None else q.shape[-1] ** -0.5)
        rows.attention_calls += 1
        rows.seen.add(id(module))
        return out.unsqueeze(0), None
    attention._hsx_routed = True
    return attention


def mixers(decoder) -> tuple[list, list]:
    """The attention modules and Gated DeltaNets under ``decoder.layers`` (the layers the forward runs)."""
    attention = [m for m in decoder.layers.modules() if type(m).__name__ in ATTENTIONS]
    gdn = [m for m in decoder.layers.modules() if type(m).__name__ in GATED_DELTANETS]
    return attention, gdn


@contextlib.contextmanager
def packed_rows(decoder, rows: Rows, kernel_set: KernelSet):
    """Route one forward of packed samples (``rows``): every attention module of ``decoder.layers`` to varlen
    attention, every fused Gated DeltaNet to fla's varlen kernels. On a normal exit, RuntimeError unless each of
    them ran varlen exactly once: a layer that ran as one sequence would have let samples see each other."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention, gdn = mixers(decoder)
    impl = decoder.config._attn_implementation
    if impl not in ALL_ATTENTION_FUNCTIONS:
        raise RuntimeError(f"packed rows route transformers' registered attention; this model runs {impl!r}")
    own = impl in ALL_ATTENTION_FUNCTIONS._local_mapping
    previous = ALL_ATTENTION_FUNCTIONS[impl]
    rows.kernels = kernel_set
    for module in (*attention, *gdn):
        module._hsx_rows = rows
    ALL_ATTENTION_FUNCTIONS[impl] = previous if getattr(previous, "_hsx_routed", False) else _routed(previous)
    try:
        yield rows
    finally:
        if own:
            ALL_ATTENTION_FUNCTIONS[impl] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS[impl]
        for module in (*attention, *gdn):
            del module._hsx_rows
    # By the config's layer types, not by the modules found: a mixer of a class not known here counts as not routed.
    kinds = list(getattr(decoder.config, "layer_types", None) or ["full_attention"] * len(decoder.layers))
    kinds = kinds[:len(decoder.layers)]
    want_attention, want_gdn = kinds.count("full_attention"), kinds.count("linear_attention")
    if (rows.seen != {id(m) for m in (*attention, *gdn)} or rows.attention_calls != want_attention
            or rows.gdn_calls != want_gdn or want_attention + want_gdn != len(kinds)):
        raise RuntimeError(f"packed rows: {rows.attention_calls} of {want_attention} attention and {rows.gdn_calls} "
                           f"of {want_gdn} Gated DeltaNet layers ran over the samples' bounds; the others would have "
                           "let samples see each other (run with --kernels padded)")
    if rows.past is not None:
        rows.past.check_recorded({m.layer_idx for m in attention}, {m.layer_idx for m in gdn})


def packing_ready(decoder, kernel_set: KernelSet | None, device) -> tuple[bool, str]:
    """Whether packed rows are exact on this model and device, and if not, why (in words)."""
    config = decoder.config
    if kernel_set is None or kernel_set.varlen_attention is None:
        return False, "no varlen attention kernel here"
    types_ = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not types_ <= MIXER_TYPES:
        return False, f"layer types {sorted(types_ - MIXER_TYPES)} have no varlen path here"
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        return False, "sliding-window attention"
    if config._attn_implementation != "sdpa":
        return False, f"attention implementation {config._attn_implementation!r} (packed rows route sdpa's)"
    attention, gdn = mixers(decoder)
    unknown = {type(m).__name__ for m in decoder.layers.modules()
               if type(m).__name__.endswith(("Attention", "DeltaNet")) and type(m).__name__ not in ATTENTIONS | GATED_DELTANETS}
    if unknown:
        return False, f"mixers of classes {sorted(unknown)} have no varlen path here"
    if not attention and not gdn:
        return False, "no attention or Gated DeltaNet module found"
    unfused = [m for m in gdn if getattr(m.forward, "__func__", None) is not _gdn_forward]
    if unfused:
        return False, f"{len(unfused)} Gated DeltaNet layers run transformers' forward (no varlen conv there)"
    if attention and torch.device(device).type == "cuda":
        why = _check_varlen_attention(kernel_set, attention[0], device, pasts=False)
        if why:
            return False, why
    return True, ""


def continuation_ready(decoder, kernel_set: KernelSet, device) -> tuple[bool, str]:
    """Whether packed samples may continue cached states (prefix reuse's rows going on, gpu_worker/prefixrun.py)
    where plain packing is ready: the varlen kernel with each sample's past keys before its own, checked on the
    device against SDPA with the same end-aligned causal mask."""
    attention, _ = mixers(decoder)
    if attention and torch.device(device).type == "cuda":
        why = _check_varlen_attention(kernel_set, attention[0], device, pasts=True)
        if why:
            return False, why
    return True, ""


def _check_varlen_attention(kernel_set: KernelSet, module, device, pasts: bool) -> str:
    """Run the varlen kernel once on the device on the model's head shape (grouped kv heads, 3 samples, one of
    length 1; ``pasts``: continuing pasts of 5, 0 and 64 tokens) against SDPA sample by sample; '' if it agrees,
    else what went wrong."""
    config = module.config
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    dim = getattr(module, "head_dim", config.hidden_size // heads)
    dtype = next(module.parameters()).dtype
    lengths = [1, 70, 130]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    rows = Rows(cu.to(device, torch.int32), cu.to(device), cu, max(lengths))
    gen = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(int(cu[-1]), heads, dim, generator=gen).to(device, dtype)
    if pasts:   # each sample's keys: its past's (5, 0 and 64 tokens), then its own
        keys = torch.tensor([0, 6, 76, 270], dtype=torch.int64)
        rows = Rows(rows.cu32, rows.cu64, rows.cu_host, rows.max_len,
                    past=types.SimpleNamespace(cu_k32=keys.to(device, torch.int32), max_k=194))
    k, v = (torch.randn(int(keys[-1] if pasts else cu[-1]), kv, dim, generator=gen).to(device, dtype)
            for _ in range(2))
    what = "varlen attention" + (" with pasts" if pasts else "")
    try:
        got = kernel_set.varlen_attention(q, k, v, rows, dim ** -0.5).float()
    except Exception as exc:   # a self-check: whatever it raises turns the path off, it never stops the worker
        return f"{what} failed its check on the device: {type(exc).__name__}: {(str(exc) or '?').splitlines()[0]}"
    want = sdpa_varlen_attention(q, k, v, rows, dim ** -0.5).float()
    rel = float((got - want).norm() / want.norm())
    return "" if rel < 2e-2 else f"{what} differs from SDPA on the device (rel L2 {rel:.1e})"


def _recording_past(cache, layer_idx: int) -> bool:
    """The cache keeps the layer's whole past (speculative decoding's rollback): transformers' ``is_recording_past``,
    or, in a transformers without it (5.17), the layer's ``record_past``."""
    says = getattr(cache, "is_recording_past", None)
    return says(layer_idx) if says is not None else bool(getattr(cache.layers[layer_idx], "record_past", False))


def _recurrent_state(cache, layer_idx: int):
    """The layer's cached recurrent state, None before its first call: transformers' ``get_recurrent_state``, or, in
    a transformers without it (5.17), ``has_previous_state`` then the layer's ``recurrent_states[0]``."""
    get = getattr(cache, "get_recurrent_state", None)
    if get is not None:
        return get(layer_idx)
    return cache.layers[layer_idx].recurrent_states[0] if cache.has_previous_state(layer_idx, state_idx=0) else None


# ---- installing ---------------------------------------------------------------------------------------------------

def _bind(module, forward, kernels: KernelSet) -> None:
    if hasattr(module, "_hsx_eager"):   # installed before: start again from transformers' forward
        _unbind(module)
    module._hsx_own_forward = vars(module).get("forward")   # an instance's own forward (transformers' hub kernels)
    module._hsx_eager = module.forward
    module._hsx_kernels = kernels
    module.forward = types.MethodType(forward, module)


def _install_norm(norm, kernels: KernelSet) -> None:
    weight = norm.weight.detach().float()
    norm._hsx_weight = weight + 1.0 if type(norm).__name__ in ZERO_CENTRED_NORMS else weight
    norm._hsx_eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6))
    _bind(norm, _norm_forward, kernels)


def install(layers: torch.nn.Module, kernels: KernelSet) -> dict[str, int]:
    """Replace the forward of every module under ``layers`` that the tables name; how many of each kind."""
    counts = {"norm": 0, "layer": 0, "mlp": 0, "gated_deltanet": 0}
    for module in layers.modules():
        kind = type(module).__name__
        if kind in ZERO_CENTRED_NORMS or kind in PLAIN_NORMS:
            _install_norm(module, kernels)
            counts["norm"] += 1
        elif kind in GATED_MLPS:
            _bind(module, _mlp_forward, kernels)
            counts["mlp"] += 1
        elif kind in GATED_DELTANETS and all(hasattr(module, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                           "in_proj_a")):
            module._hsx_conv_weight = module.conv1d.weight.detach().squeeze(1)
            _bind(module, _gdn_forward, kernels)
            counts["gated_deltanet"] += 1
    for module in layers.modules():  # after the norms: the layer reads their fp32 weights
        post = getattr(module, "post_attention_layernorm", None)
        if type(module).__name__ in DECODER_LAYERS and hasattr(post, "_hsx_weight"):
            _bind(module, _layer_forward, kernels)
            counts["layer"] += 1
    return counts


def _unbind(module) -> None:
    if module._hsx_own_forward is not None:
        module.forward = module._hsx_own_forward
    else:
        del module.forward
    del module._hsx_eager, module._hsx_own_forward


def uninstall(layers: torch.nn.Module) -> None:
    """Give every replaced module its transformers forward back."""
    for module in layers.modules():
        if hasattr(module, "_hsx_eager"):
            _unbind(module)
        for name in ("_hsx_kernels", "_hsx_weight", "_hsx_eps", "_hsx_conv_weight"):
            if hasattr(module, name):
                delattr(module, name)


def choose(mode: str, device: torch.device) -> tuple[KernelSet | None, str]:
    """The kernel set to install for ``mode`` on ``device`` (None: transformers' forward) and why, in words."""
    if mode not in KERNELS:
        raise ValueError(f"--kernels {mode!r}: expected one of {', '.join(KERNELS)}")
    if mode == "eager":
        return None, "transformers' eager forward (--kernels eager)"
    if torch.device(device).type != "cuda":
        return None, f"transformers' eager forward (fused kernels need CUDA; the device is {device})"
    try:
        return fla_kernels(), ""
    except (ImportError, TypeError, AttributeError, importlib.metadata.PackageNotFoundError) as exc:
        return None, f"transformers' eager forward (fla's fused kernels unavailable: {exc})"


def describe(kernels: KernelSet | None, counts: dict[str, int], why: str, packing: str = "") -> str:
    """The start line's words for what the forward runs; ``packing``: how a plain batch's rows are laid out."""
    if kernels is None or not any(counts.values()):
        return why or "transformers' eager forward (no module of this model has a fused kernel here)"
    parts = []
    if counts["gated_deltanet"]:
        parts.append(f"GDN: {kernels.name} conv + in-kernel gating + gated norm ({counts['gated_deltanet']} layers)")
    if counts["norm"]:
        parts.append(f"RMSNorm: {kernels.name}, residual add fused ({counts['layer']} layers)")
    if counts["mlp"]:
        parts.append(f"SwiGLU: {kernels.name}")
    if packing:
        parts.append(packing)
    return "; ".join(parts)


@dataclass(frozen=True)
class Prepared:
    """What ``prepare`` installed: the start line's words, the kernel set (None: transformers' forward) and
    whether a plain batch runs as one packed row."""

    line: str
    kernels: KernelSet | None
    packs: bool
    continues: bool = False   # packed samples may continue cached states (prefix reuse's rows going on)


def prepare(decoder: torch.nn.Module, mode: str, device) -> Prepared:
    """Install the fused forwards ``mode`` allows on ``device`` under ``decoder.layers`` and decide whether plain
    batches run packed (``mode`` auto, where ``packing_ready``); log and return what was done."""
    kernels, why = choose(mode, device)
    counts = install(decoder.layers, kernels) if kernels is not None else {}
    packs, continues, packing = False, False, ""
    if kernels is not None and any(counts.values()):
        if mode == "padded":
            packing = "rows padded (--kernels padded)"
        else:
            packs, no = packing_ready(decoder, kernels, device)
            packing = (f"rows packed where a batch pads > {PACK_MIN_PADDING:.0%} (varlen attention: "
                       f"{kernels.varlen_attention.__name__}; GDN: {kernels.name} varlen)" if packs
                       else f"rows padded ({no})")
        if packs:
            continues, no = continuation_ready(decoder, kernels, device)
            packing += ("; shared prefixes' trees in packed waves" if continues
                        else f"; shared prefixes' rows going on padded ({no})")
    text = describe(kernels, counts, why, packing)
    log.info("forward kernels: %s", text)
    return Prepared(text, kernels, packs, continues)
