"""What the written data looks like, for choosing training settings: tokens per image, sequence length
and aspect ratio, over the committed data shards.

One streamed pass reads four narrow columns batch by batch and keeps exact counts per distinct value.
Distinct values are few (token counts follow the grids, lengths are bounded by the longest sequence,
aspect ratios are rounded in log space), so memory stays flat in the number of rows, percentiles are
exact, and the histogram bins are chosen once the whole range is known.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchvlm.rundir.dedup import excluded_rows
from batchvlm.rundir.layout import DATA, RunLayout
from batchvlm.rundir.manifest import listed_shards

BATCH_ROWS = 8192
HISTOGRAM_BINS = 16
ASPECT_LOG2_DECIMALS = 3  # ratios kept to 0.07%: at most a few thousand distinct values
PERCENTILES = (50, 90, 99)


@dataclass
class Distribution:
    """Exact counts of one quantity: value -> how many images or records have it."""

    title: str
    per: str  # what one count is: "images" or "records"
    counts: Counter
    log_bins: bool = False  # ratios spread multiplicatively: 1/4 is as far from 1 as 4

    @property
    def total(self) -> int:
        return self.counts.total()

    def percentile(self, q: float) -> float:
        """The smallest value at or below which q% of the counts lie."""
        rank, seen = q / 100 * self.total, 0
        for value in sorted(self.counts):
            seen += self.counts[value]
            if seen >= rank:
                return value
        raise ValueError(f"{self.title}: no values")

    def percentiles(self) -> list[tuple[str, str]]:
        """(name, formatted value) for each of PERCENTILES and the max."""
        named = [(f"p{q}", self.percentile(q)) for q in PERCENTILES] + [("max", max(self.counts))]
        return [(name, self.value(value)) for name, value in named]

    def histogram(self, bins: int = HISTOGRAM_BINS) -> list[tuple[float, float, int]]:
        """(low, high, count) per bin, low included, high excluded: whole-number bins for counts, bins of equal
        width in log2 for ratios."""
        scale = math.log2 if self.log_bins else float
        low, high = scale(min(self.counts)), scale(max(self.counts))
        if self.log_bins:
            width = (high - low) / bins or 1.0
            edges = [2.0 ** (low + i * width) for i in range(bins + 1)]
        else:
            width = math.ceil((high - low + 1) / bins)
            bins = math.ceil((high - low + 1) / width)
            edges = [int(low) + i * width for i in range(bins + 1)]
        tally = [0] * bins
        for value, count in self.counts.items():
            tally[min(int((scale(value) - low) / width), bins - 1)] += count  # the top log edge holds the max
        return [(edges[i], edges[i + 1], n) for i, n in enumerate(tally)]

    def label(self, low: float, high: float) -> str:
        if self.log_bins:
            return f"{low:.2f} - {high:.2f}"
        return f"{low:,}" if high - low == 1 else f"{low:,} - {high - 1:,}"

    def value(self, value: float) -> str:
        return f"{value:.2f}" if self.log_bins else f"{value:,}"


def written_distributions(layout: RunLayout) -> list[Distribution]:
    """Tokens per image, sequence length and aspect ratio of the committed data, leaving out the later
    occurrences of an id as read_run does; empty for a run with no rows."""
    tokens, lengths, aspects = Counter(), Counter(), Counter()
    excluded = excluded_rows(layout)
    # token_tags has one entry per token like input_ids, at a quarter of its bytes
    columns = ["row", "image_num_tokens", "token_tags", "original_size"]
    for unit, shard in listed_shards(layout, DATA):
        for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=columns):
            if unit in excluded:
                batch = batch.filter(pc.invert(pc.is_in(batch.column("row"), pa.array(sorted(excluded[unit])))))
            tokens.update(value_counts(pc.list_flatten(batch.column("image_num_tokens"))))
            lengths.update(value_counts(pc.list_value_length(batch.column("token_tags"))))
            aspects.update(_aspect_counts(batch.column("original_size")))
    return [Distribution("tokens per image", "images", tokens),
            Distribution("sequence length (tokens)", "records", lengths),
            Distribution("aspect ratio (width / height)", "images", aspects, log_bins=True)]


def dropped_turns(layout: RunLayout) -> tuple[int, int]:
    """(records, turns): the conversations text.overflow=drop_turns cut to fewer whole turns, and the turns they lost,
    over the committed data shards (none in a run of plain texts)."""
    records = turns = 0
    for _, shard in listed_shards(layout, DATA):
        for batch in pq.ParquetFile(shard).iter_batches(batch_size=BATCH_ROWS, columns=["dropped_turns"]):
            counts = pc.fill_null(batch.column(0), 0)
            records += pc.sum(pc.greater(counts, 0).cast(pa.int64())).as_py() or 0
            turns += pc.sum(counts).as_py() or 0
    return records, turns


def value_counts(values: pa.Array) -> dict:
    """Distinct value -> how often it occurs, for one Arrow column."""
    return {item["values"].as_py(): item["counts"].as_py() for item in pc.value_counts(values)}


def _aspect_counts(original_size: pa.Array) -> dict[float, int]:
    """Per image (height, width) -> width / height, rounded in log2 (a 1x3000 strip stays apart from 1x2000)."""
    sizes = pc.list_flatten(pc.list_flatten(original_size)).to_numpy(zero_copy_only=False).reshape(-1, 2)
    if not len(sizes):
        return {}
    log_ratios = np.round(np.log2(sizes[:, 1] / sizes[:, 0]), ASPECT_LOG2_DECIMALS)
    ratios, counts = np.unique(np.exp2(log_ratios), return_counts=True)
    return dict(zip(ratios.tolist(), counts.tolist()))
