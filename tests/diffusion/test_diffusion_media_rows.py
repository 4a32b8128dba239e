"""trainer.mode=diffusion generates from text prompts: a prompt row holding images stops at start in one line."""

import json

import pytest

pytest.importorskip("diffusers")

from plait import driver  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.configtree import ConfigError  # noqa: E402
from plait.workers.diffusion_pipeline import create_tiny_sd3_pipeline  # noqa: E402


def test_a_prompt_row_with_images_is_refused(tmp_path):
    pipeline = create_tiny_sd3_pipeline(tmp_path / "sd3", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "a red cat"}, {"prompt": "<image> like this", "images": [{"path": "cat.png"}]}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, ["trainer.mode=diffusion", f"data.train_files=[{prompts}]", "data.train_batch_size=1",
                             "data.val_size=1", "trainer.logger=[]", f"trainer.default_local_dir={tmp_path / 'out'}",
                             f"diffusion.model_path={pipeline}", "diffusion.reward=jpeg_compressibility"])
    with pytest.raises(ConfigError) as err:
        driver.build(cfg, progress=False)
    message = str(err.value)
    assert message.startswith("data.train_files=") and "prompt row 1: column 'images' holds media" in message
    assert "\n" not in message
