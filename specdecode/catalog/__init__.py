"""specdecode's bundled model family (trained by `specdecode train all`, see MODEL_CARD.md)."""
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
DEFAULT_TARGET_DIR = MODELS_DIR / "target"
"""~23.5M-parameter Llama-architecture target trained on the Python standard library."""
DEFAULT_DRAFT_DIR = MODELS_DIR / "draft"
"""~2.6M-parameter draft distilled from the target, same tokenizer."""
