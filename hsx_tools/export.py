"""`hsx export`: write a completed run one file per sample, in the layout a drafter trainer reads.

Sample ``i`` is line ``i`` of the run's index (its position); file names use
it, so exports of different ``--shard``s into one directory fit together.
Files are written to a temp name and renamed, so an existing file is complete
and a re-run skips it (resume). Checked against:

The layout and key names follow the trainer (``--for``), not the run's layer preset; a run that lacks what
the trainer needs (the final hidden state) is refused with the layer it is missing. Checked against the
released specforge 0.2.0 and speculators 0.9.0 + hs-connectors 0.9.0 by tests/test_peers.py, which loads
every export with the peers' own code (scripts/peers.sh makes their venvs) and trains a few steps on it.

- SpecForge (``specforge-eagle3|dflash|dspark``): ``OUT/rows_{g}-{g+2000}/data_{i}.ckpt``,
  g = (i // 2000) * 2000, every number zero-padded to 9 digits (SpecForge lists its files sorted as text,
  so the export trains in the run's order only when text order is number order), one ``torch.save``d dict
  each, the record its offline readers ask for (hsx_tools/specforgerecord.py, the one definition, which
  hsx_peers.specforge serves in place too). Beside the files,
  ``OUT/draft_config.json``: the draft model config SpecForge trains with (hsx_tools.draftconfig: the target's
  sizes, the run's layer ids where SpecForge reads them), and the printed ``specforge train`` line that uses it.
- speculators (``speculators-eagle3|dflash``; both read the same files): ``OUT/hs_{i}.safetensors`` with
  ``hidden_states`` [T, n+1, H] (run dtype) and ``token_ids`` [T] int64 (plus ``loss_mask`` [T] int64, which
  speculators ignores); the rows ``input_ids``, ``loss_mask``, ``seq_len`` in ``OUT/dataset.jsonl`` and, where
  the ``datasets`` package is installed, as an Arrow dataset in torch format (as speculators' own prepare step
  saves it) in ``OUT/dataset``; ``OUT/dataset/token_freq.pt`` {token id: count over loss-masked tokens}
  (speculators' ``save_token_frequency_distribution``, where its train step looks by default), from which
  ``--draft-vocab-size`` picks the draft vocabulary.
  Speculators layer id = hsx layer id + 1. Its last slot must be the final decoder layer's output BEFORE the
  final norm (speculators applies ``verifier_norm`` itself); hsx stores it after the norm, and the norm drops
  each token's scale, so the exact pre-norm tensor cannot be recovered. The export writes
  ``final / g`` instead, g = the target's final-norm gain (read from the model in the manifest): the unit-RMS
  direction of the pre-norm state, which the target's own norm maps back to the stored final state to within
  a relative eps / (2 * mean(x^2)) (< 1e-6 for a real model's last layer; below bf16 precision). Its
  per-token magnitude is not the true one; speculators only reads the slot through its norm.

Store dtypes: a run stored as FP8 (``--store-dtype float8_e4m3``) is exported to speculators in the layout
hs-connectors' ``fp8`` backend reads (``--hidden-states-backend fp8``; ``hs_connectors.fp8_utils``):
``hidden_states`` float8_e4m3fn [T, n+1, H] with ``hidden_states_scales`` float32 [T, n+1, 1]: its reader
multiplies codes by scales by broadcasting, so hsx's own per-token per-layer scales fit, and the run's layers
are exported as stored (codes and scales unchanged, no second rounding). Only the last slot, ``final / g``,
is quantised again (on its own, one scale per token), since dividing by the gain changes its codes; where
the gain is all ones its stored codes are kept too. SpecForge has no FP8 layout: its export dequantises to the run's dtype and says so (log
line and ``hsx_export.json``). Compressed runs (``--codec zstd``) are decompressed on read; exports are never
compressed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from hsx.batch import FP8, MAX_HEADER, decode_tensor, parse_header, quantise_fp8
from hsx.errors import ConfigError
from hsx.layers import TARGETS, refusal
from hsx.monitor import Progress
from hsx.store import StoreSettings
from hsx_reader.run import ReaderError, RunIndex, SampleRef
from hsx_reader.source import Source, sample_of
from hsx_tools.specforgerecord import specforge_record

log = logging.getLogger(__name__)
SPECFORGE_GROUP = 2000  # samples a SpecForge rows_* folder
SPECFORGE_DIGITS = 9    # zero-padded width of the numbers in SpecForge file names (text order = number order)
PROGRESS_SECONDS = 10.0   # seconds between progress lines in a log (a bar on a terminal: hsx/monitor/progressline.py)


@dataclass(frozen=True)
class ExportConfig:
    run: str
    format: str                      # a TARGETS key (the trainer and algorithm)
    out: Path
    store: StoreSettings | None      # None: the store the run recorded in Redis (needs redis_url)
    redis_url: str | None = None
    limit: int | None = None         # samples at most
    shards: tuple[str, ...] = ()     # only these store shards


def run_store(cfg: ExportConfig) -> StoreSettings:
    """The given store, else the one the run recorded in Redis."""
    if cfg.store is not None:
        return cfg.store
    manifest = r = None
    if cfg.redis_url:
        from hsx import life
        from hsx.redisconn import RedisUnreachable, connect

        try:
            r = connect(cfg.redis_url, retries=1, wait_seconds=2)
            manifest = life.Run(r, cfg.run).manifest()
        except RedisUnreachable as exc:
            log.warning("%s; pass --store", exc)
    if manifest is None and r is not None:
        raise ConfigError(f"no store for run {cfg.run!r}: this Redis does not hold it (runs here: "
                          f"{', '.join(life.Run.names(r)) or 'none'}); check --run / HSX_RUN and HSX_REDIS_URL, "
                          "or pass --store")
    if manifest is None:
        raise ConfigError(f"no store for run {cfg.run!r}: pass --store (no Redis to ask)")
    return manifest.store


def final_norm_gain(model: str, hidden_size: int) -> torch.Tensor:
    """The per-channel gain g of the target's final RMSNorm (norm(x) = x / rms(x) * g), float32 [H].

    Built with the model's own norm class (so ``w`` and ``1 + w`` parametrisations both come out right),
    from the one weight tensor in the checkpoint; the body is instantiated on the meta device only.
    """
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModel
    from transformers.utils import cached_file

    with torch.device("meta"):
        body = AutoModel.from_config(AutoConfig.from_pretrained(model))
    norm = getattr(body, "norm", None) or body.get_decoder().norm
    name = next(n for n, m in body.named_modules() if m is norm) + ".weight"
    index = cached_file(model, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    weight_map = json.loads(Path(index).read_text())["weight_map"] if index else None
    keys = list(weight_map) if weight_map else None
    if keys is None:
        with safe_open(cached_file(model, "model.safetensors"), framework="pt") as fh:
            keys = list(fh.keys())
    hits = [k for k in keys if k == name or k.endswith("." + name)]
    if len(hits) != 1:
        raise ConfigError(f"{model}: cannot find the final norm weight {name!r} in the checkpoint (found {hits})")
    path = cached_file(model, weight_map[hits[0]] if weight_map else "model.safetensors")
    with safe_open(path, framework="pt") as fh:
        weight = fh.get_tensor(hits[0]).float()
    norm = norm.to_empty(device="cpu").float()
    norm.weight.data.copy_(weight)
    with torch.no_grad():
        gain = norm(torch.full((1, hidden_size), 1024.0))[0]  # rms = 1024 >> eps, so out = g
    if bool((gain.abs() < 1e-6).any()):
        raise ConfigError(f"{model}: the final norm has zero gain in some channels; cannot undo it")
    return gain


# --format of earlier releases: specforge followed the run's preset (eagle3 keys with a final state).
LEGACY_FORMATS = ("specforge", "speculators")


def target_of(name: str, store_final: bool) -> str:
    if name == "specforge":
        return "specforge-eagle3" if store_final else "specforge-dflash"
    if name == "speculators":
        return "speculators-eagle3"
    if name not in TARGETS:
        raise ConfigError(f"unknown trainer {name!r} (want one of {', '.join(TARGETS)})")
    return name


def specforge_path(out: Path, position: int) -> Path:
    """SpecForge sorts the paths of its feature files as text (``offline_reader``: ``os.walk`` + ``sort``):
    zero-padded numbers make that the run's order."""
    g, w = (position // SPECFORGE_GROUP) * SPECFORGE_GROUP, SPECFORGE_DIGITS
    return out / f"rows_{g:0{w}d}-{g + SPECFORGE_GROUP:0{w}d}" / f"data_{position:0{w}d}.ckpt"


def _unpadded_specforge_files(out: Path) -> list[Path]:
    """Folders of an export written before names were zero-padded (its files would train in another order)."""
    padded = re.compile(rf"rows_\d{{{SPECFORGE_DIGITS}}}-\d{{{SPECFORGE_DIGITS}}}")
    return sorted(p for p in out.glob("rows_*") if not padded.fullmatch(p.name))


def speculators_path(out: Path, position: int) -> Path:
    return out / f"hs_{position}.safetensors"


def speculators_record(sample: dict, hidden_size: int, gain: torch.Tensor, stored: dict | None = None) -> dict:
    """speculators' record of ``sample``; ``stored`` (an FP8 run: ``stored_fp8`` of its rows) makes it
    hs-connectors' fp8 layout from the stored codes and scales."""
    hs = sample["hidden_states"]
    aux = hs.reshape(hs.shape[0], -1, hidden_size)
    last = (sample["final_hidden_states"].float() / gain).to(hs.dtype)
    record = {"token_ids": sample["input_ids"].to(torch.int64), "loss_mask": sample["loss_mask"].to(torch.int64)}
    if stored is None:
        record["hidden_states"] = torch.cat([aux, last[:, None]], dim=1).contiguous()
        return record
    # hs-connectors' fp8 layout: codes [T, n+1, H] times scales [T, n+1, 1] (its reader broadcasts them)
    T = hs.shape[0]
    codes, scales = stored["hidden_states"].reshape(T, -1, hidden_size), stored["hidden_scales"][:, :, None]
    if bool((gain == 1).all()):
        last_codes, last_scales = stored["final_hidden_states"], stored["final_scales"]
    else:   # final / g has other codes: this slot alone is quantised again
        last_codes, last_scales = quantise_fp8(last, 1)
    record["hidden_states"] = torch.cat([codes, last_codes[:, None]], dim=1).contiguous()
    record["hidden_states_scales"] = torch.cat([scales, last_scales[:, :, None]], dim=1).float().contiguous()
    return record


def stored_fp8(buf: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """The FP8 codes and scales of a batch object as stored (codec undone), by name."""
    header = parse_header(memoryview(buf.numpy())[:min(len(buf), MAX_HEADER + 8)], where,
                                    outputs=True)
    return {name: decode_tensor(buf, header, name)
            for name in ("hidden_states", "hidden_scales", "final_hidden_states", "final_scales")}


def _write(path: Path, record: dict, trainer: str) -> None:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        if trainer == "specforge":
            torch.save(record, tmp)
        else:
            save_file(record, str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_speculators_table(out: Path) -> int:
    """Rows input_ids/loss_mask/seq_len of hs_0 .. hs_{M-1} (M = first missing file); returns M."""
    from safetensors import safe_open

    rows, present = [], {int(p.stem[3:]) for p in out.glob("hs_*.safetensors") if p.stem[3:].isdigit()}
    while len(rows) in present:
        with safe_open(str(speculators_path(out, len(rows))), framework="pt") as fh:
            ids, mask = fh.get_tensor("token_ids").tolist(), fh.get_tensor("loss_mask").tolist()
        rows.append({"input_ids": ids, "loss_mask": mask, "seq_len": len(ids)})
    if len(present) > len(rows):
        log.warning("%s: hs_%d.safetensors is missing; the dataset table covers hs_0..hs_%d only (export the "
                    "remaining shards to complete it)", out, len(rows), len(rows) - 1)
    tmp = out / f".dataset.jsonl.tmp-{os.getpid()}"
    tmp.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    os.replace(tmp, out / "dataset.jsonl")
    try:
        write_arrow_table(out / "dataset", rows)
    except ImportError:
        log.info("`pyarrow` is not installed: wrote %s only; for speculators install hsx[speculators] and re-run, or "
                 "datasets.Dataset.from_json(%r).with_format('torch').save_to_disk(%r)", out / "dataset.jsonl",
                 str(out / "dataset.jsonl"), str(out / "dataset"))
    write_token_freq(out / "dataset", [r["input_ids"] for r in rows], [r["loss_mask"] for r in rows])
    return len(rows)


def write_token_freq(folder: Path, input_ids: list[list[int]], loss_masks: list[list[int]]) -> dict[int, int]:
    """``folder/token_freq.pt``: {token id: count over loss-masked tokens}, as speculators' prepare step
    (``save_token_frequency_distribution``) writes it beside its Arrow dataset, where `speculators train` looks
    by default (``<data-path>/token_freq.pt``) to pick the draft vocabulary (``--draft-vocab-size``)."""
    freq: dict[int, int] = {}
    for ids, mask in zip(input_ids, loss_masks, strict=True):
        for token, kept in zip(ids, mask, strict=True):
            if kept:
                freq[token] = freq.get(token, 0) + 1
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".token_freq.pt.tmp-{os.getpid()}"
    torch.save(freq, tmp)
    os.replace(tmp, folder / "token_freq.pt")
    return freq


def write_arrow_table(folder: Path, rows: list[dict]) -> None:
    """``rows`` as a Hugging Face ``datasets`` folder in torch format, the layout ``Dataset.save_to_disk`` writes
    after speculators' prepare step ``set_format(type="torch")`` (one Arrow stream, dataset_info.json, state.json),
    written with pyarrow so hsx does not need ``datasets``; every column int64, as speculators compares
    ``input_ids`` with the int64 ``token_ids`` of the hidden-state file."""
    import pyarrow as pa

    ints = {"dtype": "int64", "_type": "Value"}
    features = {"input_ids": {"feature": ints, "_type": "List"}, "loss_mask": {"feature": ints, "_type": "List"},
                "seq_len": ints}
    info = {"citation": "", "description": "", "features": features, "homepage": "", "license": ""}
    schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                        ("seq_len", pa.int64())], metadata={"huggingface": json.dumps({"info": {"features": features}})})
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with pa.OSFile(str(tmp / "data-00000-of-00001.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)
    (tmp / "dataset_info.json").write_text(json.dumps(info, indent=2))
    state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_fingerprint": f"hsx{len(rows):013x}",
             "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch", "_output_all_columns": False,
             "_split": None}
    (tmp / "state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def export_run(settings: StoreSettings, run: str, fmt: str, out: Path, limit: int | None = None,
               shards: list[str] | None = None) -> dict:
    """Export for trainer ``fmt`` (a TARGETS key, or a legacy --format); returns counts {written, skipped, samples}."""
    if fmt not in TARGETS and fmt not in LEGACY_FORMATS:
        raise ConfigError(f"unknown trainer {fmt!r} (want one of {', '.join(TARGETS)})")
    source = Source(settings, run, shards=shards)
    index: RunIndex = source.index
    target = target_of(fmt, index.store_final)
    trainer = TARGETS[target].trainer
    why = refusal(target, run, index.layer_ids, index.store_final)
    if why:
        raise ConfigError(why)
    refs = index.samples[:limit] if limit is not None else index.samples
    if not refs:
        raise ReaderError(f"run {run!r}: no samples to export" + (f" in shard(s) {shards}" if shards else ""))
    manifest, gain = index.manifest, None
    if trainer == "speculators":
        gain = final_norm_gain(manifest.model, index.hidden_size)
    fp8 = manifest.fp8_store
    if fp8 and trainer == "specforge":
        log.warning("run %s is stored as FP8; SpecForge has no FP8 layout, so the export dequantises to %s",
                    run, manifest.dtype)
    path_of = specforge_path if trainer == "specforge" else speculators_path
    old_names = _unpadded_specforge_files(out) if trainer == "specforge" and out.is_dir() else []
    if old_names:
        raise ConfigError(f"{out} holds an export with unpadded file names (e.g. {old_names[0].relative_to(out)}), "
                          "which SpecForge trains in another order than the run's: export into a new folder")
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[str, list[SampleRef]] = {}
    for ref in refs:
        groups.setdefault(ref.key, []).append(ref)
    written = skipped = 0
    progress = Progress(f"export {run}", len(refs), "samples", every_s=PROGRESS_SECONDS)
    for key, group in groups.items():
        todo = [ref for ref in group if not path_of(out, ref.position).exists()]
        skipped += len(group) - len(todo)
        progress.advance(len(group) - len(todo))
        if not todo:
            continue
        contents = source.batch(key)
        codes = stored_fp8(source.object_bytes(key), source.store.url(key)) if fp8 and trainer == "speculators" \
            else None
        for ref in todo:
            sample = sample_of(contents, ref, source.store.url(key))
            if trainer == "specforge":
                record = specforge_record(sample, target.removeprefix("specforge-"))
            else:
                lo, hi = int(contents.cu_seqlens[ref.row]), int(contents.cu_seqlens[ref.row + 1])
                rows = None if codes is None else {name: t[lo:hi] for name, t in codes.items()}
                record = speculators_record(sample, index.hidden_size, gain, rows)
            _write(path_of(out, ref.position), record, trainer)
            written += 1
            progress.advance()
    progress.close()
    counts = {"written": written, "skipped": skipped, "samples": len(refs)}
    if trainer == "speculators":
        counts["table_rows"] = write_speculators_table(out)
    layer_ids = index.layer_ids if trainer == "specforge" else [k + 1 for k in index.layer_ids]
    info = {"run": run, "format": trainer, "for": target, "layer_ids": layer_ids, "hidden_size": index.hidden_size,
            "dtype": FP8 if fp8 and trainer == "speculators" else manifest.dtype,
            "store_dtype": manifest.store_dtype, "codec": manifest.codec,
            "dequantised": fp8 and trainer == "specforge",
            "model": manifest.model, "store_final": index.store_final, **counts}
    if fp8 and trainer == "speculators":
        info["hidden_states_backend"] = "fp8"  # the default `file` backend would train on the unscaled values
    if trainer == "specforge":
        info["draft_config"] = specforge_draft_config(out, target, manifest.model, index.layer_ids)
    (out / "hsx_export.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("export %s -> %s (%s): %d written, %d already there; trainer layer ids %s",
             run, out, target, written, skipped, layer_ids)
    return counts


def specforge_draft_config(out: Path, target: str, model: str | None, layer_ids: list[int]) -> str | None:
    """Write ``OUT/draft_config.json`` (hsx_tools.draftconfig) for ``target``; its file name, or None (logged)
    where the target's config cannot be read or the draft cannot read the run's layers."""
    from hsx_tools.draftconfig import FILE, write_draft_config

    try:
        if not model:
            raise ConfigError("the run's manifest names no model")
        write_draft_config(out / FILE, model, target.removeprefix("specforge-"), layer_ids)
    except (ConfigError, OSError, ValueError) as exc:
        log.warning("no %s written for %s: %s; write SpecForge's draft config by hand (docs/training.md)",
                    FILE, target, exc)
        return None
    return FILE


def run_export(cfg: ExportConfig) -> int:
    counts = export_run(run_store(cfg), cfg.run, cfg.format, cfg.out, cfg.limit, list(cfg.shards) or None)
    print(f"exported run {cfg.run} for {cfg.format} to {cfg.out}: {counts['written']} written, "
          f"{counts['skipped']} already there, {counts['samples']} in all")
    info = json.loads((cfg.out / "hsx_export.json").read_text())
    if info["format"] == "speculators":
        backend = " --hidden-states-backend fp8" if info.get("hidden_states_backend") == "fp8" else ""
        print(f"train: speculators train --verifier-name-or-path {info['model']} --speculator-type "
              f"{info['for'].split('-')[1]} --data-path {cfg.out / 'dataset'} --hidden-states-path {cfg.out}{backend} "
              f"--target-layer-ids {' '.join(map(str, info['layer_ids']))} --on-missing raise")
    elif info.get("draft_config"):
        from hsx_tools.draftconfig import config_line

        out = cfg.out.resolve()
        print(f"train: specforge train -c run.yaml model.target_model_path={info['model']} "
              f"{config_line(out / info['draft_config'])} data.hidden_states_path={out} "
              f"training.strategy={info['for'].removeprefix('specforge-')}")
    return 0
