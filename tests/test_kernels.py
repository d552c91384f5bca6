"""gpu_worker/kernels.py on the CPU: the glue around the fused kernels, the dispatch and the fallback.

Triton's kernels need a GPU, so here the glue runs with ``reference_kernels`` (the fused operations written in
torch) and must give transformers' own forward on the shapes a batch has: right padding, a sample of length 1,
samples ending mid-chunk. The fla kernels themselves are compared with the code they replace on the GPU by
bench/forward_profile.py (docs/benchmarks.md). The fallback must be exactly today's path.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from gpu_worker import kernels
from gpu_worker.extractor import Extractor, PackedBatch, PaddedBatch, _decoder, pad_batch

LENGTHS = [1, 5, 17, 40]   # padded to 40; the reference chunk rule works in chunks of 64 (a sample ends mid-chunk)


def _tiny_hybrid(dtype=torch.float32):
    import transformers

    if not hasattr(transformers, "Qwen3_5TextConfig"):
        pytest.skip("this transformers has no Qwen3.5")
    config = transformers.Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                            linear_num_key_heads=2, linear_num_value_heads=4,  # grouped value heads
                                            linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    model = AutoModel.from_config(config, dtype=dtype).eval()
    with torch.no_grad():  # zero-centred norms start at 0 (weight 1): make them differ, so (1 + w) is tested
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def _counting(kernel_set: kernels.KernelSet, calls: dict) -> kernels.KernelSet:
    def count(name, fn):
        def wrapped(*a, **kw):
            calls[name] = calls.get(name, 0) + 1
            return fn(*a, **kw)
        return wrapped

    fields = ("rms_norm", "rms_norm_gated", "swiglu", "causal_conv1d", "gated_delta_rule")
    return kernels.KernelSet(kernel_set.name, *(count(f, getattr(kernel_set, f)) for f in fields))


def _reference(model) -> kernels.KernelSet:
    return kernels.reference_for(model)


def _padded_ids(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (len(LENGTHS), max(LENGTHS)), generator=gen)
    real = torch.arange(max(LENGTHS)).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    return ids, real


@pytest.mark.parametrize("kind", ["qwen3.5 hybrid", "qwen3"])
def test_the_fused_glue_gives_transformers_forward_on_padded_batches(kind, tiny_model):
    model = _tiny_hybrid() if kind == "qwen3.5 hybrid" else AutoModel.from_pretrained(str(tiny_model),
                                                                                       dtype=torch.float32).eval()
    decoder = _decoder(model)
    ids, real = _padded_ids(200)
    with torch.inference_mode():
        want = decoder(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
        calls: dict = {}
        counts = kernels.install(decoder, _counting(_reference(model), calls))
        got = decoder(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
    n_layers = len(decoder.layers)
    hybrid = kind == "qwen3.5 hybrid"
    assert counts == {"norm": 2 * n_layers + 1 + (2 * n_layers // 4 if hybrid else 2 * n_layers), "layer": n_layers,
                      "mlp": n_layers, "gated_deltanet": 3 * n_layers // 4 if hybrid else 0}
    # every fused operation ran (no silent fallback to the eager forward)
    assert calls["rms_norm"] >= 2 * n_layers + 1 and calls["swiglu"] == n_layers
    if hybrid:
        assert calls["causal_conv1d"] == calls["gated_delta_rule"] == calls["rms_norm_gated"] == 3
    for layer, (w, g) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(g[real], w[real], rtol=2e-5, atol=2e-5, msg=f"hidden state {layer}")


def test_reference_kernels_round_once_in_bf16_and_stay_close():
    model = _tiny_hybrid(torch.bfloat16)
    decoder = _decoder(model)
    ids, real = _padded_ids(200)
    with torch.inference_mode():
        want = decoder(input_ids=ids, use_cache=False).last_hidden_state
        kernels.install(decoder, _reference(model))
        got = decoder(input_ids=ids, use_cache=False).last_hidden_state
    rel = float((got[real].float() - want[real].float()).norm() / want[real].float().norm())
    assert 0 < rel < 2e-2, rel   # bf16 rounding between steps differs, the formula does not


def test_small_row_norms_see_few_row_counts_and_give_the_unpadded_rows():
    """fla's norms of rows of <= 512 features compile again for every cdiv(rows, block): the q norm of the 27B
    (tokens x 24 rows) would see ~380 values up to 32k-token batches. few_row_counts pads to few values and
    returns exactly the unpadded op's rows (a row-wise op; the reference norms stand in for fla's)."""
    counts = {kernels.bucketed_blocks(b) for b in range(1, 32768 * 24 // kernels.NORM_ROWS_BLOCK + 2)}
    assert len(counts) <= 40, len(counts)
    for b in range(1, 2000):
        got = kernels.bucketed_blocks(b)
        assert b <= got <= max(8, 1.25 * b) and kernels.bucketed_blocks(got) == got
    reference = _reference(_tiny_hybrid())
    seen = []

    def norm(x, weight, eps):
        seen.append(x.numel() // x.shape[-1])
        return reference.rms_norm(x, weight, None, eps)

    def gated(x, gate, weight, eps):
        seen.append(x.shape[0])
        assert gate.shape == x.shape
        return reference.rms_norm_gated(x, gate, weight, eps)

    block, weight = 4, torch.rand(16) + 0.5
    for rows in (1, 3, 4, 5, 33, 37, 41, 64, 100):
        x = torch.randn(rows, 2, 16)            # [tokens, heads, head_dim], as the q norm's input
        seen.clear()
        got = kernels.few_row_counts(norm, block)(x, weight, 1e-6)
        want = reference.rms_norm(x, weight, None, 1e-6)
        assert got.shape == x.shape and torch.equal(got, want), rows
        blocks = -(-seen[0] // block)
        assert blocks == kernels.bucketed_blocks(-(-2 * rows // block)) and seen[0] < blocks * block + 1
        z = torch.randn(rows * 2, 16)
        got = kernels.few_row_counts(gated, block)(x.reshape(-1, 16), z, weight, 1e-6)
        assert torch.equal(got, reference.rms_norm_gated(x.reshape(-1, 16), z, weight, 1e-6))


def test_flas_kernel_set_pads_the_small_norms_and_only_them(monkeypatch):
    """fla_kernels() wires few_row_counts in: the q/k norms (rows of <= 512, no residual) and the gated GDN norm
    reach fla with bucketed row counts; the hidden-size norms and the residual-fused one reach it as they are.
    fla's modules are stand-ins recording the shapes they get (Triton cannot run here)."""
    import types

    seen = []

    def rms_norm(x, weight, bias, residual=None, eps=1e-6, prenorm=False):
        seen.append(("norm", x.numel() // x.shape[-1], residual is not None))
        return x if residual is None else (x, x)

    def rms_norm_gated(x, gate, weight, bias, activation=None, eps=1e-6):
        assert gate.shape == x.shape
        seen.append(("gated", x.shape[0], False))
        return x

    varlen = []   # the bounds fla's varlen conv and chunk rule get

    def causal_conv1d(x, **kwargs):
        varlen.append(kwargs)
        return x, None

    def chunk_gated_delta_rule(q, k, v, **kwargs):
        varlen.append(kwargs)
        return v, None

    parts = {"fla.modules.activations": {"swiglu": None}, "fla.modules.causal_conv1d": {"causal_conv1d": causal_conv1d},
             "fla.modules.norm.fused_norm_gate": {"rms_norm_gated": rms_norm_gated},
             "fla.modules.norm.layernorm": {"rms_norm": rms_norm},
             "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
             "fla.ops.utils.index": {"prepare_chunk_indices": _chunk_table_by_loop}}
    for name in ("fla", "fla.modules", "fla.modules.norm", "fla.ops", "fla.ops.utils", *parts):
        module = types.ModuleType(name)
        module.__dict__.update(parts.get(name, {}))
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: "0.6.0")
    fla = kernels.fla_kernels()
    q = torch.randn(1800, 24, 64)          # 43,200 rows: 22 blocks of 2048 -> 24 (bucketed)
    got = fla.rms_norm(q, torch.ones(64), None, 1e-6)
    assert got.shape == q.shape and torch.equal(got, q)
    assert seen[-1] == ("norm", 23 * kernels.NORM_ROWS_BLOCK + 1, False)
    hidden = torch.randn(1700, 640)        # wider than 512: fla's row kernel, no NB
    fla.rms_norm(hidden, torch.ones(640), None, 1e-6)
    fla.rms_norm(q, torch.ones(64), q, 1e-6)
    assert seen[-2:] == [("norm", 1700, False), ("norm", 1800 * 24, True)]
    rows = 9 * kernels.GATED_NORM_ROWS_BLOCK + 5   # 10 blocks -> 10: no padding
    fla.rms_norm_gated(torch.randn(rows, 4), torch.randn(rows, 4), torch.ones(4), 1e-6)
    assert seen[-1] == ("gated", rows, False)
    rows = 8 * kernels.GATED_NORM_ROWS_BLOCK + 5   # 9 blocks -> 10
    fla.rms_norm_gated(torch.randn(rows, 4), torch.randn(rows, 4), torch.ones(4), 1e-6)
    assert seen[-1] == ("gated", 9 * kernels.GATED_NORM_ROWS_BLOCK + 1, False)
    # packed samples: the conv and the chunk rule get the samples' bounds and hsx's chunk table (one a forward)
    cu = torch.tensor([0, 1, 70, 200])
    rows_ = kernels.Rows(cu.to(torch.int32), cu, cu, 130)
    x = torch.randn(1, 200, 8)
    fla.causal_conv1d(x, torch.ones(8, 4), None, "silu", rows=rows_)
    fla.gated_delta_rule(x, x, x, x, x, None, None, rows=rows_)
    assert [call["cu_seqlens_cpu"] is cu and call["chunk_indices"] is rows_.chunk_indices() for call in varlen] == [
        True, True]
    assert torch.equal(varlen[0]["chunk_indices"], _chunk_table_by_loop(cu, 64))


def test_uninstall_restores_transformers_forward_exactly():
    model = _tiny_hybrid()
    decoder = _decoder(model)
    ids, _ = _padded_ids(200)
    with torch.inference_mode():
        want = decoder(input_ids=ids, use_cache=False).last_hidden_state
        kernels.install(decoder, _reference(model))
        kernels.install(decoder, _reference(model))   # twice: still one layer deep
        kernels.uninstall(decoder)
        got = decoder(input_ids=ids, use_cache=False).last_hidden_state
    assert torch.equal(got, want)
    assert not any(hasattr(m, "_hsx_eager") or "forward" in vars(m) for m in decoder.modules())


def test_a_cached_or_masked_call_takes_the_eager_forward():
    model = _tiny_hybrid()
    decoder = _decoder(model)
    calls: dict = {}
    kernels.install(decoder, _counting(_reference(model), calls))
    gdn = next(m for m in decoder.modules() if type(m).__name__ in kernels.GATED_DELTANETS)
    x = torch.randn(2, 7, 64)
    mask = torch.ones(2, 7, dtype=torch.bool)
    with torch.inference_mode():
        got = gdn(x, attention_mask=mask)
        want = gdn._hsx_eager(x, attention_mask=mask)
    assert torch.equal(got, want) and "causal_conv1d" not in calls


def test_on_the_cpu_the_worker_runs_transformers_forward_and_says_why(tiny_model):
    model = AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32)
    ex = Extractor(model, [1, 3], store_final=False, out_dtype="float32")
    assert "fused kernels need CUDA; the device is cpu" in ex.kernels_line
    assert not any(hasattr(m, "_hsx_eager") for m in model.modules())
    eager = Extractor(AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32), [1, 3], store_final=False,
                      out_dtype="float32", kernels="eager")
    assert eager.kernels_line == "transformers' eager forward (--kernels eager)"
    batch = pad_batch(torch.arange(10), torch.tensor([0, 4, 10]), 8, 0, pin=False)
    assert torch.equal(ex.run(batch)[0], eager.run(batch)[0])


