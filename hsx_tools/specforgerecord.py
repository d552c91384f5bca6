"""The record SpecForge 0.2.0's offline trainer reads for one sample: defined once, for both roads to SpecForge.

`hsx export --for specforge-*` writes it, one ``torch.save``d ``.ckpt`` a sample (hsx_tools/export.py), and
hsx_peers.specforge's ``HsxFeatureStore`` serves it from a run in place. The keys are those of SpecForge's
offline readers (``specforge/algorithms/*/data.py``), by strategy:

- every strategy: ``input_ids`` [T] int64 and ``loss_mask`` [T] int64;
- ``eagle3``: ``aux_hidden_state`` [1, T, n*H] (the stored layers) + ``hidden_state`` [1, T, H] (the final
  state, after the norm, as SpecForge stores it);
- ``dflash`` / ``domino``: ``hidden_states`` [1, T, n*H];
- ``dspark`` (DFlash + target supervision): ``hidden_states`` + ``target_last_hidden_states`` [1, T, H] (the
  final state).

hsx layer ids are SpecForge's. Tensors are fresh copies: a view would save (or pin) its whole batch.
"""

from __future__ import annotations

import torch

KEYS = {
    "eagle3": ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state"),
    "dflash": ("input_ids", "loss_mask", "hidden_states"),
    "domino": ("input_ids", "loss_mask", "hidden_states"),
    "dspark": ("input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"),
}
NEEDS_FINAL = {"eagle3", "dspark"}   # strategies that read the final hidden state: a run must store it


def specforge_record(sample: dict, strategy: str) -> dict[str, torch.Tensor]:
    """SpecForge's record of ``sample`` (hsx_reader's: ``input_ids``, ``loss_mask``, ``hidden_states`` and, where
    the run stores it, ``final_hidden_states``) for ``strategy``, one of KEYS."""
    if strategy not in KEYS:
        raise ValueError(f"strategy must be one of {sorted(KEYS)}, got {strategy!r}")
    record = {"input_ids": sample["input_ids"].to(torch.int64), "loss_mask": sample["loss_mask"].to(torch.int64)}
    if strategy == "eagle3":
        record["aux_hidden_state"] = sample["hidden_states"].clone()[None]
        record["hidden_state"] = sample["final_hidden_states"].clone()[None]
    else:
        record["hidden_states"] = sample["hidden_states"].clone()[None]
    if strategy == "dspark":
        record["target_last_hidden_states"] = sample["final_hidden_states"].clone()[None]
    return record
