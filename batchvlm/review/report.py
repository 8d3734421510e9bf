"""The failure report of a run: what was quarantined, why, and for a requeue run what the requeue fixed.

It also describes the written data for choosing training settings: tokens per image, sequence length
and aspect ratio over the committed data shards, in one streamed pass (batchvlm.review.distributions).

The quarantine shards that the manifests list are streamed batch by batch without their image
bytes; only counts, and the first `max_cards_per_check` rows of each check, are kept, so time and
memory stay flat in the size of the quarantine. The images of the kept rows are read in a second
pass, shard by shard, and turned into thumbnails (batchvlm.review.thumbnails). `python jobs/report.py`
prints `summary_text` and writes `review.html.render` to the run's report page (RunLayout.report_page).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from batchvlm.families import ModelConfig
from batchvlm.pipeline.decode import DecodeConfig
from batchvlm.format.schema import QUARANTINE_SCHEMA
from batchvlm.pipeline.preprocess import merged_stats
from batchvlm.review.distributions import Distribution, dropped_turns, value_counts, written_distributions
from batchvlm.review.thumbnails import Thumbnail, Thumbnailer
from batchvlm.rundir.dedup import committed_results, duplicate_rows
from batchvlm.rundir.durable import read_json
from batchvlm.rundir.layout import DATA, IDS, QUARANTINE, RunLayout
from batchvlm.rundir.manifest import Manifest, ManifestError, RunTotals, all_manifests, listed_shards
from batchvlm.rundir.upgrade import check_run_format
from batchvlm.rundir.workunits import read_plan
from batchvlm.sources import KINDS, source_class
from batchvlm.sources.files import parent_of
from batchvlm.sources.requeue import read_lineage

log = logging.getLogger("batchvlm")

ROW_COLUMNS = [name for name in QUARANTINE_SCHEMA.names if name != "image_bytes"]
BATCH_ROWS = 8192
TOP_MESSAGES = 10


class ReportError(ValueError):
    """The run directory cannot be reported on; the message says why."""


@dataclass
class Card:
    """One quarantined record shown in full: its quarantine row (images aside) and their thumbnails."""

    row: dict
    shard: Path | None
    index: int  # row in the shard, to find its image bytes in the second pass
    thumbnails: list[Thumbnail] = field(default_factory=list)
    by_offset: bool = False  # its row is a byte offset (JSON): it is named by `record`, its number in its input
    record: int | None = None  # None where an earlier unit of its input is not committed yet

    @property
    def place(self) -> str:
        """Where the record is in its input, as a person looks for it there."""
        if not self.by_offset:
            return f"row {self.row['row']}"
        number = "not counted yet" if self.record is None else f"{self.record:,}"
        return f"record {number} · byte {self.row['row']:,}"


@dataclass
class RequeueOutcome:
    """For a requeue run: where each requeued record ended up."""

    requeue_from: str
    fixed: list[dict]  # lineage entries now in data/
    still_quarantined: list[dict]  # lineage entries with "now_check" set
    not_found: list[dict]


@dataclass
class Report:
    run_dir: Path
    complete: bool
    records_in: int
    written: int
    quarantined: int  # counted in the quarantine shards themselves
    fallbacks: Counter  # check whose failure the preprocessing fell back on -> images
    max_cards_per_check: int
    by_check: Counter = field(default_factory=Counter)
    by_stage: Counter = field(default_factory=Counter)
    by_source: Counter = field(default_factory=Counter)
    messages: Counter = field(default_factory=Counter)  # (check, message with numbers as '#') -> records
    cards: dict[str, list[Card]] = field(default_factory=dict)
    requeue: RequeueOutcome | None = None
    was_check: dict[str, str] = field(default_factory=dict)  # requeue run: id -> the check it failed before
    placeholder: str = "<image>"
    written_data: list[Distribution] = field(default_factory=list)
    cut_conversations: tuple[int, int] = (0, 0)  # records written with trailing turns dropped, and the turns

    def cards_not_shown(self, check: str) -> int:
        return self.by_check[check] - len(self.cards.get(check, []))


def read_manifests(layout: RunLayout) -> list[Manifest]:
    if not layout.manifests.is_dir():
        raise ReportError(f"run_dir={str(layout.root)!r} is not a batchvlm run directory (no "
                          f"{layout.name_of(layout.manifests)}/ folder)")
    try:
        return all_manifests(layout)
    except ManifestError as error:
        raise ReportError(str(error)) from None


def build_report(run_dir: Path, max_cards_per_check: int = 50, thumbnails: bool = True) -> Report:
    layout = RunLayout(run_dir)
    check_run_format(layout)
    manifests = read_manifests(layout)
    success = read_json(layout.success)
    totals = RunTotals.of(manifests, committed_results(layout))
    report = Report(run_dir=run_dir, complete=success is not None, records_in=totals.records_in,
                    written=totals.written, quarantined=0, fallbacks=_fallbacks(success, manifests),
                    max_cards_per_check=max_cards_per_check)
    config = _run_config(layout)
    report.placeholder = config.get("dataset", {}).get("placeholder", report.placeholder)
    for _, shard in listed_shards(layout, QUARANTINE):
        _scan_shard(report, shard)
    _scan_duplicates(report, layout)
    report.written_data = written_distributions(layout)
    report.cut_conversations = dropped_turns(layout)
    if thumbnails:
        _attach_thumbnails(report, config)
    lineage = read_lineage(layout)
    kind = config.get("dataset", {}).get("kind")
    if kind in KINDS and source_class(kind).rows_are_offsets:
        _number_records(report, layout, manifests, counted=lineage is None)
    if lineage is not None:
        report.requeue = _requeue_outcome(layout, lineage)
        report.was_check = {entry["id"]: entry["check"] for entry in lineage["requeued"]}
    return report


def _number_records(report: Report, layout: RunLayout, manifests: list[Manifest], counted: bool) -> None:
    """Cards of a source whose rows are byte offsets get their record's number in its input: the records of its
    input's units before its own (each committed, else not counted yet), and those before it in its unit's ids file.
    A requeue run's units are chosen records, not ranges of an input (`counted` False): its cards keep their bytes."""
    by_unit = {manifest.unit: manifest for manifest in manifests}
    plan = read_plan(layout) if counted else None
    before = _records_before(plan, by_unit) if plan is not None and not plan.from_pattern else {}
    rows_of: dict[str, np.ndarray] = {}
    for card in (card for cards in report.cards.values() for card in cards):
        unit, card.by_offset = card.row["unit"], True
        first = 0 if plan is not None and plan.from_pattern else before.get(unit)  # a pattern's unit: its whole file
        if first is None or unit not in by_unit:
            continue
        if unit not in rows_of:
            ids = layout.listed(by_unit[unit].shards(IDS)[0].path)
            rows_of[unit] = np.sort(pq.read_table(ids, columns=["row"]).column("row").to_numpy())
        card.record = first + int(np.searchsorted(rows_of[unit], card.row["row"]))