def test_without_fla_a_gpu_falls_back_and_names_what_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)   # import fla -> ImportError
    kernel_set, why = kernels.choose("auto", torch.device("cuda:0"))
    assert kernel_set is None and "fla's fused kernels unavailable" in why
    with pytest.raises(ValueError, match="--kernels 'fast'"):
        kernels.choose("fast", torch.device("cpu"))


def test_describe_names_the_kernels_run():
    ks = kernels.reference_kernels(None)
    line = kernels.describe(ks, {"norm": 129, "layer": 64, "mlp": 64, "gated_deltanet": 48}, "")
    assert line.startswith("GDN: reference (torch) conv + in-kernel gating + gated norm (48 layers)")
    assert "RMSNorm: reference (torch), residual add fused (64 layers)" in line and "SwiGLU" in line
    assert kernels.describe(ks, {"norm": 0, "layer": 0, "mlp": 0, "gated_deltanet": 0}, "").startswith("transformers'")


def test_an_fla_older_than_the_in_kernel_gate_is_refused_not_trusted(monkeypatch):
    """fla-core < 0.6 takes ``use_gate_in_kernel`` into **kwargs and ignores it: it must not be used at all."""
    monkeypatch.setattr(kernels.importlib.metadata, "version", lambda name: "0.5.2")
    kernel_set, why = kernels.choose("auto", torch.device("cuda:0"))
    assert kernel_set is None and "fla-core 0.5.2 is older than 0.6" in why


