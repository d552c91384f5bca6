"""Tokenise every row of the dataset, in parallel, counting and reporting each rejection."""

from __future__ import annotations

import logging
import multiprocessing as mp
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from hsx.dataset import Row, RowError, iter_rows
from hsx.tokenise import ChatTokeniser, RowProblem

log = logging.getLogger(__name__)
EXAMPLES_KEPT = 20  # rejected rows quoted in the report; all are counted


@dataclass
class Sample:
    sample_id: str
    input_ids: np.ndarray   # int32
    loss_mask: np.ndarray   # uint8


@dataclass
class TokeniseReport:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    rejected: Counter = field(default_factory=Counter)     # reason kind -> rows
    examples: list[str] = field(default_factory=list)      # "row 12: reason"
    duplicate_ids: int = 0

    def reject(self, index: int, reason: str) -> None:
        self.rejected[reason.split(" (")[0].split(":")[0]] += 1
        if len(self.examples) < EXAMPLES_KEPT:
            self.examples.append(f"row {index}: {reason}")


_worker_tok: ChatTokeniser | None = None


def _init(model_path: str) -> None:
    global _worker_tok
    from transformers import AutoTokenizer

    _worker_tok = ChatTokeniser(AutoTokenizer.from_pretrained(model_path))


def _encode(item: Row | RowError):
    if isinstance(item, RowError):
        return item.index, None, item.reason
    try:
        t = _worker_tok.encode_row(item.data, item.index)
    except RowProblem as exc:
        return item.index, None, str(exc)
    except Exception as exc:  # a row must never take the run down; name it and go on
        return item.index, None, f"cannot tokenise ({type(exc).__name__}: {exc})"
    return item.index, (t.sample_id, np.asarray(t.input_ids, np.int32), np.asarray(t.loss_mask, np.uint8)), None


def tokenise_dataset(dataset, model_path: str, max_length: int, overlong: str, workers: int,
                     progress_every: int = 50_000) -> tuple[list[Sample], TokeniseReport]:
    report, samples, seen = TokeniseReport(), [], set()
    rows = iter_rows(dataset)
    if workers > 1:
        pool = mp.get_context("spawn").Pool(workers, initializer=_init, initargs=(model_path,))
        results = pool.imap(_encode, rows, chunksize=256)
    else:
        pool = None
        _init(model_path)
        results = map(_encode, rows)
    try:
        for index, encoded, problem in results:
            report.rows += 1
            if report.rows % progress_every == 0:
                log.info("tokenised %d rows (%d kept)", report.rows, report.kept)
            if problem:
                report.reject(index, problem)
                continue
            sample_id, ids, mask = encoded
            if len(ids) > max_length:
                if overlong == "drop":
                    report.dropped_overlong += 1
                    if len(report.examples) < EXAMPLES_KEPT:
                        report.examples.append(f"row {index}: {len(ids)} tokens > max length {max_length}, dropped")
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
                report.truncated += 1
                if not mask.any():
                    report.reject(index, f"no assistant token left after truncation to {max_length}")
                    continue
            if sample_id in seen:
                report.duplicate_ids += 1
                report.reject(index, f"duplicate sample id {sample_id!r}")
                continue
            seen.add(sample_id)
            samples.append(Sample(sample_id, ids, mask))
            report.kept += 1
    finally:
        if pool:
            pool.close()
            pool.join()
    return samples, report
