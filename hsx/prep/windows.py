"""Tokenise the dataset window by window on every core, counting each rejection by reason.

Rows are read in order and cut into windows of ``window_rows`` consecutive
rows (window w = rows [w * window_rows, (w + 1) * window_rows), by row index),
so a window's content never depends on timing. Within a window, chunks of
CHUNK_ROWS rows go to a pool of processes (``workers``; spawn), each of which
loads the tokenizer once. At most IN_FLIGHT_CHUNKS chunks a process are in
flight and at most FINISHED_WINDOWS finished windows wait for the consumer,
so memory stays bounded whatever the dataset size, and tokenising goes on
while the consumer plans, writes and enqueues the previous window.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from hsx.prep.dataset import Row, RowError, iter_rows
from hsx.prep.mixture import MixedRow, Mixture
from hsx.prep.rejected import RowRejected
from hsx.prep.report import RejectedRow, Sample, TokenisedRow, TokeniseReport, Window
from hsx.prep.tokenise import sample_id_of

log = logging.getLogger(__name__)
CHUNK_ROWS = 64         # rows a task sent to a tokenising process
IN_FLIGHT_CHUNKS = 4    # chunks queued a process (keeps every core busy, memory bounded)
FINISHED_WINDOWS = 1    # tokenised windows waiting for the consumer


BYTES_A_WORKER = 2 * 2**20   # dataset bytes that pay for starting one more process (~2 s of one core's work)


def default_workers(dataset=None) -> int:
    """Every core this process may run on; fewer for a small dataset (starting a process costs seconds)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = max(1, os.cpu_count() or 1)
    if dataset is None:
        return cores
    paths = [s.path for s in dataset.sources] if isinstance(dataset, Mixture) else [Path(dataset)]
    size = sum(sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
               for path in paths)
    return max(1, min(cores, size // BYTES_A_WORKER))


@dataclass(frozen=True)
class TokeniseSettings:
    model: str
    max_length: int
    overlong: str                               # drop | truncate
    template_kwargs: dict | None = None         # passed to the chat template of every row
    columns: Any = None                         # hsx.prep.columns.ColumnMapping (picklable), or None
    # A mixture's sources: (name, template kwargs, columns) each, the run's merged in (hsx.prep.mixture)
    sources: tuple = ()
    per_turn: bool = False                      # one sample a turn of each row (hsx/prep/perturn.py)

    @classmethod
    def of(cls, model: str, max_length: int, overlong: str, template_kwargs, columns, mixture=None,
           per_turn: bool = False):
        """The settings of a run; a mixture's sources get the run's template arguments and columns unless
        they give their own (template arguments merged over the run's)."""
        sources = tuple((s.name, {**(template_kwargs or {}), **(s.template_kwargs or {})} or None,
                         s.columns if s.columns is not None else columns)
                        for s in (mixture.sources if mixture is not None else ()))
        return cls(model, max_length, overlong, template_kwargs, columns, sources, bool(per_turn))


# --- in each tokenising process -------------------------------------------------------------

_tokeniser = None
_source_tokenisers: dict = {}   # a mixture's source name -> its ChatTokeniser (one a distinct setting)
_per_turn = False


def _chat(tokenizer, template_kwargs, columns):
    from hsx.prep.tokenise import ChatTokeniser

    extra = {}
    if template_kwargs:
        extra["template_kwargs"] = template_kwargs
    if columns is not None:
        extra["columns"] = columns
    return ChatTokeniser(tokenizer, **extra)


def _init(settings: TokeniseSettings) -> None:
    global _tokeniser, _source_tokenisers, _per_turn
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.model)
    _tokeniser = _chat(tokenizer, settings.template_kwargs, settings.columns)
    made: dict = {}
    _source_tokenisers = {}
    for name, kwargs, columns in settings.sources:
        key = (json.dumps(kwargs, sort_keys=True, default=str), repr(columns))
        if key not in made:
            made[key] = _chat(tokenizer, kwargs, columns)
        _source_tokenisers[name] = made[key]
    _per_turn = settings.per_turn


def reason_code(exc: Exception) -> str:
    """The short reason a row was rejected (``RowRejected.reason``; else the message's head)."""
    code = getattr(exc, "reason", None)
    if isinstance(code, str) and code and " " not in code:
        return code
    return str(exc).split(" (")[0].split(":")[0].strip() or type(exc).__name__


def source_format(data: dict, tokenised=None) -> str:
    found = getattr(tokenised, "source_format", None)
    if found:
        return found
    for key, name in (("input_ids", "pretokenised"), ("messages", "openai"), ("conversations", "sharegpt")):
        if data.get(key) is not None:
            return name
    return "other"


def _encode_one(item: Row | RowError | MixedRow) -> TokenisedRow | list[TokenisedRow] | RejectedRow:
    """The row's sample, or (--per-turn) its samples, one a turn; or why it was rejected."""
    source, tokeniser, prefix = "", _tokeniser, ""
    if isinstance(item, MixedRow):   # a mixture's row: its source's settings, its id namespaced by the source
        source, tokeniser, prefix, item = item.source, _source_tokenisers[item.source], item.source + "/", item.item
    if isinstance(item, RowError):
        code = getattr(item, "code", None) or reason_code(ValueError(item.reason))
        return RejectedRow(item.index, f"{prefix}{item.index}" if prefix else None, code, str(item.reason),
                           "unreadable", source)
    data = item.data
    try:
        row_id = prefix + sample_id_of(data, item.index, tokeniser.columns)
    except RowRejected as exc:   # an id hsx will not store: the row is named by its position
        return RejectedRow(item.index, f"{prefix}{item.index}", reason_code(exc), str(exc), source_format(data), source)
    try:
        encoded = tokeniser.encode_turns(data, item.index) if _per_turn else [tokeniser.encode_row(data, item.index)]
    except RowRejected as exc:  # a bad row: counted under its reason, named, and the run goes on
        return RejectedRow(item.index, row_id, reason_code(exc), str(exc), source_format(data), source)
    except Exception as exc:    # not a bad row's error: a bug in hsx or a library, which no reject count may hide
        raise RuntimeError(f"row {item.index} (id {row_id!r}): tokenising it failed with an error that is not a bad "
                           f"row's (a bug): {type(exc).__name__}: {exc}") from exc
    rows = [TokenisedRow(item.index, prefix + t.sample_id, np.asarray(t.input_ids, np.int32),
                         np.asarray(t.loss_mask, np.uint8), source_format(data, t), source) for t in encoded]
    return rows if _per_turn else rows[0]


def _encode_chunk(chunk: list) -> list[TokenisedRow | RejectedRow]:
    return [_encode_one(item) for item in chunk]


# --- in the producer process ----------------------------------------------------------------

class _WindowBuilder:
    """Applies max length, overlong policy and duplicate ids to one window's results, in row order."""

    def __init__(self, number: int, settings: TokeniseSettings, seen: set[str]):
        self.window = Window(number, [], TokeniseReport())
        self.settings, self.seen = settings, seen

    def add(self, result: TokenisedRow | list[TokenisedRow] | RejectedRow) -> None:
        """One row's result: a sample, the samples of its turns (--per-turn), or its rejection."""
        report = self.window.report
        source = result[0].source if isinstance(result, list) else result.source
        if source != self.window.source:   # a mixture's windows hold one source each (hsx.prep.mixture)
            self.window = replace(self.window, source=source)
        report.rows += 1
        if isinstance(result, RejectedRow):
            report.formats[result.source_format] += 1
            report.reject(result.index, result.row_id, result.code, result.message)
            return
        samples = result if isinstance(result, list) else [result]
        report.formats[samples[0].source_format] += 1
        if isinstance(result, list):
            if samples[0].sample_id in self.seen:     # a row id seen before: the row is rejected once, not a turn at a time
                report.duplicate_ids += 1
                report.reject(samples[0].index, samples[0].sample_id, "duplicate_sample_id",
                              f"duplicate sample id {samples[0].sample_id!r} (a row id seen before)")
                return
            report.turn_rows += 1
        for sample in samples:
            self._add_sample(sample)

    def _add_sample(self, result: TokenisedRow) -> None:
        report, s = self.window.report, self.settings
        index, sample_id, ids, mask = result.index, result.sample_id, result.input_ids, result.loss_mask
        truncated = len(ids) > s.max_length
        if truncated:
            if s.overlong == "drop":
                report.dropped_overlong += 1
                report.note(index, sample_id, f"{len(ids)} tokens > max length {s.max_length}, dropped")
                return
            ids, mask = ids[:s.max_length], mask[:s.max_length]
            if not mask.any():
                report.reject(index, sample_id, "no_assistant_token_after_truncation",
                              f"no assistant token left after truncation to {s.max_length}")
                return
        if sample_id in self.seen:
            report.duplicate_ids += 1
            report.reject(index, sample_id, "duplicate_sample_id", f"duplicate sample id {sample_id!r}")
            return
        self.seen.add(sample_id)
        self.window.samples.append(Sample(sample_id, ids, mask))
        report.kept += 1
        report.truncated += truncated   # kept samples only: one rejected after its cut counts as rejected alone


def _chunks(rows: Iterator, window_rows: int, first_window: int) -> Iterator[tuple[int, list]]:
    """(window number, rows) chunks that never span two windows; rows of windows < first_window skipped."""
    chunk, current = [], None
    for item in rows:
        number = item.index // window_rows
        if number < first_window:
            continue
        if chunk and (number != current or len(chunk) >= CHUNK_ROWS):
            yield current, chunk
            chunk = []
        current = number
        chunk.append(item)
    if chunk:
        yield current, chunk


class WindowTokeniser:
    """Iterate over tokenised windows; tokenising runs ahead in a thread (+ processes).

    ``seen``: sample ids already planned (a resumed run), for the duplicate check.
    ``on_event(name, window)`` is called with "tokenised" as each window completes, ``on_rows(n)`` as each chunk
    of n rows is tokenised (progress within a window).
    Use as a context manager: leaving it stops the thread and the processes.
    """

    def __init__(self, dataset, settings: TokeniseSettings, workers: int, window_rows: int, first_window: int = 0,
                 seen: set[str] | None = None, on_event: Callable[[str, int], None] | None = None,
                 on_rows: Callable[[int], None] | None = None):
        if window_rows < 1:
            raise ValueError(f"window rows must be >= 1, got {window_rows}")
        if workers < 1:
            raise ValueError(f"tokenise workers must be >= 1, got {workers}")
        # opens the dataset now: a missing file fails here, not in the thread
        self.rows = dataset.iter_rows(window_rows) if isinstance(dataset, Mixture) else iter_rows(dataset)
        self.settings, self.workers, self.window_rows = settings, workers, window_rows
        self.first_window, self.seen = first_window, seen if seen is not None else set()
        self.on_event = on_event or (lambda name, window: None)
        self.on_rows = on_rows or (lambda rows: None)   # rows tokenised since the last call (the tokenise thread)
        self._out: queue.Queue = queue.Queue(maxsize=FINISHED_WINDOWS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenise", daemon=True)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> WindowTokeniser:
        _init(self.settings)   # here too: a template hsx cannot use fails now, with its own message
        if self.workers > 1:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=_init, initargs=(self.settings,))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        while self._thread.is_alive():   # unblock a thread waiting to hand over a window
            try:
                self._out.get(timeout=0.1)
            except queue.Empty:
                pass
        self._thread.join()
        if self._pool:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __iter__(self) -> Iterator[Window]:
        while True:
            item = self._out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._out.put(item, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def _results(self) -> Iterator[tuple[int, list[TokenisedRow | RejectedRow]]]:
        chunks = _chunks(self.rows, self.window_rows, self.first_window)
        if self._pool is None:
            for number, chunk in chunks:
                yield number, _encode_chunk(chunk)
            return
        in_flight: deque = deque()
        for number, chunk in chunks:
            in_flight.append((number, self._pool.submit(_encode_chunk, chunk)))
            while len(in_flight) >= IN_FLIGHT_CHUNKS * self.workers:
                done_number, future = in_flight.popleft()
                yield done_number, future.result()
        while in_flight:
            done_number, future = in_flight.popleft()
            yield done_number, future.result()

    def _run(self) -> None:
        try:
            builder = None
            for number, results in self._results():
                if self._stop.is_set():
                    return
                if builder is not None and builder.window.number != number:
                    self.on_event("tokenised", builder.window.number)
                    if not self._put(builder.window):
                        return
                    builder = None
                builder = builder or _WindowBuilder(number, self.settings, self.seen)
                for result in results:
                    builder.add(result)
                self.on_rows(len(results))
            if builder is not None:
                self.on_event("tokenised", builder.window.number)
                if not self._put(builder.window):
                    return
            self._put(None)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)