# ---- packed rows: a plain batch's samples as one row, each seen alone ---------------------------------------------

PACKED_LENGTHS = [1, 5, 17, 70, 130]   # a sample of length 1; 70 and 130 end mid-chunk of the reference rule's 64


def _packed_pair(monkeypatch, kind, tiny_model, kernel_set=None):
    """(an Extractor packing with the reference kernels, one running transformers' forward on padded rows), on
    two copies of one model; ``kernel_set`` replaces the reference set (a negative test's broken kernels)."""
    def build():
        if kind == "qwen3.5 hybrid":
            return _tiny_hybrid()
        return AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32, attn_implementation="sdpa").eval()

    lone = Extractor(build(), [0, 1, 2], store_final=True, out_dtype="float32", kernels="eager")
    assert lone.kernel_set is None and not lone.packs
    model = build()
    chosen = kernel_set(model) if kernel_set else _reference(model)
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (chosen, ""))
    packed = Extractor(model, [0, 1, 2], store_final=True, out_dtype="float32")
    return packed, lone


def _batch(vocab: int):
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    return torch.randint(0, vocab, (int(cu[-1]),), generator=gen), cu


@pytest.mark.parametrize("kind", ["qwen3.5 hybrid", "qwen3"])
def test_a_packed_batch_stores_what_each_sample_alone_gives(kind, tiny_model, monkeypatch):
    """Packed rows (positions restarting per sample, varlen conv, delta rule and attention) against transformers'
    forward of the same samples right-padded: every stored layer and the final state of every sample."""
    packed, lone = _packed_pair(monkeypatch, kind, tiny_model)
    assert packed.packs and "rows packed where a batch pads > 3% (varlen attention: sdpa_varlen_attention" in packed.kernels_line
    ids, cu = _batch(200)
    batch = packed.batch(ids, cu, 136, 0, pin=False)
    assert isinstance(batch, PackedBatch) and batch.input_ids.shape == (1, int(cu[-1])) and batch.max_len == 130
    assert batch.positions[0, cu[3]:cu[4]].tolist() == list(range(70))
    got, got_final = packed.run(batch)
    want, want_final = lone.run(lone.batch(ids, cu, 136, 0, pin=False))
    # a batch padded by at most 3 % of its real tokens runs padded (packed rows cost more a token: defaults.py)
    three = torch.tensor([0, 40, 80, 119])
    assert isinstance(packed.batch(torch.arange(119), three, 40, 0, pin=False), PaddedBatch)       # 0.8 %
    assert isinstance(packed.batch(torch.arange(119), three, 48, 0, pin=False), PackedBatch)       # 21 %
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(got_final, want_final, rtol=2e-5, atol=2e-5)


