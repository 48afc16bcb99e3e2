"""Configurations shipped with the package: released models' ``config.json`` (no weights).

``attnserve inspect deepseek-ai/DeepSeek-V3`` works offline because that config lies here;
any path to a model directory or ``config.json`` works too.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEFAULT_MODEL", "HF_CONFIG_DIR", "MODEL_DIR", "model_names", "preset_names", "resolve_config_path",
           "resolve_model_preset"]

HF_CONFIG_DIR = Path(__file__).parent / "hf_configs"
MODEL_DIR = Path(__file__).parent / "models"
DEFAULT_MODEL = "attnserve-demo-gqa"


def resolve_model_preset(name: str) -> Path | None:
    """A model directory shipped with the package (config and tokenizer; weights when trained)."""
    path = MODEL_DIR / name
    return path if (path / "config.json").exists() else None


def model_names() -> list[str]:
    """Model directories shipped with the package."""
    return sorted(p.parent.name for p in MODEL_DIR.glob("*/config.json"))


def preset_names() -> list[str]:
    """Shipped config names as ``org/Model`` (the file name with ``__`` for ``/``)."""
    return sorted(p.stem.replace("__", "/") for p in HF_CONFIG_DIR.glob("*.json"))


def resolve_config_path(name_or_path: str) -> Path:
    """A model directory, a config file, a shipped model (``attnserve-demo-gqa``) or the name of
    a shipped config (case-insensitive, with or without the organisation)."""
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{p} has no config.json")
        return cfg
    if p.is_file():
        return p
    shipped_model = resolve_model_preset(name_or_path)
    if shipped_model is not None:
        return shipped_model / "config.json"
    wanted = name_or_path.lower().replace("__", "/")
    for name in preset_names():
        if wanted in (name.lower(), name.lower().split("/")[-1]):
            return HF_CONFIG_DIR / (name.replace("/", "__") + ".json")
    raise FileNotFoundError(
        f"'{name_or_path}' is neither a model directory, a config.json, nor a shipped config "
        f"(shipped: {', '.join(preset_names())}; shipped models: {', '.join(model_names())})")
