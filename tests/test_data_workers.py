"""data.num_workers: VLM micro batches made ahead in worker threads equal, bit for bit, those made in the training
process (num_workers=0): every tensor of the batch, the data position after each batch, a resume from a
position saved mid-prefetch, the skipped-row counts, the error a bad file raises, and the threads' shutdown.
The last test trains tiny_vlm with workers, stops it with a signal and resumes it to the losses of a run
without workers. CPU."""

import shutil
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from qwenft.data.vlm import build_vlm_data, load_processor
from qwenft.data.workers import THREAD_NAME

try:
    import av  # the test extra installs PyAV; without it the rows have frame-list videos only
except ImportError:
    av = None

KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "padding_mask", "pixel_values", "image_grid_thw",
        "pixel_values_videos", "video_grid_thw")


@pytest.fixture(scope="module")
def proc(tmp_path_factory):
    return load_processor("tiny_vlm", cache_dir=tmp_path_factory.mktemp("qwenft_cache"))


def noise(n, height, width, seed) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, 255, (n, height, width, 3)).astype(np.uint8)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Pictures of several sizes, frame lists, a video file (with PyAV), and a broken picture."""
    root = tmp_path_factory.mktemp("worker_data")
    for i, (h, w) in enumerate([(20, 30), (50, 170), (200, 150), (64, 96), (70, 70)]):
        Image.fromarray(noise(1, h, w, i)[0]).save(root / f"pic{i}.png")
    for name, (n, h, w) in {"a": (4, 40, 40), "b": (5, 50, 70), "c": (6, 32, 48)}.items():
        (root / name).mkdir()
        for i, frame in enumerate(noise(n, h, w, n + h)):
            Image.fromarray(frame).save(root / name / f"{i}.png")
    if av is not None:
        with av.open(str(root / "clip.mp4"), "w") as container:
            stream = container.add_stream("mpeg4", rate=10)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for frame in noise(23, 48, 64, 7):
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    return root


def chat(*parts, reply="A reply."):
    return {"messages": [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": reply}]}


def image(src):
    return {"type": "image", "image": src}


def video(name, n, **options):
    return {"type": "video", "video": [f"{name}/{i}.png" for i in range(n)], **options}


def text(s):
    return {"type": "text", "text": s}


def rows():
    """Images, videos, both in one row, text alone; one bad image row and one bad video row."""
    good = [chat(image(f"pic{i}.png"), text(f"What is {i}?"), reply=f"Picture {i}.") for i in range(5)]
    good += [chat(video("a", 4), text("Where?"), reply="Left."), chat(video("b", 5, fps=1), text("And?"), reply="Up."),
             chat(image("pic3.png"), video("c", 6, timestamps=[0, 1, 2, 4, 5, 6]), text("Both?"), reply="Yes."),
             chat(text("No picture."), reply="Fine.")]
    if av is not None:
        good.append(chat({"type": "video", "video": "clip.mp4"}, text("Moving?"), reply="It moves."))
    bad = [chat(image("broken.png"), text("?")), chat(video("a", 3) | {"video": ["a/0.png", "b/1.png"]})]
    return good[:4] + bad[:1] + good[4:] + bad[1:]


def build(proc, files, num_workers, dp_rank=0, prefetch=None, rows_=None):
    return build_vlm_data(rows_ or rows(), proc, seq_len=128, micro_batch_size=1, dp_rank=dp_rank, dp_size=2,
                          seed=3, base_dir=files, num_workers=num_workers, prefetch=prefetch)


def assert_same_batch(got, expected):
    assert set(got) == set(KEYS) == set(expected)
    for key in KEYS:
        assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), key


def data_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME)]


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_workers_give_the_batches_positions_and_counts_of_no_workers(proc, files, dp_rank):
    """Ten micro batches (over three epochs) with 2 workers, 3 ahead, equal those made in `next`, as do the
    position after each and the skip counts; a resume from a position saved while batches were being made ahead
    (into a new stream, and into the same one, rewound) continues the same batches."""
    reference = build(proc, files, 0, dp_rank)
    expected, positions = [], []
    for _ in range(10):
        expected.append(next(reference))
        positions.append(reference.state_dict())
    assert reference.epoch >= 2 and reference.skipped == {"image_undecodable": 1, "video_undecodable": 1}
    assert sum(int(b["video_grid_thw"].shape[0]) for b in expected) >= 6  # videos and images in most batches

    data = build(proc, files, 2, dp_rank, prefetch=3)
    assert data.skipped == reference.skipped and data.num_documents == reference.num_documents
    for k in range(4):
        assert_same_batch(next(data), expected[k])
        assert data.state_dict() == positions[k]
    saved = data.state_dict()  # three micro batches are being made ahead of it

    resumed = build(proc, files, 2, dp_rank, prefetch=3)
    resumed.load_state_dict(saved)
    for k in range(4, 10):
        assert_same_batch(next(resumed), expected[k])
        assert resumed.state_dict() == positions[k]
    resumed.close()

    data.load_state_dict(positions[1])  # rewound: what was made ahead of the old position is dropped
    for k in range(2, 10):
        assert_same_batch(next(data), expected[k])
    data.close()
    assert not data_threads()


def test_a_workers_error_is_the_error_without_workers(proc, files, tmp_path):
    """A picture that breaks after start-up stops the stream at the same micro batch, with the same exception
    type and one-line message, and the same position, as without workers."""
    shutil.copytree(files, tmp_path / "data")
    good = [chat(image(f"pic{i}.png"), text("?"), reply=f"Picture {i}.") for i in range(5)]
    outcomes = []
    for num_workers in (0, 2):
        data = build(proc, tmp_path / "data", num_workers, prefetch=4, rows_=good)
        batches = 0
        (tmp_path / "data" / "pic4.png").rename(tmp_path / "data" / "kept.png")
        try:
            with pytest.raises(ValueError) as e:
                for _ in range(10):
                    next(data)
                    batches += 1
        finally:
            (tmp_path / "data" / "kept.png").rename(tmp_path / "data" / "pic4.png")
            data.close()
        outcomes.append((batches, type(e.value), str(e.value), data.state_dict()))
    assert outcomes[0] == outcomes[1]
    batches, kind, message, _ = outcomes[0]
    assert batches < 10 and kind.__name__ == "BadRow" and "\n" not in message
    assert message.startswith(f"image {str(tmp_path / 'data' / 'pic4.png')!r} cannot be decoded")
    assert not data_threads()


def test_close_stops_the_threads_and_next_starts_them_again(proc, files):
    reference = build(proc, files, 0)
    data = build(proc, files, 2)
    assert not data_threads()  # nothing starts before the first batch (a fork before it copies no thread)
    assert_same_batch(next(data), next(reference))
    assert 1 <= len(data_threads()) <= 2
    data.close()
    assert not data_threads()
    assert_same_batch(next(data), next(reference))
    data.close()
    assert not data_threads()


@pytest.mark.parametrize("value, message", [
    ("-1", "data.num_workers=-1 must be an integer >= 0 (threads making micro batches ahead; 0 = make each in the "
           "training process when it is needed)"),
    ("two", "data.num_workers='two' is not valid; expected an integer"),
])
def test_bad_num_workers_is_one_line(proc, value, message):
    from qwenft.conf import compose

    with pytest.raises(ValueError) as e:
        compose(["recipe=tiny_vlm", f"data.num_workers={value}"])
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^data.num_workers=-1 must be an integer >= 0 "):
        build_vlm_data([chat(text("x"))], proc, seq_len=64, micro_batch_size=1, num_workers=-1)


def _train_listing_threads(rank, world_size, overrides, stop_after=None):
    """helpers.train, with a thread that sends this process SIGTERM once metrics.jsonl shows step `stop_after`
    (None: no signal); its result's `preempted` and step count, and the data threads alive when it returned."""
    import os
    import signal
    import time
    from pathlib import Path

    from helpers import compose, read_metrics, train

    run_dir = Path(compose(overrides).run_dir)

    def stop():
        while not any(r.get("step", 0) >= stop_after for r in read_metrics(run_dir)):
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGTERM)

    if stop_after is not None:
        threading.Thread(target=stop, daemon=True).start()
    result = train(rank, world_size, overrides)
    return result.preempted, len(result.losses), [t.name for t in data_threads()]


