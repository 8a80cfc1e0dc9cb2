"""The draft-against-target vocabulary check: a draft whose tokenizer files are the target's is
accepted without loading its tokenizer; any other draft is compared token by token."""

from __future__ import annotations

import json
import shutil

import pytest

from specextend.api import load
from specextend.errors import UserError
from specextend.models import resolve
from specextend.models.resolve import same_tokenizer_files

from tiny_tokenizer import save_tiny_model, tiny_tokenizer

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {
        "target": save_tiny_model(root / "target", seed=0),
        "other": save_tiny_model(root / "other", seed=1),
        "swapped": save_tiny_model(root / "swapped", seed=1, tokenizer=tiny_tokenizer(swap=(10, 11))),
    }


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _count_tokenizer_loads(monkeypatch):
    loaded = []
    real = resolve.load_tokenizer

    def counting(folder):
        loaded.append(folder)
        return real(folder)

    monkeypatch.setattr(resolve, "load_tokenizer", counting)
    return loaded


def test_same_files_are_the_same_tokenizer(folders, tmp_path):
    assert same_tokenizer_files(folders["target"], folders["other"])
    assert not same_tokenizer_files(folders["target"], folders["swapped"])


def test_a_chat_template_alone_does_not_count(folders, tmp_path):
    other = _copy(folders["other"], tmp_path / "other")
    path = other / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = "{{ messages[0]['content'] }}"
    path.write_text(json.dumps(config))
    assert same_tokenizer_files(folders["target"], other)
    config["model_max_length"] = 7
    path.write_text(json.dumps(config))
    assert not same_tokenizer_files(folders["target"], other)


@pytest.mark.parametrize("change", ["missing", "extra", "bytes", "config"])
def test_any_other_file_difference_counts(folders, tmp_path, change):
    other = _copy(folders["other"], tmp_path / "other")
    if change == "missing":
        (other / "tokenizer_config.json").unlink()
    elif change == "extra":
        (other / "added_tokens.json").write_text("{}")
    elif change == "bytes":
        tok = other / "tokenizer.json"
        tok.write_text(json.dumps(json.loads(tok.read_text()), indent=3))
    else:
        (other / "tokenizer_config.json").write_text("{not json")
    assert not same_tokenizer_files(folders["target"], other)


def test_a_draft_with_the_targets_files_is_not_loaded_twice(folders, monkeypatch):
    loaded = _count_tokenizer_loads(monkeypatch)
    p = load(folders["target"], folders["other"], dtype="float64", progress=False)
    assert p.draft is not None and loaded == [folders["target"].resolve()]


def test_other_files_with_the_same_vocabulary_are_compared_and_accepted(folders, tmp_path, monkeypatch):
    other = _copy(folders["other"], tmp_path / "other")
    tok = other / "tokenizer.json"
    tok.write_text(json.dumps(json.loads(tok.read_text()), indent=3))  # other bytes, the same tokens
    loaded = _count_tokenizer_loads(monkeypatch)
    p = load(folders["target"], other, dtype="float64", progress=False)
    assert p.draft is not None and len(loaded) == 2


def test_a_draft_with_other_tokens_is_still_refused(folders):
    with pytest.raises(UserError, match="token 10"):
        load(folders["target"], folders["swapped"], progress=False)
