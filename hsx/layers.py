"""Layer presets: which decoder-layer outputs a run captures.

Layer ids are 0-based decoder-layer outputs, i.e. Hugging Face
``hidden_states[i + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx.defaults import DEFAULT_DFLASH_LAYERS
from hsx.errors import HsxError


class LayerSpecError(HsxError, ValueError):
    """The requested layers do not fit the model."""


def _dflash_ids(num_layers: int, count: int) -> list[int]:
    if count == 1:
        return [num_layers // 2]
    return [round(1 + i * (num_layers - 4) / (count - 1)) for i in range(count)]


def max_dflash_layers(num_layers: int) -> int:
    """The most layers dflash:N can pick from a model of ``num_layers`` decoder layers (distinct ids)."""
    best = 1
    for count in range(2, num_layers + 1):
        if num_layers >= 5 and len(set(_dflash_ids(num_layers, count))) == count:
            best = count
    return best


def dflash_layers(num_layers: int, count: int = DEFAULT_DFLASH_LAYERS) -> list[int]:
    if count < 1:
        raise LayerSpecError(f"dflash needs at least 1 layer, got {count}")
    ids = _dflash_ids(num_layers, count)
    if count > 1 and (num_layers < 5 or len(set(ids)) != count):
        most = max_dflash_layers(num_layers)
        raise LayerSpecError(f"dflash{':' + str(count) if count != DEFAULT_DFLASH_LAYERS else ''} picks {count} layers, "
                             f"but this model has only {num_layers} decoder layers, too few for {count} distinct dflash "
                             f"layers: use --layers dflash:{most} (at most {most} here) or list layer ids "
                             f"(0..{num_layers - 1}), e.g. --layers {','.join(map(str, range(1, min(num_layers, 4))))}")
    return ids


EAGLE3_MIN_LAYERS = 4


def eagle3_layers(num_layers: int) -> list[int]:
    """SpecForge's [1, L // 2 - 1, L - 4] (the preset for large L); where that repeats a layer (L < 7), three distinct layers
    below the last one: [1, L // 2, L - 2], else [0, 1, 2]."""
    if num_layers < EAGLE3_MIN_LAYERS:
        raise LayerSpecError(f"eagle3 needs a model of >= {EAGLE3_MIN_LAYERS} decoder layers (3 distinct layers below "
                             f"the last), this one has {num_layers}")
    for ids in ([1, num_layers // 2 - 1, num_layers - 4], [1, num_layers // 2, num_layers - 2], [0, 1, 2]):
        if len(set(ids)) == 3 and min(ids) >= 0:
            return ids
    raise AssertionError("unreachable: [0, 1, 2] is distinct")


def resolve_layers(spec: str, num_layers: int) -> tuple[list[int], bool]:
    """Parse a layer spec into (sorted layer ids, whether the final hidden state is stored).

    ``spec`` is ``dflash``, ``dflash:N``, ``eagle3`` or a comma-separated list of ids, optionally followed by
    ``+final`` (also store the final hidden state; eagle3 always does).
    """
    spec = spec.strip()
    base, plus, suffix = spec.partition("+")
    if plus:
        if suffix.strip() != "final":
            raise LayerSpecError(f"the only layer-spec suffix is +final, got {spec!r}")
        ids, _ = resolve_layers(base, num_layers)
        return ids, True
    name, _, arg = spec.partition(":")
    if name == "dflash":
        count = DEFAULT_DFLASH_LAYERS
        if arg:
            if not arg.isdigit():
                raise LayerSpecError(f"dflash:N takes a whole number, got {arg!r}")
            count = int(arg)
        ids, final = dflash_layers(num_layers, count), False
    elif name == "eagle3":
        if arg:
            raise LayerSpecError("eagle3 takes no argument")
        ids, final = eagle3_layers(num_layers), True
    else:
        try:
            ids = [int(part) for part in spec.split(",") if part.strip()]
        except ValueError:
            raise LayerSpecError("layers must be dflash, dflash:N, eagle3 or a comma-separated list of integers (each "
                                 f"optionally +final), got {spec!r}") from None
        if not ids:
            raise LayerSpecError("empty layer list")
        final = False
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise LayerSpecError(f"layer ids {bad} are out of range for a model with {num_layers} decoder layers (valid: 0..{num_layers - 1})")
    if len(set(ids)) != len(ids):
        raise LayerSpecError(f"layer ids repeat: {ids} ({spec} on a model of {num_layers} decoder layers); use "
                             f"--layers dflash:{max_dflash_layers(num_layers)} or list distinct ids (0..{num_layers - 1})")
    return sorted(ids), final


@dataclass(frozen=True)
class Target:
    """A trainer and algorithm `hsx export --for` writes files for."""

    trainer: str         # specforge | speculators
    final: str | None    # the trainer's name for the final hidden state, where it needs one


TARGETS = {
    "specforge-eagle3": Target("specforge", "hidden_state"),
    "specforge-dflash": Target("specforge", None),
    "specforge-dspark": Target("specforge", "target_last_hidden_states"),
    "speculators-eagle3": Target("speculators", "the last hidden_states slot"),
    "speculators-dflash": Target("speculators", "the last hidden_states slot"),
}


def refusal(target: str, run: str, layer_ids: list[int], store_final: bool) -> str | None:
    """Why this run cannot feed ``target`` (one line), or None."""
    need = TARGETS[target].final
    if need and not store_final:
        ids = ",".join(map(str, layer_ids))
        return (f"run {run!r} cannot feed {target}: it needs the final hidden state ({need}), and the run stored "
                f"layers [{ids}] only; produce with --layers {ids}+final (or eagle3)")
    return None


def feeds(layer_ids: list[int], store_final: bool) -> list[str]:
    """The trainers a run with these layers can feed."""
    return [t for t in TARGETS if refusal(t, "", layer_ids, store_final) is None]
