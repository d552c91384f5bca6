"""Run in the specforge venv: `specforge train` (specforge.cli.main: its config, launch plan, process group,
model bundle, vocabulary map, offline data path, DDP wrapper, BF16Optimizer and training loop) for a few CPU
steps. argv[1]: a JSON list of runs, trained one after the other in this process (one import for all), each
{"argv": specforge train's argv, "hsx_store": null | {"store", "fetch", "endpoint_url"}}:

- "hsx_store": run through `python -m hsx_peers.specforge train` instead (data.hidden_states_path: hsx://R
  read in place from that store through HsxFeatureStore, no export); with "refused": true, a run that
  command must refuse: its exit status and "error: " lines are reported instead of losses.

The draft model config is the one hsx wrote (an export's draft_config.json, named in argv as `hsx export`
printed it; in place, the one the command writes from the run's manifest): none is written here.

What is replaced for the CPU, and why (nothing else):

1. EAGLE-3's loss. specforge/core/loss.py imports triton at module level and its `LogSoftmaxLoss` runs two
   triton kernels (a fused log-softmax KL forward and backward); triton has no CPU backend and the CPU torch
   wheel ships none. A stand-in triton module (jit = identity) is present in sys.modules only while that
   file is imported, then removed, so nothing else sees it; `LogSoftmaxLoss.apply` is then the same file's
   own "Reference implementation", `_compute_loss` (-sum(mask * p * log_softmax(logits)), mean over B*T:
   the kernel's math; SpecForge's benchmarks/benchmark_loss.py times the two against each other), called
   without its torch.compile wrapper (on a CPU that would build C++ first).
   torch's compile machinery is imported before the stand-in goes in, because it probes triton as it
   imports and must find none. DFlash and DSpark do not import that file: they need no substitution.
2. Nothing for FSDP: torch 2.13's FSDP1 refuses a CPU ("FSDP needs a non-CPU accelerator device"), and
   SpecForge's default `training.fsdp_sharding` (SHARD_GRAD_OP) wraps in FSDP. Its own `NO_SHARD` recipe
   wraps in DDP instead, which runs on the gloo process group SpecForge itself starts on a CPU (world size 1,
   specforge.distributed: cpu -> gloo). The tests set `training.fsdp_sharding=NO_SHARD` in the config, and
   `training.attention_backend=sdpa` (the default flex_attention: "FlexAttention does not support backward
   on CPU").

Recorded, not replaced: SpecForge's console logger (`specforge.training.assembly._logger`, one call per
optimizer step) is wrapped to keep each step's `loss`. Prints {"losses": [[...] per run], "seconds": [...],
"refusals": [{"rc", "errors", "losses"} per refused run]} (JSON, last line).
"""

import contextlib
import io
import json
import os
import sys
import time
import types

import torch

torch.compile(lambda: None)  # imports torch's compile path (it probes triton) before the stand-in exists

_triton, _language = types.ModuleType("triton"), types.ModuleType("triton.language")
_triton.jit = lambda fn: fn                                   # the kernels are defined, never launched
_triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length()
_triton.language, _language.constexpr = _language, int
sys.modules.update({"triton": _triton, "triton.language": _language})
try:
    import specforge.core.loss as specforge_loss
finally:
    del sys.modules["triton"], sys.modules["triton.language"]

_reference = getattr(specforge_loss._compute_loss, "_torchdynamo_orig_callable", specforge_loss._compute_loss)
specforge_loss.LogSoftmaxLoss.apply = staticmethod(_reference)

# isort: split

import specforge.training.assembly as assembly  # noqa: E402
from specforge.cli import main as specforge_main  # noqa: E402

import hsx_peers.specforge as hsx_specforge  # noqa: E402

losses: list[float] = []
console_logger = assembly._logger


def recording_logger(metrics, step):
    losses.append(float(metrics["loss"]))
    console_logger(metrics, step)


assembly._logger = recording_logger


DISTRIBUTED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
report, seconds, refusals = [], [], []
for spec in json.loads(sys.argv[1]):
    losses, started = [], time.monotonic()
    for name in DISTRIBUTED_ENV:  # each run rendezvouses afresh (SpecForge picks a free port when unset)
        os.environ.pop(name, None)
    argv = list(spec["argv"])
    if spec.get("hsx_store"):
        store = spec["hsx_store"]
        flags = ["--hsx-store", store["store"], "--hsx-fetch", store.get("fetch", "object")]
        if store.get("endpoint_url"):
            flags += ["--hsx-s3-endpoint-url", store["endpoint_url"]]
        if spec.get("refused"):  # the command's refusal: its exit status and its error lines
            with contextlib.redirect_stderr(io.StringIO()) as stderr:
                rc = hsx_specforge.main([*argv, *flags])
            refusals.append({"rc": rc, "errors": [x for x in stderr.getvalue().splitlines() if x.startswith("error: ")],
                             "losses": losses})
            continue
        rc = hsx_specforge.main([*argv, *flags])
    else:
        rc = specforge_main(argv)
    assert rc == 0, (argv, rc)
    report.append(losses)
    seconds.append(round(time.monotonic() - started, 1))
print(json.dumps({"losses": report, "seconds": seconds, "refusals": refusals}))