def _records_before(plan, by_unit: dict[str, Manifest]) -> dict[str, int | None]:
    """Each unit's records before it in its input: those of its input's units that start before it, all committed
    (None where one is not)."""
    ranges: dict[str, list] = {}
    for unit in plan.units:
        ranges.setdefault(unit.source, []).append(unit)
    before: dict[str, int | None] = {}
    for input_units in ranges.values():
        so_far: int | None = 0
        for unit in sorted(input_units, key=lambda unit: unit.start):
            before[unit.unit_id] = so_far
            done = by_unit.get(unit.unit_id)
            so_far = None if so_far is None or done is None else so_far + done.records_in
    return before


def _fallbacks(success: dict | None, manifests: list[Manifest]) -> Counter:
    """Images the preprocessing redid on the CPU path, by check: the run's totals', else (a run not finished)
    the sum of the manifests, which carry them per unit."""
    counts = success["fallbacks"] if success is not None and "fallbacks" in success else \
        merged_stats([manifest.preprocess for manifest in manifests])["fallbacks"]
    return +Counter(counts)


def _run_config(layout: RunLayout) -> dict:
    return OmegaConf.to_container(OmegaConf.load(layout.config)) if layout.config.exists() else {}


def _scan_shard(report: Report, shard: Path) -> None:
    """Count one shard batch by batch, and keep the rows that still fit under their check's card cap."""
    offset, file = 0, pq.ParquetFile(shard)
    for batch in file.iter_batches(batch_size=BATCH_ROWS, columns=ROW_COLUMNS):
        report.quarantined += batch.num_rows
        for counter, column in ((report.by_check, "check"), (report.by_stage, "stage"), (report.by_source, "source")):
            counter.update(value_counts(batch.column(column)))
        # sizes and counts differ in every message of a kind: count the kinds, with numbers as '#'
        kinds = pc.replace_substring_regex(pc.fill_null(batch.column("message"), ""), r"\d+", "#")
        pairs = pc.binary_join_element_wise(batch.column("check"), kinds, "\x00")
        report.messages.update({tuple(key.split("\x00", 1)): n for key, n in value_counts(pairs).items()})
        shown = Counter({check: len(cards) for check, cards in report.cards.items()})
        chosen = []
        for index, check in enumerate(batch.column("check").to_pylist()):
            if shown[check] < report.max_cards_per_check:
                shown[check] += 1
                chosen.append(index)
        for index, row in zip(chosen, batch.take(chosen).to_pylist() if chosen else []):
            report.cards.setdefault(row["check"], []).append(Card(row, shard, offset + index))
        offset += batch.num_rows