def _leaky_attention(model):
    """Reference kernels whose attention runs over the whole packed row: samples see the ones before them."""
    ref = _reference(model)

    def attention(q, k, v, rows, scale):
        one = kernels.Rows(rows.cu32[[0, -1]], rows.cu64[[0, -1]], rows.cu_host[[0, -1]], int(rows.cu_host[-1]))
        return ref.varlen_attention(q, k, v, one, scale)
    return kernels.KernelSet(ref.name, ref.rms_norm, ref.rms_norm_gated, ref.swiglu, ref.causal_conv1d,
                             ref.gated_delta_rule, attention)


def _leaky_conv(model):
    """Reference kernels whose Gated DeltaNet convolution ignores the samples' bounds."""
    ref = _reference(model)
    return kernels.KernelSet(ref.name, ref.rms_norm, ref.rms_norm_gated, ref.swiglu,
                             lambda x, w, b, act, rows=None: ref.causal_conv1d(x, w, b, act),
                             ref.gated_delta_rule, ref.varlen_attention)


@pytest.mark.parametrize("broken", [_leaky_attention, _leaky_conv])
def test_the_packed_parity_test_fails_when_a_sample_sees_another(broken, tiny_model, monkeypatch):
    packed, lone = _packed_pair(monkeypatch, "qwen3.5 hybrid", tiny_model, broken)
    ids, cu = _batch(200)
    got = torch.cat(packed.run(packed.batch(ids, cu, 136, 0, pin=False)), dim=1)   # layers 0-2 and the final state
    want = torch.cat(lone.run(lone.batch(ids, cu, 136, 0, pin=False)), dim=1)
    first = slice(0, int(cu[1]))   # the first sample sees nothing before it either way
    torch.testing.assert_close(got[first], want[first], rtol=2e-5, atol=2e-5)
    assert float((got - want).abs().max()) > 1e-2


