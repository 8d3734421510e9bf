"""The worker side of the job: in DataLoader worker processes, claim a unit and read it, and decode, plan and lay
out each of its records, so that a decoder's crash or hang costs one record and the device never waits on the CPU.

A worker yields, per unit it wins, `UnitStart`, each record prepared (or quarantined), and `UnitEnd`.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader, IterableDataset

from batchvlm.checks import CheckFailed, failure
from batchvlm.config import JobConfig
from batchvlm.faults import crash_point
from batchvlm.pipeline.chat import ChatRenderer
from batchvlm.pipeline.decode import Decoder
from batchvlm.pipeline.tokens import attach_positions, build_layout, place_images, require_fits
from batchvlm.records import PreparedRecord, QuarantinedRecord, SourceRecord, Turn, UnitEnd, UnitStart, WorkUnit
from batchvlm.rundir.claims import Claims
from batchvlm.rundir.layout import RunLayout
from batchvlm.sources import Source
from batchvlm.sources.conversations import place_conversation_images


def prepare(record: SourceRecord, family, job: JobConfig, decoder: Decoder,
            chat: ChatRenderer | None = None) -> PreparedRecord | QuarantinedRecord:
    try:
        if chat is None:
            content = place_images(record.text, job.dataset.placeholder, len(record.images),
                                   job.dataset.missing_placeholder)
        else:
            content = place_conversation_images(record.turns, len(record.images), job.dataset.missing_placeholder)
        images = [decoder(ref, index) for index, ref in enumerate(record.images)]
        return plan_and_lay_out(record, content, images, family, job, chat)
    except CheckFailed as failed:
        return QuarantinedRecord(record, failed.to_failure())


def plan_and_lay_out(record: SourceRecord, content: str | list[Turn], images: list, family, job: JobConfig,
                     chat: ChatRenderer | None = None) -> PreparedRecord:
    """The plan of each decoded image and the record's token layout: of a text, or of a conversation's turns rendered
    with its chat template (raises CheckFailed)."""
    plans = [family.plan(image.height, image.width) for image in images]
    if chat is None:
        layout = build_layout(content, job.dataset.placeholder, plans, family)
        require_fits(layout, job.text.max_tokens)
    else:
        layout = chat.lay_out(content, plans)
        kept = len(layout.image_spans)  # the images of turns that text.overflow=drop_turns left out are not embedded
        images, plans = images[:kept], plans[:kept]
    attach_positions(layout, plans, family)
    return PreparedRecord(source=record, images=images, plans=plans, layout=layout)


def checked_id(record: SourceRecord, unit: WorkUnit, seen: set) -> QuarantinedRecord | None:
    """The source's checks of a row as read: it has an id, not seen earlier in the unit, and no source.* failure."""
    if record.id is None:
        record.id = f"{unit.source}#{record.row}"
        return QuarantinedRecord(record, failure("source.missing_id", "the id column is empty for this row",
                                                 expected="a unique, non-empty id", observed=repr(record.id)))
    if record.failure is not None:
        return QuarantinedRecord(record, record.failure)
    if record.id in seen:
        return QuarantinedRecord(record, failure("source.duplicate_id", f"id {record.id!r} appeared earlier in this "
                                                 "unit", expected="a unique, non-empty id", observed=repr(record.id)))
    seen.add(record.id)
    return None


class PreparedStream(IterableDataset):
    """Each worker claims units one at a time (rundir.claims) and yields, per unit it wins, the start marker, its
    records prepared, and the end marker. Units committed meanwhile are skipped."""

    def __init__(self, source: Source, units: list[WorkUnit], family, job: JobConfig, claims: Claims,
                 layout: RunLayout, chat: ChatRenderer | None = None):
        self.source, self.units, self.family, self.job, self.chat = source, units, family, job, chat
        self.claims, self.layout = claims, layout
        self.decoder = Decoder(job.decode)

    def __iter__(self):
        try:
            yield from self._prepared()
        finally:
            self.decoder.close()

    def _committed(self, unit: WorkUnit) -> bool:
        return self.layout.manifest(unit.unit_id).exists()

    def _prepared(self):
        for unit in self.units:
            if self._committed(unit) or (claim := self.claims.try_claim(unit.unit_id)) is None:
                continue
            if self._committed(unit):  # committed by a holder that outlived its lease
                continue
            yield UnitStart(unit, claim)
            count, seen = 0, set()
            for record in self.source.records(unit):
                crash_point("decode")
                count += 1
                yield checked_id(record, unit, seen) or prepare(record, self.family, self.job, self.decoder, self.chat)
            yield UnitEnd(unit, count)


def _keep(item):
    return item


def prepared_units(stream: PreparedStream, num_workers: int, prefetch: int) -> Iterator:
    """The stream run in `num_workers` DataLoader worker processes (0: inline, for debugging; the decoder still
    forks its child on first use)."""
    workers = min(num_workers, len(stream.units))
    if workers == 0:
        return iter(stream)
    return iter(DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=_keep, prefetch_factor=prefetch,
                           persistent_workers=False))