def _scan_duplicates(report: Report, layout: RunLayout) -> None:
    """Later occurrences of an id that sit in data shards: set aside by the reader, so quarantined here."""
    for duplicate in duplicate_rows(layout):
        if duplicate["kind"] != DATA:
            continue  # already quarantined under its own check
        earlier = f"unit {duplicate['first_unit']}, row {duplicate['first_row']}"
        row = {name: None for name in ROW_COLUMNS} | {
            "id": duplicate["id"], "source": duplicate["source"], "row": duplicate["row"], "unit": duplicate["unit"],
            "stage": "source", "check": "source.duplicate_id", "exception_type": "CheckFailed",
            "message": f"id {duplicate['id']!r} appeared earlier ({earlier}); this later occurrence is left out",
            "expected": "a unique id", "observed": f"also at {earlier}", "image_paths": [], "text": ""}
        report.quarantined += 1
        report.by_check[row["check"]] += 1
        report.by_stage["source"] += 1
        report.by_source[row["source"]] += 1
        report.messages[(row["check"], "id appeared earlier; this later occurrence is left out")] += 1
        if len(report.cards.get(row["check"], [])) < report.max_cards_per_check:
            report.cards.setdefault(row["check"], []).append(Card(row, None, -1))


def _attach_thumbnails(report: Report, config: dict) -> None:
    cards_by_shard: dict[Path, list[Card]] = {}
    for cards in report.cards.values():
        for card in cards:
            if card.shard is not None:  # a duplicate's images are in its data shard, not kept for the report
                cards_by_shard.setdefault(card.shard, []).append(card)
    if not cards_by_shard:
        return
    image_root = config.get("dataset", {}).get("image_root")
    thumbnailer = Thumbnailer(DecodeConfig(**config.get("decode", {})), _planner(config),
                              root_of=lambda row: image_root or parent_of(row["source"]))
    try:
        for shard, cards in cards_by_shard.items():
            wanted = {card.index: card for card in cards}
            offset = 0
            for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=["image_bytes"]):
                here = [index for index in wanted if offset <= index < offset + batch.num_rows]
                images_here = batch.column("image_bytes").take([i - offset for i in here]).to_pylist() if here else []
                for index, images in zip(here, images_here):
                    card = wanted[index]
                    paths = card.row["image_paths"] or []
                    card.thumbnails = [thumbnailer(data, paths[i] if i < len(paths) else None, i, card.row)
                                       for i, data in enumerate(images or [])]
                offset += batch.num_rows
    finally:
        thumbnailer.close()


