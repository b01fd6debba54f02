"""A model's files on nodes that lack them: replicas resolve their model where they run, and inferlet hosts get a
model's tokenizer and template files through Ray when the replica's directory is not on their node."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
from inferlet.instruct import Instruct
from inferlet.runtime import ModelEndpoint
from inferlet.tokenizer import Tokenizer
from pie_cluster.hosts.model_files import local_endpoints, write_files
from pie_workers.model_dir import description_files, local_model_dir
from pie_workers.tiny_model import EmbeddedModel


def endpoint(model_dir: str) -> ModelEndpoint:
    return ModelEndpoint(
        name="default", address="ipc:///nowhere", model_dir=model_dir, page_size=16, vocab_size=4096, architecture="x"
    )


def test_description_files_are_everything_but_the_weights(tiny_llama):
    files = description_files(tiny_llama)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(files)
    assert not any(name.endswith(".safetensors") or name.startswith(".") for name in files)
    assert files["tokenizer.json"] == (tiny_llama / "tokenizer.json").read_bytes()


def test_local_model_dir_resolves_the_embedded_model_and_names_a_missing_path(tiny_llama, tmp_path):
    assert local_model_dir(EmbeddedModel("llama")) == tiny_llama
    with pytest.raises(FileNotFoundError, match=r"no model at .*/absent on node 10\.0\.0\.7"):
        local_model_dir(tmp_path / "absent", "node 10.0.0.7")


def test_a_host_without_the_model_directory_fetches_its_files_once(ray_session, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    elsewhere = tmp_path / "replica-node" / "model"  # the replica's directory, on a node this host cannot see
    shutil.copytree(tiny_llama, elsewhere)
    files = ray_session.put(description_files(elsewhere))
    shutil.rmtree(elsewhere)

    got = asyncio.run(local_endpoints({"default": endpoint(str(elsewhere))}, {"default": files}))["default"]
    assert got.model_dir.startswith(str(tmp_path / "cache" / "model-files"))
    assert (got.name, got.address, got.page_size) == ("default", "ipc:///nowhere", 16)
    text = "<|im_start|>user\nhello, nodes<|im_end|>"
    assert Tokenizer.from_dir(got.model_dir).encode(text) == Tokenizer.from_dir(tiny_llama).encode(text)
    here, there = Instruct.from_dir(got.model_dir), Instruct.from_dir(tiny_llama)
    assert (here.user("hi"), here.stop_tokens()) == (there.user("hi"), there.stop_tokens())
    # The same files are written once: a second host in this node's cache finds them.
    assert write_files(ray_session.get(files), tmp_path / "cache") == Path(got.model_dir)


def test_a_directory_present_on_this_node_is_used_as_it_is_and_a_missing_one_without_files_is_an_error(tiny_llama):
    got = asyncio.run(local_endpoints({"default": endpoint(str(tiny_llama))}, {}))
    assert got["default"].model_dir == str(tiny_llama)
    with pytest.raises(FileNotFoundError, match="'default': /gone/model is not on this node"):
        asyncio.run(local_endpoints({"default": endpoint("/gone/model")}, {}))