def test_a_packed_forward_whose_attention_was_not_routed_is_refused(tiny_model, monkeypatch):
    """A mixer of a class the router does not know would run as one sequence: the forward is refused, not stored."""
    packed, _ = _packed_pair(monkeypatch, "qwen3.5 hybrid", tiny_model)
    ids, cu = _batch(200)
    monkeypatch.setattr(kernels, "ATTENTIONS", set())
    with pytest.raises(RuntimeError, match="0 of 1 attention and 3 of 3 Gated DeltaNet layers"):
        packed.run(packed.batch(ids, cu, 136, 0, pin=False))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping   # the router is gone after the forward


def test_packing_is_off_where_it_would_not_be_exact(tiny_model, monkeypatch):
    hybrid = _tiny_hybrid()
    ref = _reference(hybrid)
    decoder = _decoder(hybrid)
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (ref, ""))
    assert kernels.prepare(decoder, "auto", "cpu").packs
    padded = kernels.prepare(decoder, "padded", "cpu")
    assert not padded.packs and padded.line.endswith("rows padded (--kernels padded)")
    no_varlen = kernels.KernelSet(*(getattr(ref, f) for f in ("name", "rms_norm", "rms_norm_gated", "swiglu",
                                                               "causal_conv1d", "gated_delta_rule")))
    kernels.uninstall(decoder.layers)
    kernels.install(decoder.layers, no_varlen)
    assert kernels.packing_ready(decoder, no_varlen, "cpu") == (False, "no varlen attention kernel here")
    kernels.uninstall(decoder.layers)
    kernels.install(decoder.layers, ref)
    gdn = next(m for m in decoder.modules() if type(m).__name__ in kernels.GATED_DELTANETS)
    kernels._unbind(gdn)
    ok, why = kernels.packing_ready(decoder, ref, "cpu")
    assert not ok and why == "1 Gated DeltaNet layers run transformers' forward (no varlen conv there)"
    eager_attention = AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32, attn_implementation="eager")
    dense = _decoder(eager_attention)
    kernels.install(dense.layers, ref)
    assert kernels.packing_ready(dense, ref, "cpu") == (
        False, "attention implementation 'eager' (packed rows route sdpa's)")
    monkeypatch.undo()   # transformers' own choice again: the CPU has no fused kernels, so rows stay padded
    on_cpu = Extractor(AutoModel.from_pretrained(str(tiny_model), dtype=torch.float32), [1], store_final=False,
                       out_dtype="float32")
    assert not on_cpu.packs and isinstance(on_cpu.batch(torch.arange(4), torch.tensor([0, 4]), 8, 0, False),
                                           PaddedBatch)


def test_rows_going_on_stay_padded_where_the_varlen_kernel_with_pasts_fails_its_check(monkeypatch):
    """Plain packing and packed continuation are checked apart: a kernel that fails with pasts (say, a causal
    mask aligned to the start of the keys) leaves plain batches packed and prefix reuse's rows going on padded."""
    hybrid = _tiny_hybrid()
    reference = _reference(hybrid)
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (reference, ""))
    monkeypatch.setattr(kernels, "continuation_ready",
                        lambda decoder, kernel_set, device: (False, "varlen attention with pasts differs"))
    ex = Extractor(hybrid, [0, 1], store_final=False, out_dtype="float32")
    assert ex.packs and not ex.continues
    assert ex.kernels_line.endswith("; shared prefixes' rows going on padded (varlen attention with pasts differs)")
    # a tree batch then continues its leaves padded (the merged cache), and packs only its rows computed alone
    from gpu_worker import prefixrun

    calls, merged = [], []
    real_packed, real_merged = prefixrun._run_rows_packed, prefixrun._merged_cache
    monkeypatch.setattr(prefixrun, "_run_rows_packed", lambda *a: calls.append(a[4]) or real_packed(*a))
    monkeypatch.setattr(prefixrun, "_merged_cache", lambda *a: merged.append(1) or real_merged(*a))
    gen = torch.Generator().manual_seed(7)
    spine = torch.randint(0, 200, (40,), generator=gen)
    rows = [torch.cat([spine, torch.randint(0, 200, (n,), generator=gen)]) for n in (5, 9)]
    rows.append(torch.randint(0, 200, (30,), generator=gen))   # alone
    cu = torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()])
    ex.run_shared(torch.cat(rows), cu, [[0, 2, 40]], 4096)
    assert calls == [None] and merged   # the packed call is the alone row's (no caches); the leaves went padded
    monkeypatch.undo()
    monkeypatch.setattr(kernels, "choose", lambda mode, device: (reference, ""))
    ex = Extractor(_tiny_hybrid(), [0, 1], store_final=False, out_dtype="float32")
    assert ex.packs and ex.continues and ex.kernels_line.endswith("; shared prefixes' trees in packed waves")