def _planner(config: dict):
    """The run's family plan (grid and tokens per image), when its family and checkpoint load here."""
    if "model" not in config:
        return None
    try:
        from batchvlm.families import load_family  # transformers loads only when there are cards to draw

        return load_family(ModelConfig(**config["model"])).plan
    except Exception as error:  # a checkpoint on another machine must not stop the report
        log.warning("grids not shown: the run's model does not load here (%s)", error)
        return None


def _column_by_id(layout: RunLayout, kind: str, column: str) -> dict[str, str]:
    """id -> one column's value, over the committed shards of `kind` (data or quarantine)."""
    found = {}
    for _, shard in listed_shards(layout, kind):
        for batch in pq.ParquetFile(shard).iter_batches(columns=["id", column]):
            found.update(zip(batch.column("id").to_pylist(), batch.column(column).to_pylist()))
    return found


def _requeue_outcome(layout: RunLayout, lineage: dict) -> RequeueOutcome:
    written = _column_by_id(layout, DATA, "source")
    quarantined = _column_by_id(layout, QUARANTINE, "check")
    fixed = [entry for entry in lineage["requeued"] if entry["id"] in written]
    still = [{**entry, "now_check": quarantined.get(entry["id"], "not committed yet")}
             for entry in lineage["requeued"] if entry["id"] not in written]
    return RequeueOutcome(lineage["requeue_from"], fixed, still, lineage["not_found"])


def summary_text(report: Report) -> str:
    lines = [f"run: {report.run_dir}" + ("" if report.complete else "  (NOT COMPLETE: some units not committed)"),
             f"records in: {report.records_in}  written: {report.written}  quarantined: {report.quarantined}  "
             f"fallbacks: {report.fallbacks.total()}"]
    lines += [f"  {count:>8}  fell back on {check}" for check, count in report.fallbacks.most_common()]
    for title, counter in (("by check", report.by_check), ("by stage", report.by_stage),
                           ("by source file", report.by_source)):
        lines.append(f"{title}:")
        lines += [f"  {count:>8}  {key}" for key, count in counter.most_common()]
    lines.append("most frequent messages:")
    lines += [f"  {count:>8}  [{check}] {message}" for (check, message), count in
              report.messages.most_common(TOP_MESSAGES)]
    lines += _written_data_lines(report.written_data)
    if report.cut_conversations[0]:
        lines.append(f"  conversations cut to whole turns (text.overflow=drop_turns): {report.cut_conversations[0]:,} "
                     f"records, {report.cut_conversations[1]:,} trailing turns left out")
    if report.requeue is not None:
        outcome = report.requeue
        lines.append(f"requeued from {outcome.requeue_from}: "
                     f"{len(outcome.fixed) + len(outcome.still_quarantined)} records, fixed: {len(outcome.fixed)}  "
                     f"still quarantined: {len(outcome.still_quarantined)}  not found: {len(outcome.not_found)}")
    return "\n".join(lines)


def _written_data_lines(distributions: list[Distribution]) -> list[str]:
    lines = ["written data (percentiles; the page has the histograms):"]
    for distribution in distributions:
        if not distribution.total:  # no record written, or text-only records: no image
            lines.append(f"  {distribution.title:<31}none")
            continue
        quantiles = "  ".join(f"{name} {value}" for name, value in distribution.percentiles())
        lines.append(f"  {distribution.title:<31}{quantiles}  ({distribution.total:,} {distribution.per})")
    return lines
