"""Where the shipped models lie (docs/embedded-model.md): a leaf module, so that the loader, the tiny models
and the assembled vision-language model share the paths without importing each other."""
from pathlib import Path

EMBEDDED = Path(__file__).resolve().parent.parent / "embedded"
EMBEDDED_DIR = EMBEDDED / "model"   # `embedded`: the embedded default model
PHONE_DIR = EMBEDDED / "phone"      # `phone`: the phone-class model
VL_DIR = EMBEDDED / "vl_tower"      # `embedded-vl`'s shipped part (toolkit/models/embedded_vl.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # the shipped models' one tokenizer