@pytest.mark.slow
@pytest.mark.distributed
def test_run_with_workers_stopped_by_sigterm_resumes_to_the_losses_without(files, tmp_path):
    """tiny_vlm on rows with images, videos and two bad rows, 4 microbatches a step: with data.num_workers=2,
    SIGTERM after step 2 stops the run after a checkpoint with no data thread left; the resumed run (with 1
    worker) ends with none left and logs, bit for bit, the losses of a run without workers."""
    import json

    from distributed import run_distributed
    from helpers import logged_losses, train

    root = tmp_path / "data"
    shutil.copytree(files, root)
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows()))

    def overrides(run_dir, workers):
        return ["recipe=tiny_vlm", f"data.path={root / 'rows.jsonl'}", "data.seq_len=128", "model.kernels.gdn=torch",
                "train.progress_bar=false", "train.max_steps=6", "train.global_batch_size=4",
                "train.micro_batch_size=1", "checkpoint.every_steps=0", "checkpoint.export_hf=false",
                f"data.num_workers={workers}", f"run_dir={run_dir}"]

    (reference,) = run_distributed(train, 1, overrides(tmp_path / "reference", 0))
    ((preempted, steps, threads),) = run_distributed(_train_listing_threads, 1, overrides(tmp_path / "run", 2), 2)
    assert preempted == "SIGTERM" and 2 <= steps < 6 and threads == []
    assert (tmp_path / "run" / "checkpoints" / f"step-{steps:06d}").is_dir()
    log = (tmp_path / "run" / "train.log").read_text()
    assert "skipped rows: {'image_undecodable': 1, 'video_undecodable': 1}" in log
    assert "pixels made ahead by 2 worker threads (data.num_workers)" in log
    ((preempted, resumed_steps, threads),) = run_distributed(_train_listing_threads, 1, overrides(tmp_path / "run", 1))
    assert preempted is None and resumed_steps == 6 - steps and threads == []
    assert logged_losses(tmp_path / "run") == logged_losses(tmp_path / "reference")
    assert len(reference.losses) == 6 and sorted(logged_losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]


def test_bench_script_premade_stream_is_the_workers_stream(tmp_path):
    """`scripts/bench.py data_workers`' inputs: its video rows read as one video each, and its `premade` stream (the
    step's baseline) hands out the batches and positions of the data.num_workers stream it is compared with."""
    import importlib.util

    from helpers import REPO, compose
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.data_setup import build_data

    spec = importlib.util.spec_from_file_location("bench_data_workers",
                                                  REPO / "scripts" / "bench_modes" / "data_workers.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.write_videos(tmp_path, videos=3, frames=4, height=48, width=64)
    cfg = compose(["recipe=tiny_vlm", f"data.path={rows}", "data.seq_len=512", "data.num_workers=2"])
    _, data, _ = build_data(cfg, named_config("tiny_vlm"), 1, 0, 1)
    _, premade, _ = bench.premade(build_data, 4)(cfg, named_config("tiny_vlm"), 1, 0, 1)
    assert data.num_video_documents == premade.num_video_documents == 3 and not data.skipped
    for _ in range(4):
        assert_same_batch(next(premade), next(data))
        assert premade.state_dict() == data.state_dict()
    data.close()
