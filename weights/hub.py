"""Resolve ``--model-id``: a local directory as is, a hub id through huggingface_hub.

Only what serving needs is downloaded (config, generation config, tokenizer files,
safetensors and their index), with huggingface_hub's progress bars, into its cache
(``--huggingface-hub-cache`` or HF_HOME). ``HF_HUB_OFFLINE=1`` makes it use the cache
alone. Every failure is one ``ModelNotFoundError`` line that says what to do.
"""
from __future__ import annotations

from pathlib import Path

ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "*.safetensors",
                  "model.safetensors.index.json", "chat_template.json", "chat_template.jinja", "vocab*", "merges.txt"]


class ModelNotFoundError(ValueError):
    """The model cannot be found, fetched or read."""


def resolve_model(model_id: str, revision: str | None = None, cache_dir: str | None = None,
                  token: str | None = None) -> Path:
    local = Path(model_id).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(f"{local} is a directory without config.json: point --model-id at a Hugging "
                                     f"Face model folder (config.json, tokenizer, *.safetensors)")
        return local.resolve()
    if model_id.startswith(("/", "./", "../", "~")):
        raise ModelNotFoundError(f"--model-id {model_id}: no such directory")
    return _download(model_id, revision, cache_dir, token)


def _download(model_id: str, revision: str | None, cache_dir: str | None, token: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    try:
        path = huggingface_hub.snapshot_download(model_id, revision=revision, cache_dir=cache_dir, token=token,
                                                 allow_patterns=ALLOW_PATTERNS)
    except errors.GatedRepoError:
        raise ModelNotFoundError(f"{model_id} is gated: accept its license on the hub and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFoundError(f"{model_id} was not found on the hub (or is private: set HF_TOKEN); "
                                 f"check the id") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"{model_id} has no revision {revision!r}; check --revision") from None
    except errors.LocalEntryNotFoundError:
        raise ModelNotFoundError(f"{model_id} is not in the hub cache and cannot be downloaded (offline or no "
                                 f"connection): run once with network access, or unset HF_HUB_OFFLINE") from None
    except (OSError, errors.HfHubHTTPError) as e:
        raise ModelNotFoundError(f"{model_id} could not be downloaded: {type(e).__name__}: {e}") from None
    path = Path(path)
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{model_id} has no .safetensors weights (only PyTorch .bin?): safetensors "
                                 f"required; use a repo or revision that ships them")
    return path


def model_info(model_id: str, revision: str | None = None) -> tuple[str | None, str | None]:
    """(commit sha, pipeline tag) from the hub; (None, None) for a local directory or offline."""
    if Path(model_id).expanduser().is_dir():
        return None, None
    try:
        import huggingface_hub
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            return None, None
        info = huggingface_hub.model_info(model_id, revision=revision, timeout=5)
        return info.sha, info.pipeline_tag
    except Exception:   # best effort: /info shows nulls
        return None, None
