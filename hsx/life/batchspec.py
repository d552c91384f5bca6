"""A planned batch's record, ``BatchSpec``: what the plan in Redis (``hsx:<run>:plan``, batch id -> JSON) holds of it.

Two forms read: the long one (every field by name, the sample ids included: what an older hsx wrote for
every spec, and hsx still writes for a spec that holds its ids) and the compact one of a plan that keeps its
sample ids in the store (``BatchSpec.for_plan``; hsx/life/planids.py): no ids, their digest, no batch id or index, short names.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass, field, replace


def _batch_id(index: int) -> str:
    return f"b{index:07d}"   # hsx.store.layout.batch_id: a plan entry of one leaves out its batch id and index


def _b64(hex_digest: str) -> str:
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).decode().rstrip("=")


def _hex(b64: str) -> str:
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def ids_digest(sample_ids) -> str:
    """What a plan without its sample ids keeps of them: the first 16 hex digits of the SHA-256 of the
    ids' compact JSON list. Enough to tell a batch object of other samples from the plan's."""
    return hashlib.sha256(json.dumps(list(sample_ids), separators=(",", ":")).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class BatchSpec:
    """One planned batch. ``padded`` = rows x padded row length (what the GPU computes).

    ``sample_ids``: a plan written by an older hsx holds them in Redis; a newer producer's plan
    holds ``ids_sha256`` instead (``for_plan``), the ids living in the store (the batch's inputs object's header and
    the window's ids object: hsx/life/planids.py). ``ids_match`` checks ids found in an object against either."""

    batch_id: str
    index: int
    shard: str
    samples: int
    tokens: int
    padded: int
    padded_len: int          # tokens a row is padded to (the longest row, rounded up to the pad multiple)
    sample_ids: list[str] = field(default_factory=list)   # [] in a plan that keeps them in the store
    input_sha256: str = ""  # SHA-256 of the batch's input object as the producer wrote it ("" = not recorded)
    # Shared prefixes (hsx/prep/prefixplan.py): [first, count, spine] a group of consecutive samples whose
    # first ``spine`` tokens are computed once; ``computed``: tokens the GPU computes (0: ``padded``).
    prefix_groups: list = field(default_factory=list)
    computed: int = 0
    ids_sha256: str = ""     # ids_digest(sample_ids) where the plan keeps the ids in the store ("": an older plan)
    source: str = ""         # a mixture's source the batch's window read (hsx/prep/mixture.py); "": one dataset

    def to_json(self) -> str:
        if self.ids_sha256 and not self.sample_ids and self.batch_id == _batch_id(self.index):
            return self._compact_json()
        fields = asdict(self)
        if not self.prefix_groups:   # a plan without shared prefixes keeps the bytes older hsx wrote and reads
            del fields["prefix_groups"], fields["computed"]
        if not self.ids_sha256:
            del fields["ids_sha256"]
        if not self.source:
            del fields["source"]
        if not self.sample_ids and self.ids_sha256:
            del fields["sample_ids"]
        return json.dumps(fields, separators=(",", ":"))

    def _compact_json(self) -> str:
        """The entry of a plan that keeps its ids in the store: no batch id or index (the hash field
        names them), short names but for those scripts and monitors read (shard, samples, tokens), the inputs'
        SHA-256 in base64url: ~140 bytes, a 160-byte allocation where the long form took 256."""
        fields = {"shard": self.shard, "samples": self.samples, "tokens": self.tokens, "p": self.padded,
                  "l": self.padded_len, "d": self.ids_sha256}
        if self.input_sha256:
            fields["in"] = _b64(self.input_sha256)
        if self.prefix_groups:
            fields.update(g=self.prefix_groups, c=self.computed)
        if self.source:
            fields["src"] = self.source
        return json.dumps(fields, separators=(",", ":"))

    @property
    def computed_tokens(self) -> int:
        """Tokens the GPU computes for this batch: ``padded``, less the spines its prefix groups share."""
        return self.computed or self.padded

    @property
    def ids_in_plan(self) -> bool:
        """True where this spec holds its sample ids (an older plan, or a spec before ``for_plan``)."""
        return bool(self.sample_ids)

    def for_plan(self) -> BatchSpec:
        """This spec as Redis keeps it: the ids' digest instead of the ids (they are in the store)."""
        if not self.sample_ids:
            return self
        return replace(self, sample_ids=[], ids_sha256=ids_digest(self.sample_ids))

    def with_ids(self, sample_ids) -> BatchSpec:
        """This spec holding ``sample_ids`` (read from the store: check them with ``ids_match`` first)."""
        return replace(self, sample_ids=list(sample_ids))

    def ids_match(self, sample_ids) -> bool:
        """True if ``sample_ids`` (found in an object's header) are this batch's, in order: against the ids where
        the spec holds them, else against ``ids_sha256``; a spec with neither matches nothing."""
        if self.sample_ids:
            return list(sample_ids) == list(self.sample_ids)
        return bool(self.ids_sha256) and ids_digest(sample_ids) == self.ids_sha256

    @classmethod
    def from_json(cls, raw: str | bytes, batch_id: str | None = None) -> BatchSpec:
        """``batch_id``: the plan's hash field the entry is of; an entry of a plan that keeps its ids in the store
        leaves out its batch id and index (they follow from the field), so reading one needs it."""
        fields = json.loads(raw)
        if "d" in fields:   # the compact entry (_compact_json)
            index = int(batch_id[1:]) if isinstance(batch_id, str) and batch_id[1:].isdigit() else -1
            if index < 0 or batch_id != _batch_id(index):
                raise ValueError(f"a plan entry without its batch id is read with it (got {batch_id!r:.40})")
            return cls(batch_id=batch_id, index=index, shard=fields["shard"], samples=fields["samples"],
                       tokens=fields["tokens"], padded=fields["p"], padded_len=fields["l"],
                       input_sha256=_hex(fields["in"]) if "in" in fields else "", ids_sha256=fields["d"],
                       prefix_groups=fields.get("g", []), computed=fields.get("c", 0), source=fields.get("src", ""))
        if "max_len" in fields:  # plans recorded before the field was named for what it holds
            fields["padded_len"] = fields.pop("max_len")
        return cls(**fields)
