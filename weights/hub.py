"""Resolve ``--model-id``: a local directory as is, a hub id through huggingface_hub.

Only what serving needs is downloaded (config, generation config, tokenizer files,
chat template, safetensors and their index), with huggingface_hub's progress bars, into
its cache (``--huggingface-hub-cache``, else huggingface_hub's default). Offline
(``--hf-hub-offline`` / ``HF_HUB_OFFLINE=1``) only the cache is used. Nothing here reads
the environment: the token and the offline switch come from ``tgi_compat.launch_config``;
left as None, huggingface_hub's own settings apply. Every failure is one
``ModelNotFoundError`` line that says what was asked, why it failed and what to do.
"""
from __future__ import annotations

from pathlib import Path

ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "*.safetensors",
                  "model.safetensors.index.json", "chat_template.json*", "chat_template.jinja", "vocab*",
                  "merges.txt", "quantize_config.json", "quant_config.json"]   # the last two: older GPTQ / AWQ repos


class ModelNotFoundError(ValueError):
    """The model cannot be found, fetched or read; the message is one line."""


def resolve_model(model_id: str, revision: str | None = None, cache_dir: str | None = None,
                  token: str | None = None, offline: bool | None = None) -> Path:
    """The directory holding the model: ``model_id`` itself if it is a local directory, else
    the hub snapshot (downloaded unless ``offline``; None: huggingface_hub's HF_HUB_OFFLINE)."""
    local = Path(model_id).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(f"{local} is a directory without config.json: point --model-id at a Hugging "
                                     f"Face model folder (config.json, tokenizer, *.safetensors)")
        return local.resolve()
    if local.exists():
        raise ModelNotFoundError(f"--model-id {model_id} is a file: give the model's directory or a hub id")
    if model_id.startswith(("/", "./", "../", "~")):
        raise ModelNotFoundError(f"--model-id {model_id}: no such directory")
    path = _download(model_id, revision, cache_dir, token, _offline(offline))
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{model_id} has no .safetensors weights (only PyTorch .bin?): this engine reads "
                                 f"safetensors only; use a repo or --revision that ships them (e.g. refs/pr/N of "
                                 f"a conversion)")
    return path


def _offline(offline: bool | None) -> bool:
    if offline is not None:
        return offline
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _download(model_id: str, revision: str | None, cache_dir: str | None, token: str | None,
              offline: bool) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    asked = model_id if revision is None else f"{model_id} (revision {revision})"
    try:
        return Path(huggingface_hub.snapshot_download(
            model_id, revision=revision, cache_dir=cache_dir, token=token, allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline))
    except errors.HFValidationError:
        raise ModelNotFoundError(f"--model-id {model_id!r} is neither a local directory nor a valid hub id "
                                 f"(org/name): check the id or the path") from None
    except errors.GatedRepoError:
        raise ModelNotFoundError(f"{model_id} is gated: accept its license on huggingface.co and set HF_TOKEN to a "
                                 f"token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFoundError(f"{model_id} was not found on the hub: check the id (if it is private, set "
                                 f"HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFoundError(f"{model_id} has no revision {revision!r}: check --revision") from None
    except errors.LocalEntryNotFoundError:
        if offline:
            raise ModelNotFoundError(f"{asked} is not in the hub cache and the hub is offline (HF_HUB_OFFLINE): "
                                     f"run once online or unset HF_HUB_OFFLINE") from None
        raise ModelNotFoundError(f"{asked} could not be downloaded: the hub is unreachable and the model is not "
                                 f"in the cache; check the network (or a proxy), or run where it is") from None
    except (OSError, errors.HfHubHTTPError) as e:
        reason = " ".join(str(e).split())[:300]
        raise ModelNotFoundError(f"{asked} could not be downloaded ({type(e).__name__}: {reason}): check the "
                                 f"network and the disk space of the hub cache, then retry") from None


def model_info(model_id: str, revision: str | None = None, token: str | None = None,
               offline: bool | None = None) -> tuple[str | None, str | None]:
    """(commit sha, pipeline tag) from the hub, for /info; (None, None) for a local directory,
    offline, or on any failure (best effort: never raises)."""
    if Path(model_id).expanduser().exists():
        return None, None
    try:
        if _offline(offline):
            return None, None
        import huggingface_hub

        info = huggingface_hub.model_info(model_id, revision=revision, token=token, timeout=5)
        return info.sha, info.pipeline_tag
    except Exception:   # best effort: /info shows nulls
        return None, None
