"""The output format's version: readers refuse another with a message that says what to do, and one upgrade path
brings a run of the older format (as the job wrote it before the format had a version) to the current one."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvlm.format.schema import DATA_SCHEMA, FORMAT_KEY, FORMAT_VERSION, FormatError
from batchvlm.rundir.layout import DATA, QUARANTINE, RunLayout
from batchvlm.rundir.upgrade import SHARDS, _rewrite, check_run_format, run_format, upgrade_run
from batchvlm.training.reader import read_shard


def test_a_run_of_a_newer_format_is_refused_naming_what_to_do(tmp_path):
    layout = RunLayout(tmp_path)
    layout.marker.write_text(json.dumps({"format_version": FORMAT_VERSION + 1}))
    with pytest.raises(FormatError, match=rf"output format {FORMAT_VERSION + 1}, by a newer batchvlm.*upgrade batchvlm"):
        check_run_format(layout)
    with pytest.raises(FormatError, match="newer batchvlm"):
        upgrade_run(tmp_path)
    shard = tmp_path / "shard.parquet"
    pq.write_table(DATA_SCHEMA.empty_table().replace_schema_metadata({FORMAT_KEY: str(FORMAT_VERSION + 1)}), shard)
    with pytest.raises(FormatError, match=f"{shard} is written in output format {FORMAT_VERSION + 1}"):
        list(read_shard(shard))


CLIP_COLUMNS = {"video_spans", "video_grid_thw", "second_per_grid_ts", "video_num_tokens", "video_frame_indices",
                "video_frame_times", "video_embeds", "video_index", "video_paths", "video_deepstack_embeds"}


@pytest.mark.parametrize("version, clip_columns", [("2", CLIP_COLUMNS), ("3", {"video_deepstack_embeds"})])
def test_an_older_shard_is_rewritten_with_the_clip_columns_it_lacks_null(tmp_path, version, clip_columns):
    """Format 2 (before clips) lacks the clip columns and the quarantine's video_index, format 3 (before Qwen3-VL's
    clips) video_deepstack_embeds: the upgrade adds them, null, and keeps every other value."""
    from rows import data_row, quarantine_row

    for kind, row in ((DATA, data_row(id="a", input_ids=[1, 2])), (QUARANTINE, quarantine_row(id="b", check="x"))):
        schema = pa.schema([field for field in SHARDS[kind].schema if field.name not in clip_columns],
                           metadata={FORMAT_KEY: version})
        path = tmp_path / f"{kind}.parquet"
        pq.write_table(pa.Table.from_pylist([{k: v for k, v in row.items() if k in schema.names}], schema), path)
        _rewrite(path, SHARDS[kind])
        table = pq.read_table(path)
        assert table.schema.remove_metadata() == SHARDS[kind].schema
        assert table.schema.metadata[FORMAT_KEY.encode()] == str(FORMAT_VERSION).encode()
        written = table.to_pylist()[0]
        assert all(written[name] is None for name in clip_columns & set(written))
        assert {k: v for k, v in written.items() if k not in clip_columns} == {
            k: v for k, v in row.items() if k not in clip_columns}


@pytest.mark.parametrize("job", ["upgrade", "report"])
def test_a_run_dir_that_is_a_file_or_no_folder_ends_the_job_in_one_line_naming_it(job, tmp_path, monkeypatch, capsys):
    """Was a NotADirectoryError (a file) or a FormatError traceback (upgrade of a folder that does not exist)."""
    import importlib

    module = importlib.import_module(f"batchvlm.jobs.{job}")
    file = tmp_path / "notes.txt"
    file.write_text("a user's file")
    assert run_format(RunLayout(file)) is None
    for run_dir in (file, tmp_path / "nowhere"):
        monkeypatch.setattr("sys.argv", [f"{job}.py", f"run_dir={run_dir}"])
        with pytest.raises(SystemExit) as exited:
            module.main()
        error = capsys.readouterr().err.strip()
        assert exited.value.code == 2 and error.startswith("error: ") and str(run_dir) in error \
            and "\n" not in error, error
    assert file.read_text() == "a user's file" and sorted(tmp_path.iterdir()) == [file]
