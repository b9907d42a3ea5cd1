"""Model resolution without the network: local directories, a hand-made hub cache used
offline, and huggingface_hub's errors raised by a stand-in ``snapshot_download``."""
import huggingface_hub
import pytest
from huggingface_hub import constants, errors

from weights import hub
from weights.hub import ALLOW_PATTERNS, ModelNotFoundError, model_info, resolve_model

SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """huggingface_hub's own offline switch, in case a test reaches it without offline=True."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def _cache(tmp_path, repo="org/tiny", files=("config.json", "model.safetensors"), ref="main"):
    """A huggingface_hub cache layout: models--org--name/{refs/<ref>, snapshots/<sha>/...}."""
    root = tmp_path / "cache"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for name in files:
        (snapshot / name).write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / ref).write_text(SHA)
    return root, snapshot


def _one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_a_local_directory_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_local_paths_that_are_not_models(tmp_path):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model(str(tmp_path))
    assert "is a directory without config.json" in _one_line(error)
    with pytest.raises(ModelNotFoundError, match="no such directory"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(ModelNotFoundError, match="is a file: give the model's directory"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_a_cached_hub_model_resolves_offline(tmp_path):
    cache, snapshot = _cache(tmp_path)
    assert resolve_model("org/tiny", cache_dir=str(cache), offline=True) == snapshot
    assert resolve_model("org/tiny", revision=SHA, cache_dir=str(cache), offline=True) == snapshot


def test_huggingface_hub_offline_setting_is_honoured_when_not_given(tmp_path):
    cache, snapshot = _cache(tmp_path)
    assert resolve_model("org/tiny", cache_dir=str(cache)) == snapshot     # constants.HF_HUB_OFFLINE (fixture)


def test_an_uncached_model_offline_says_what_to_do(tmp_path):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("some-org/not-cached", cache_dir=str(tmp_path / "cache"), offline=True)
    assert _one_line(error) == ("some-org/not-cached is not in the hub cache and the hub is offline "
                                "(HF_HUB_OFFLINE): run once online or unset HF_HUB_OFFLINE")


def test_an_uncached_revision_offline(tmp_path):
    cache, _ = _cache(tmp_path)
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("org/tiny", revision="v2", cache_dir=str(cache), offline=True)
    assert "org/tiny (revision v2) is not in the hub cache" in _one_line(error)


def test_a_repo_with_only_bin_weights(tmp_path):
    cache, _ = _cache(tmp_path, files=("config.json", "pytorch_model.bin"))
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("org/tiny", cache_dir=str(cache), offline=True)
    assert "org/tiny has no .safetensors weights" in _one_line(error)


def test_an_invalid_id(tmp_path):
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("not a valid id!!", cache_dir=str(tmp_path), offline=True)
    assert "is neither a local directory nor a valid hub id" in _one_line(error)


def _raise(exception):
    def fake(*args, **kwargs):
        raise exception
    return fake


def hub_error(cls: type, message: str) -> Exception:
    """A huggingface_hub error as the hub raises it, without a response (huggingface_hub 1.x and
    later require one in the constructor; 0.x does not)."""
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error


@pytest.mark.parametrize("exception,message", [
    (hub_error(errors.GatedRepoError, "403 gated"), "org/m is gated: accept its license on huggingface.co and set HF_TOKEN"),
    (hub_error(errors.RepositoryNotFoundError, "404"), "org/m was not found on the hub: check the id"),
    (hub_error(errors.RevisionNotFoundError, "404 rev"), "org/m has no revision 'v9': check --revision"),
    (hub_error(errors.LocalEntryNotFoundError, "cannot reach"), "org/m (revision v9) could not be downloaded: the hub is "
                                                     "unreachable and the model is not in the cache"),
    (ConnectionError("connection reset\nby peer"), "org/m (revision v9) could not be downloaded (ConnectionError: "
                                                   "connection reset by peer)"),
    (hub_error(errors.HfHubHTTPError, "500 Server Error"), "could not be downloaded (HfHubHTTPError: 500 Server Error)"),
])
def test_hub_failures_are_one_clear_line(monkeypatch, exception, message):
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _raise(exception))
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model("org/m", revision="v9", offline=False)
    assert message in _one_line(error)
    assert error.value.__cause__ is None and error.value.__suppress_context__


def test_the_download_asks_for_what_serving_needs(monkeypatch, tmp_path):
    (tmp_path / "model.safetensors").write_text("")
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model("org/m", revision="main", cache_dir="/c", token="hf_x", offline=False) == tmp_path
    assert calls == [("org/m", dict(revision="main", cache_dir="/c", token="hf_x", allow_patterns=ALLOW_PATTERNS,
                                    local_files_only=False))]
    resolve_model("org/m", offline=True)
    assert calls[-1][1]["local_files_only"] is True and calls[-1][1]["token"] is None
    for needed in ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "*.safetensors",
                   "model.safetensors.index.json", "chat_template.json*", "vocab*", "merges.txt"]:
        assert needed in ALLOW_PATTERNS
    assert not any(pattern.endswith(".bin") or pattern in ("*", "*.pt") for pattern in ALLOW_PATTERNS)


def test_model_info_is_best_effort(monkeypatch, tmp_path):
    assert model_info(str(tmp_path)) == (None, None)
    asked = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda *args, **kwargs: asked.append(args))
    assert model_info("org/m", offline=True) == (None, None)
    assert model_info("org/m") == (None, None)       # huggingface_hub's HF_HUB_OFFLINE (fixture)
    assert asked == []                               # offline: the hub is not even asked

    class Info:
        sha, pipeline_tag = SHA, "text-generation"
    seen = []
    monkeypatch.setattr(huggingface_hub, "model_info", lambda repo, **kw: seen.append((repo, kw)) or Info())
    assert model_info("org/m", "v1", token="t", offline=False) == (SHA, "text-generation")
    assert seen == [("org/m", dict(revision="v1", token="t", timeout=5))]
    monkeypatch.setattr(huggingface_hub, "model_info", _raise(hub_error(errors.RepositoryNotFoundError, "404")))
    assert model_info("org/m", offline=False) == (None, None)


def test_hub_reads_no_environment():
    source = open(hub.__file__).read()
    assert "os.environ" not in source and "getenv" not in source
