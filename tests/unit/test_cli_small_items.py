"""Issue #38, point 10: ``inspect`` prints a count of 0 as 0, and fails on an unreachable hub id
as fast as ``generate`` does (one request to the hub, not five retries)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from attnserve.entrypoints.cli import main


def test_inspect_prints_a_zero_count(capsys):
    """4 GiB hold no whole 163,840-token DeepSeek-V3 sequence: the report says 0, not a blank."""
    assert main(["inspect", "deepseek-ai/DeepSeek-V3", "--memory", "4", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("In 4.00 GiB"))
    assert line.endswith("; 0 sequences of 163,840 tokens at once"), line
    table = out.split("\n\n")[1].splitlines()
    assert table[2].split()[3] == "-"  # no state per sequence: still a dash in the table


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """Online, nothing cached; the hub is a fake: ``snapshot_download`` fails for
    org/unreachable and writes a snapshot otherwise; ``hf_hub_download`` may only look in the
    cache (asked to download, it would retry a network error for 26 s)."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)  # tests/models/parity.py sets it on import
    calls = []

    def hf_hub_download(repo_id, filename, revision=None, cache_dir=None, local_files_only=False):
        assert local_files_only, "hf_hub_download was asked to download: it retries"
        raise LocalEntryNotFoundError("not cached")

    def snapshot_download(repo_id, revision=None, cache_dir=None, local_files_only=False, allow_patterns=None):
        calls.append((repo_id, allow_patterns))
        if repo_id == "org/unreachable":
            raise ConnectionError("Name or service not known")
        snapshot = Path(cache_dir) / "snapshot"
        snapshot.mkdir(parents=True, exist_ok=True)
        config = json.loads((Path(__file__).parents[2] / "src/attnserve/presets/models/attnserve-tiny-llama/"
                             "config.json").read_text())
        (snapshot / "config.json").write_text(json.dumps(config))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_inspect_of_an_unreachable_hub_id_fails_at_once(fake_hub, capsys):
    start = time.monotonic()
    assert main(["inspect", "org/unreachable"]) == 2
    assert time.monotonic() - start < 10
    err = capsys.readouterr().err
    assert "'org/unreachable'" in err and "could not be downloaded" in err and "ConnectionError" in err
    assert fake_hub == [("org/unreachable", ["config.json"])]  # config.json alone, one request


def test_inspect_downloads_only_the_config(fake_hub, capsys):
    assert main(["inspect", "org/reachable", "--platform", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "org/reachable"
    assert fake_hub == [("org/reachable", ["config.json"])]
