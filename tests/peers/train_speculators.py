"""Run in the speculators venv: `speculators train` (speculators.train.cli.main with its own TrainConfig
resolution, Trainer, model and data path) for a few CPU steps. argv[1]: a JSON list of `speculators train`
flag lists, trained one after the other in this process (one import of torch and speculators for all).
The hsx hs-connectors backend (peers/hsx_peers, on the path: tests/peerenv.py) is registered first, so a flag
list may read an hsx run in place (``--hidden-states-backend hsx --hsx-store ... --hsx-run ...``).

speculators 0.9.0's Trainer puts the model on ``get_local_rank()`` (an accelerator index) and autocasts on the
current accelerator and pins batches for it, so on a machine without one it stops at ``model.to(0)``. The only
shim here maps that device to the CPU (no pinning, no accelerator sync or memory reads); everything else is the
release's code. Prints the loss of every step of each run (JSON, last line)."""

import json
import sys

# the `hsx` backend registers itself on import, before speculators snapshots the registry
import hsx_peers.speculators  # noqa: F401

# isort: split

import speculators.train.checkpointer as checkpointer_module
import speculators.train.cli as cli_module
import speculators.train.trainer as trainer_module
import torch
import torch.utils.data._utils.pin_memory as pinning
from speculators.train.cli import main
from speculators.train.config import TrainConfig

trainer_module.get_local_rank = lambda: "cpu"
checkpointer_module.get_current_device = lambda: "cpu"  # a resumed Trainer loads its checkpoint onto the accelerator
torch.accelerator.current_accelerator = lambda check_available=False: torch.device("cpu")
pinning.pin_memory = lambda data, device=None: data  # its DataLoader pins batches for the accelerator
torch.accelerator.synchronize = lambda device=None: None  # its step timer syncs the accelerator ...
torch.accelerator.memory_allocated = lambda device=None: 0  # ... and reads its memory
if not hasattr(torch.cpu, "empty_cache"):
    torch.cpu.empty_cache = lambda: None

losses: list[float] = []
init = trainer_module.Trainer.__init__


def recording_init(self, model, *args, **kwargs):
    forward = model.forward

    def recorded(*a, **k):
        out = forward(*a, **k)
        if torch.is_grad_enabled():
            losses.append(float(out[1]))  # the loss of this training step
        return out

    model.forward = recorded
    init(self, model, *args, **kwargs)


trainer_module.Trainer.__init__ = recording_init
generate_vocab_mappings = cli_module._generate_vocab_mappings
vocab_from_freq: list[bool] = []


def recording_vocab(*args, **kwargs):
    result = generate_vocab_mappings(*args, **kwargs)
    vocab_from_freq.append(result is not None)  # None: no token_freq.pt, the full verifier vocabulary
    return result


cli_module._generate_vocab_mappings = recording_vocab
report, vocab = [], []
for flags in json.loads(sys.argv[1]):
    losses, vocab_from_freq = [], []
    main(TrainConfig.resolve(flags))
    report.append(losses)
    vocab.append(any(vocab_from_freq))
print(json.dumps({"losses": report, "draft_vocab_from_token_freq": vocab}))
