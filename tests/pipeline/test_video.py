"""Video decoding with PyAV on clips made here: the header read before any frame, times from pts, the sampled frames
decoded in order, and each way a clip goes wrong quarantined under its named check with its evidence."""

from __future__ import annotations

import numpy as np
import pytest

from batchvlm.checks import CheckFailed
from batchvlm.config import ConfigError
from batchvlm.pipeline.video import VideoConfig, check_budget, decode_frames, probe
from clips import frame_pixels, make_audio_only, make_audio_with_cover_art, make_clip, make_size_change

LIMITS = VideoConfig()


def failed_check(data: bytes, limits: VideoConfig = LIMITS, indices=None) -> CheckFailed:
    with pytest.raises(CheckFailed) as raised:
        header = probe(data, limits)
        decode_frames(data, header, indices or list(range(header.frames)), limits)
    return raised.value


@pytest.mark.parametrize("codec, container, frames, fps, height, width", [
    ("libx264", "mp4", 31, 10, 64, 96),  # B-frames: packets out of presentation order
    ("mpeg4", "mp4", 9, 30, 48, 80),
    ("libvpx", "webm", 17, 25, 64, 96),  # no frame count in the header
    ("libvpx-vp9", "matroska", 7, 24, 96, 64),
])
def test_the_header_gives_codec_size_rate_frames_and_duration_before_any_frame_is_decoded(
        codec, container, frames, fps, height, width):
    header = probe(make_clip(frames, fps, height, width, codec, container), LIMITS)
    assert (header.codec, header.height, header.width, header.fps, header.frames) == (
        codec.removeprefix("lib").replace("vpx-vp9", "vp9").replace("vpx", "vp8").replace("x264", "h264"),
        height, width, fps, frames)
    assert header.timestamps_s == pytest.approx([i / fps for i in range(frames)], abs=1e-3)
    assert header.duration_s == pytest.approx(frames / fps, abs=1e-3)
    assert not header.variable_frame_rate


def test_the_sampled_frames_come_back_in_the_order_asked_with_their_pts_times():
    data = make_clip(31, fps=10)
    header = probe(data, LIMITS)
    video = decode_frames(data, header, [0, 7, 15, 22, 30], LIMITS)
    assert video.frames.shape == (5, 64, 96, 3) and video.frames.dtype == np.uint8
    assert video.timestamps_s == pytest.approx([0.0, 0.7, 1.5, 2.2, 3.0])
    assert [closest_index(frame, 31) for frame in video.frames] == [0, 7, 15, 22, 30]


def closest_index(frame: np.ndarray, frames: int) -> int:
    """The encoded frame a decoded one is nearest to (the codec loses a few levels; neighbours differ by 9)."""
    height, width = frame.shape[:2]
    return min(range(frames), key=lambda i: np.abs(frame.astype(int) - frame_pixels(i, height, width)).mean())


def test_a_variable_frame_rate_is_flagged_and_each_frame_keeps_its_own_time():
    times_ms = [0, 100, 200, 400, 500, 900, 1000]
    data = make_clip(7, pts=times_ms)
    header = probe(data, LIMITS)
    assert header.variable_frame_rate
    video = decode_frames(data, header, [3, 5], LIMITS)
    assert video.timestamps_s == pytest.approx([0.4, 0.9])  # idx / fps would say 0.3 and 0.5
    assert [closest_index(frame, 7) for frame in video.frames] == [3, 5]


def test_a_rotated_clip_decodes_upright():
    data = make_clip(4, height=64, width=96, rotation=90)
    header = probe(data, LIMITS)
    video = decode_frames(data, header, [0, 3], LIMITS)
    assert video.rotation == 90 and video.frames.shape == (2, 96, 64, 3)
    # turned a quarter counter-clockwise: the marked top-left corner is now bottom-left
    assert np.allclose(video.frames[1, -1, 0], (24, 0, 231), atol=12)


