"""core/spool_address.py: `--spool` parsed once into one of three kinds, a bad one a line before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.config import FeedConfig, TrainConfig
from draftsmith.core.errors import DraftsmithError
from draftsmith.core.spool_address import DirectoryAddress, LocalMooncake, MooncakeAddress, parse_spool


@pytest.mark.parametrize(
    "text,host,port,run",
    [
        ("mooncake://10.0.0.5:50051/kimi", "10.0.0.5", 50051, "kimi"),
        ("mooncake://127.0.0.1:7000", "127.0.0.1", 7000, "draftsmith"),
    ],
)
def test_mooncake_addresses_parse_and_print_back(text, host, port, run):
    a = parse_spool(text)
    assert isinstance(a, MooncakeAddress) and (a.host, a.port, a.run) == (host, port, run)
    assert parse_spool(str(a)) == a and a.master == f"{host}:{port}"


def test_a_path_is_a_directory_and_the_bare_scheme_a_master_of_its_own(tmp_path):
    assert parse_spool(str(tmp_path / "spool")) == DirectoryAddress(tmp_path / "spool")
    assert parse_spool(Path("mooncake")) == DirectoryAddress(Path("mooncake"))  # a Path is always a directory
    assert parse_spool("/dev/shm/run-1") == DirectoryAddress(Path("/dev/shm/run-1"))
    assert isinstance(parse_spool("mooncake"), LocalMooncake) and str(parse_spool("mooncake")) == "mooncake"


@pytest.mark.parametrize("text", ["mooncake://host", "mooncake://h:port/x", "mooncake:/h:1", "mooncake://h:1/a b"])
def test_a_bad_address_is_one_line_naming_it(text):
    with pytest.raises(DraftsmithError) as err:
        parse_spool(text)
    assert text in str(err.value) and "\n" not in str(err.value)


def test_the_configs_refuse_a_bad_spool_before_anything_starts():
    assert TrainConfig(engine="vllm", spool="mooncake://h:1/run").spool == "mooncake://h:1/run"  # kept as given
    assert TrainConfig(engine="vllm").spool is None
    with pytest.raises(DraftsmithError, match="--spool mooncake://h:port: expected mooncake://HOST:PORT"):
        TrainConfig(engine="vllm", spool="mooncake://h:port")
    with pytest.raises(DraftsmithError, match="--spool mooncake:/h:1: expected"):
        FeedConfig(spool="mooncake:/h:1")
