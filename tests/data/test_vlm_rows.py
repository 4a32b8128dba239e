"""verl's multimodal rows for a VL model: <image> placeholders, image bytes or paths, one line per bad row."""

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from plait.configtree import ConfigError
from plait.data.dataset import load_dataset
from plait.models import create_tiny_vl_model
from plait.models_vl import load_processor

MEDIA = {"data.image_key": "images", "data.video_key": "videos", "data.audio_key": "audios"}


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(create_tiny_vl_model(tmp_path_factory.mktemp("vl") / "model", "qwen2_vl"))


def png(size=(28, 28)):
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 10)).save(buf, format="PNG")
    return buf.getvalue()


def row(content, images, **extra):
    return {"data_source": "geo3k", "prompt": [{"role": "user", "content": content}], "images": images,
            "reward_model": {"ground_truth": "1"}, **extra}


def load(tmp_path, rows, processor, **options):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return load_dataset("data.train_files", [str(path)], processor.tokenizer, media_keys=MEDIA, processor=processor,
                        max_prompt_length=512, **options), path


def test_images_fill_their_placeholders(tmp_path, processor):
    Image.new("RGB", (56, 28), (0, 0, 0)).save(tmp_path / "side.png")
    rows = [row("<image>left <image> right", [{"bytes": png()}, {"path": "side.png"}]),
            row("no image here", None)]
    data, _ = load(tmp_path, rows, processor)
    first, second = data[0], data[1]
    assert [im.size for im in first.multi_modal["images"]] == [(56, 56), (84, 56)]  # both up to min_pixels
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert first.prompt_ids.count(pad) == 4 + 6  # 4x4 and 4x6 patch grids, merged 2x2
    assert first.prompt_text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    assert "left " in first.prompt_text and second.multi_modal == {} and pad not in second.prompt_ids


@pytest.mark.parametrize("content, images, message", [
    ("<image><image> two", [{"bytes": png()}], "row 0: the prompt has 2 <image> placeholders and the row 1 images"),
    ("one <image>", [{"bytes": b"garbage"}], "row 0: image 0: an image does not decode"),
    ("one <image>", [{"path": "missing.png"}], "row 0: image 0: an image does not decode"),
])
def test_a_bad_row_is_one_line_naming_file_and_row(tmp_path, processor, content, images, message):
    with pytest.raises(ConfigError) as err:
        load(tmp_path, [row(content, images)], processor)
    text = str(err.value)
    assert message in text and "rows.parquet" in text and "\n" not in text


@pytest.mark.parametrize("special", ["fifo", "/dev/zero", "folder"])
def test_an_image_path_that_is_not_a_file_is_one_line_and_never_blocks(tmp_path, processor, special):
    """A FIFO nobody writes blocked the load forever; a device never ends."""
    import os
    import time
    if special == "fifo":
        os.mkfifo(tmp_path / "fifo")
    elif special == "folder":
        (tmp_path / "folder").mkdir()
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        load(tmp_path, [row("one <image>", [{"path": special}])], processor)
    assert "row 0: image 0: " in str(err.value) and "is not a regular file" in str(err.value)
    assert time.monotonic() - start < 10


def test_video_rows_are_refused(tmp_path, processor):
    with pytest.raises(ConfigError, match=r"row 0: column 'videos' \(data.video_key\) holds list media"):
        load(tmp_path, [row("<video>", None, videos=[{"video": "a.mp4"}])], processor)


def test_a_prompt_with_images_is_not_truncated(tmp_path, processor):
    with pytest.raises(ConfigError, match="prompt with images is .* not truncated"):
        load(tmp_path, [row("<image>" + "x" * 600, [{"bytes": png()}])], processor, truncation="left")