def test_an_audio_track_beside_the_video_is_listed_and_left_alone():
    data = make_clip(12, audio=True)
    header = probe(data, LIMITS)
    assert header.streams == ("0:video:h264", "1:audio:aac") and header.frames == 12
    assert decode_frames(data, header, [0, 11], LIMITS).frames.shape[0] == 2


def test_an_audio_only_file_is_no_stream_with_its_streams_listed():
    failure = failed_check(make_audio_only())
    assert (failure.check, failure.observed) == ("video.no_stream", "0:audio:aac")


def test_audio_with_cover_art_is_no_stream_the_picture_listed():
    failure = failed_check(make_audio_with_cover_art())
    assert (failure.check, failure.observed) == ("video.no_stream", "0:audio:aac, 1:video:mjpeg")


def test_a_video_stream_without_frames_is_too_few_frames():
    failure = failed_check(make_clip(0, audio=True, container="matroska"))
    assert failure.check == "video.too_few_frames" and "0 frames" in failure.observed


def test_bytes_that_are_no_container_are_unreadable_with_their_first_bytes():
    failure = failed_check(b"<html>not a clip</html>" * 20)
    assert failure.check == "video.unreadable" and "<html>" in failure.observed


def test_an_mp4_cut_before_its_index_is_unreadable():
    data = make_clip(30)  # the muxer writes the moov index last
    assert failed_check(data[: len(data) // 2]).check == "video.unreadable"


@pytest.mark.parametrize("codec, container, options", [
    ("libvpx", "webm", {}),
    ("mpeg4", "matroska", {}),
    ("libx264", "mp4", {"movflags": "frag_keyframe+empty_moov"}),  # fragmented: readable up to the cut
])
def test_a_clip_cut_short_is_truncated_from_its_stated_length(codec, container, options):
    data = make_clip(60, codec=codec, container=container, options=options)
    failure = failed_check(data[: len(data) * 2 // 3])
    assert failure.check == "video.truncated" and failure.expected.startswith("6.0")


def test_a_frame_count_the_stream_does_not_hold_is_truncated():
    data = make_clip(20)
    header = probe(data, LIMITS)
    with pytest.raises(CheckFailed, match="video.too_few_frames"):
        check_budget(header, [0, 25], LIMITS)


def test_an_hour_long_header_is_too_long_before_a_packet_is_read():
    data = make_clip(12, fps=10)
    assert failed_check(data, VideoConfig(max_duration_s=1.0)).check == "video.too_long"
    failure = failed_check(data, VideoConfig(max_frames=10))
    assert (failure.check, failure.observed) == ("video.too_long", "12 frames")


def test_frames_over_the_decoded_byte_cap_are_a_decode_bomb_before_any_is_decoded():
    data = make_clip(10, height=64, width=96)
    limits = VideoConfig(max_decoded_bytes=4 * 64 * 96 * 3)
    header = probe(data, limits)
    assert decode_frames(data, header, [0, 3, 6, 9], limits).frames.nbytes == 4 * 64 * 96 * 3
    with pytest.raises(CheckFailed, match="video.decode_bomb"):
        decode_frames(data, header, [0, 2, 4, 6, 8], limits)
    assert failed_check(data, VideoConfig(max_frame_pixels=64 * 95)).check == "video.decode_bomb"


def test_a_frame_rate_the_header_lacks_is_fps_invalid():
    assert failed_check(make_clip(6, fps=10), VideoConfig(max_fps=5)).check == "video.fps_invalid"


def test_limits_that_cannot_work_name_their_key():
    with pytest.raises(ConfigError, match="video.max_decoded_bytes"):
        VideoConfig(max_decoded_bytes=0)
    # nan: every clip would fail `<= nan` as video.too_long; inf: the decoder's wait on its child overflows
    for key in ("max_duration_s", "timeout_s", "max_fps"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=rf"^video.{key}={value!r} must be a finite number > 0"):
                VideoConfig(**{key: value})


def test_sampled_frames_of_two_sizes_are_frame_size_and_one_size_decodes():
    data = make_size_change()
    header = probe(data, LIMITS)
    assert (header.height, header.width, header.frames) == (64, 96, 20)
    assert decode_frames(data, header, [12, 15], LIMITS).frames.shape == (2, 96, 128, 3)
    with pytest.raises(CheckFailed, match="video.frame_size") as raised:
        decode_frames(data, header, [0, 15], LIMITS)
    assert (raised.value.expected, raised.value.observed) == ("96x64", "128x96")


def test_frames_larger_than_the_header_states_are_held_to_the_cap_by_their_real_size():
    data = make_size_change()
    limits = VideoConfig(max_decoded_bytes=2 * 64 * 96 * 3)  # the header's two frames fit, the real ones do not
    header = probe(data, limits)
    with pytest.raises(CheckFailed, match="video.decode_bomb"):
        decode_frames(data, header, [12, 15], limits)


def test_a_raw_stream_without_timestamps_is_fps_invalid_not_timed_by_index():
    """An H.264 elementary stream has no container to time its frames: they are not given index / fps times."""
    failure = failed_check(make_clip(12, container="h264"))
    assert failure.check == "video.fps_invalid" and "12 frames without one" in failure.observed


# -- a clip through the job's decoder: the image's confinement, the isolated child ---------------------------------
def every_third(total: int, fps: float) -> list[int]:
    return list(range(0, total, 3))


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_the_decoder_reads_a_clip_under_the_image_root_and_gives_its_sampled_frames(tmp_path, isolation):
    """A clip named by path under its root, decoded in the isolated child (its frames back through the arena) or
    in-process: the sampler's frames, as decode_frames gives them from the same bytes."""
    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    data = make_clip(20, fps=10)
    (tmp_path / "clip.mp4").write_bytes(data)
    decoder = Decoder(DecodeConfig(isolation=isolation))
    try:
        clip = decoder.clip(ImageRef(path=str(tmp_path / "clip.mp4"), root=str(tmp_path)), 0, every_third)
    finally:
        decoder.close()
    header = probe(data, LIMITS)
    assert clip.header == header and clip.decoded.indices == tuple(range(0, 20, 3))
    assert np.array_equal(clip.decoded.frames, decode_frames(data, header, list(range(0, 20, 3)), LIMITS).frames)


def test_a_clip_past_the_decoders_arena_crosses_the_pipe_as_raw_bytes_intact(monkeypatch):
    """Frames larger than the child's arena come back through the pipe as raw bytes after the answer (a pickle would
    be a second whole copy of them in the child): the same frames, the pipe left in step for the next clip."""
    from batchvlm.pipeline import decode
    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    data = make_clip(20, fps=10)
    monkeypatch.setattr(decode, "ARENA_LIMIT", 1000)
    decoder = Decoder(DecodeConfig())
    try:
        clip = decoder.clip(ImageRef(data=data), 0, every_third)
        again = decoder.clip(ImageRef(data=data), 0, every_third)  # the pipe holds nothing left over
    finally:
        decoder.close()
    expected = decode_frames(data, probe(data, LIMITS), list(range(0, 20, 3)), LIMITS).frames
    assert expected.nbytes > 1000 and np.array_equal(clip.decoded.frames, expected)
    assert np.array_equal(again.decoded.frames, expected) and clip.decoded.frames.flags.writeable


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_clip_outside_the_image_root_or_over_its_byte_limit_is_never_decoded(tmp_path, isolation):
    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    root, outside = tmp_path / "root", tmp_path / "secret.mp4"
    root.mkdir()
    data = make_clip(6)
    outside.write_bytes(data)
    (root / "clip.mp4").write_bytes(data)
    (root / "link.mp4").symlink_to(outside)
    decoder = Decoder(DecodeConfig(isolation=isolation, max_bytes=len(data) - 1), VideoConfig(max_bytes=len(data) - 1, timeout_s=10))
    try:
        for path in (outside, root / "link.mp4", root / ".." / "secret.mp4"):
            with pytest.raises(CheckFailed) as refused:
                decoder.clip(ImageRef(path=str(path), root=str(root)), 0, every_third)
            assert refused.value.check == "decode.path_outside_root", path
        with pytest.raises(CheckFailed) as refused:
            decoder.clip(ImageRef(path=str(root / "clip.mp4"), root=str(root)), 1, every_third)
        assert refused.value.check == "video.too_many_bytes" and "video.max_bytes" in refused.value.message
        assert refused.value.observed == f"{len(data)} bytes"
    finally:
        decoder.close()
    # the image limit is decode.max_bytes alone: a clip's limit is its own
    roomy = Decoder(DecodeConfig(isolation=isolation, max_bytes=len(data) - 1), VideoConfig(timeout_s=10))
    try:
        assert roomy.clip(ImageRef(data=data), 0, every_third).decoded.indices == (0, 3)
    finally:
        roomy.close()


def test_a_clip_that_crashes_or_hangs_the_decoder_costs_that_clip_and_the_next_decodes(monkeypatch):
    import hashlib

    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    crash, hang, good = make_clip(6, fps=10), make_clip(6, fps=12), make_clip(9, fps=10)
    digest = lambda data: hashlib.sha256(data).hexdigest()[:16]  # noqa: E731
    monkeypatch.setenv("BATCHVLM_FAULTS", f"decode.crash={digest(crash)},decode.hang={digest(hang)}")
    decoder = Decoder(DecodeConfig(), VideoConfig(timeout_s=0.5))
    try:
        for data, check in ((crash, "video.crashed"), (hang, "video.timeout")):
            with pytest.raises(CheckFailed) as failed:
                decoder.clip(ImageRef(data=data), 2, every_third)
            assert failed.value.check == check and failed.value.image_index == 2
        assert decoder.clip(ImageRef(data=good), 3, every_third).decoded.indices == (0, 3, 6)
    finally:
        decoder.close()


def collecting_every_third(total: int, fps: float) -> list[int]:
    """every_third, after a full garbage collection in the process that samples (the decoder's child)."""
    import gc

    gc.collect()
    return every_third(total, fps)


def test_a_child_forked_beside_garbage_holding_ffmpeg_threads_never_frees_it_and_answers():
    """An in-process decode that fails inside the frame loop leaves its stream (and FFmpeg's frame threads, alive in
    this process only) in a reference cycle; a child forked before this process collects it must not free it: there
    avcodec_free_context waits for threads the child does not have, forever (the test's former intermittent hang)."""
    import gc

    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    failure = failed_check(make_size_change(), indices=[0, 15])  # raised in the loop: its traceback holds the stream
    assert failure.check == "video.frame_size"
    failure.cycle = failure  # garbage now, collected only by the cycle collector
    del failure
    decoder = Decoder(DecodeConfig(), VideoConfig(timeout_s=10))
    try:
        assert decoder.clip(ImageRef(data=make_clip(9)), 0, collecting_every_third).decoded.indices == (0, 3, 6)
    finally:
        decoder.close()
        gc.collect()


def test_a_clip_that_fails_in_the_child_is_quarantined_with_its_video_check():
    from batchvlm.pipeline.decode import DecodeConfig, Decoder
    from batchvlm.records import ImageRef

    decoder = Decoder(DecodeConfig())
    try:
        with pytest.raises(CheckFailed) as failed:
            decoder.clip(ImageRef(data=b"<html>not a clip</html>"), 0, every_third)
        assert failed.value.check == "video.unreadable"
        with pytest.raises(CheckFailed) as failed:
            decoder.clip(ImageRef(data=make_audio_only()), 0, every_third)
        assert failed.value.check == "video.no_stream"
    finally:
        decoder.close()


def test_the_video_config_names_its_key_and_declares_every_fields_effect():
    from batchvlm.config import declared

    with pytest.raises(ConfigError, match="video.timeout_s"):
        VideoConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="video.max_bytes"):
        VideoConfig(max_bytes=-1)
    assert set(declared(VideoConfig())) == {"max_bytes", "max_duration_s", "max_frames", "max_frame_pixels",
                                            "max_decoded_bytes", "max_fps", "timeout_s"}
