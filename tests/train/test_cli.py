"""The training commands end to end on a tiny corpus: tokenizer -> lm -> distill -> eval, and resume."""
import json

from specdecode.cli import main

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
    heldout = tmp_path / "heldout.json"
    from specdecode.train import data

    _, held = data.split_documents(data.read_documents(tiny_corpus), 0.3)
    data.save_heldout_list(heldout, tiny_corpus, held, 0.3)
    capsys.readouterr()
    assert main(["eval", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--heldout",
                 str(heldout), "--max-tokens", "256", "--seq-len", "32", "--prompts", "4", "--new-tokens", "4",
                 "--json", str(tmp_path / "eval.json")]) == 0
    figures = json.loads((tmp_path / "eval.json").read_text())
    assert 0 < figures["acceptance_t1"] <= 1 and 0 <= figures["greedy_agreement"] <= 1
    assert figures["target_perplexity"] > 1
