"""The training commands end to end on a tiny corpus: tokenizer -> lm -> distill, and resume."""
import json

from specdecode.cli import main
from specdecode.model.loading import load_model

SHAPE = ["--hidden-size", "32", "--intermediate-size", "64", "--num-hidden-layers", "1", "--num-attention-heads", "2"]
TRAIN = ["--steps", "4", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--checkpoint-every", "2"]


def test_train_commands_chain(tiny_corpus, tmp_path, capsys):
    common = ["--corpus", str(tiny_corpus), "--heldout-fraction", "0.3", "--threads", "1"]
    assert main(["train", "tokenizer", *common, "--out", str(tmp_path / "tok"), "--vocab-size", "320"]) == 0
    lm = ["train", "lm", *common, "--tokenizer", str(tmp_path / "tok"), "--run-dir", str(tmp_path / "run"),
          "--out", str(tmp_path / "target"), *SHAPE, *TRAIN]
    assert main(lm) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens_seen"] == 4 * 2 * 32
    assert main(lm + ["--resume"]) == 0  # already finished: nothing more to do, same result
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    assert main(["train", "distill", *common, "--target", str(tmp_path / "target"), "--run-dir",
                 str(tmp_path / "run"), "--out", str(tmp_path / "draft"), *SHAPE, *TRAIN]) == 0
    assert (tmp_path / "draft" / "model.safetensors").is_file()
    assert (tmp_path / "draft" / "tokenizer.json").read_bytes() == (tmp_path / "tok" / "tokenizer.json").read_bytes()
    for name in ("target", "draft"):  # Hugging Face folders in bfloat16 with the tokenizer's special tokens
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert config["torch_dtype"] == "bfloat16" and config["max_position_embeddings"] == 32
        assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
        assert load_model(tmp_path / name, dtype="float32").config.hidden_size == 32