def test_the_start_check_catches_a_start_aligned_causal_mask_and_a_kernel_that_raises():
    """The device check of the varlen kernel (run on the CPU here): the reference passes plain and with pasts; a
    kernel whose causal mask is aligned to the start of the keys (torch SDPA's is_causal for q shorter than k)
    passes plain rows and fails with pasts; a kernel that raises turns the path off with its words."""
    model = _tiny_hybrid(torch.bfloat16)
    reference = _reference(model)
    attention = next(m for m in model.modules() if type(m).__name__ in kernels.ATTENTIONS)
    for pasts in (False, True):
        assert kernels._check_varlen_attention(reference, attention, "cpu", pasts=pasts) == ""

    def start_aligned(q, k, v, rows, scale):
        keys = rows.cu_host.tolist() if rows.past is None else rows.past.cu_k32.tolist()
        bounds, group, out = rows.cu_host.tolist(), q.shape[1] // k.shape[1], torch.empty_like(q)
        for i in range(len(bounds) - 1):
            qs = q[bounds[i]:bounds[i + 1]].transpose(0, 1)
            ks, vs = (t[keys[i]:keys[i + 1]].transpose(0, 1).repeat_interleave(group, 0) for t in (k, v))
            out[bounds[i]:bounds[i + 1]] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                          scale=scale).transpose(0, 1)
        return out

    wrong = dataclasses.replace(reference, varlen_attention=start_aligned)
    assert kernels._check_varlen_attention(wrong, attention, "cpu", pasts=False) == ""
    assert kernels._check_varlen_attention(wrong, attention, "cpu", pasts=True).startswith(
        "varlen attention with pasts differs from SDPA on the device (rel L2")

    def raises(*args):
        raise ValueError("no kernel image for this device")

    broken = dataclasses.replace(reference, varlen_attention=raises)
    assert kernels._check_varlen_attention(broken, attention, "cpu", pasts=False) == (
        "varlen attention failed its check on the device: ValueError: no kernel image for this device")


def _chunk_table_by_loop(cu_seqlens: torch.Tensor, chunk: int) -> torch.Tensor:
    """fla's varlen chunk table as its docs define it: for each sample, for each of its ceil(len / chunk) chunks,
    (sample, chunk's index in the sample)."""
    bounds = cu_seqlens.tolist()
    return torch.tensor([(n, j) for n in range(len(bounds) - 1)
                         for j in range(-(-(bounds[n + 1] - bounds[n]) // chunk))], dtype=torch.int64)


def test_the_chunk_table_hsx_hands_fla_is_fla_s_own_and_a_different_one_is_not_used():
    """hsx builds fla's varlen chunk table itself (pinned, no host wait) for the conv and the chunk rule; it is
    used only where it equals fla's own (checked when the kernels load), so a fla that builds it otherwise, or
    fails to, gets its own table back."""
    cu = torch.tensor([0, 1, 65, 129, 130, 2178], dtype=torch.int64)   # 1, 64, 64, 1 and 2,048 tokens
    rows = kernels.Rows(cu.to(torch.int32), cu, cu, 2048)
    assert torch.equal(rows.chunk_indices(), _chunk_table_by_loop(cu, kernels.FLA_CHUNK))
    assert rows.chunk_indices() is rows.chunk_indices()   # built once a forward
    assert kernels.same_chunk_table(_chunk_table_by_loop)
    assert not kernels.same_chunk_table(lambda cu_, chunk: _chunk_table_by_loop(cu_, chunk // 2))
    assert not kernels.same_chunk_table(lambda cu_, chunk: 1 / 0)
