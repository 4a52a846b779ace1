"""The NATS permissions come from the subject layout, and the credential files are what nats needs."""

from __future__ import annotations

import stat
from pathlib import Path

import nkeys
import pytest

from gpupool.cli.main import main
from gpupool.eventlog.credentials import (
    CONTROL_PLANE_WRITERS,
    NODE_EXECUTOR,
    OPERATOR,
    connect_options,
    public_key,
    users,
    writer_user,
)
from gpupool.eventlog.subjects import WRITERS, writer_subject_filter


def test_each_writer_may_publish_on_its_own_subjects_and_no_other_log_subject() -> None:
    for writer in CONTROL_PLANE_WRITERS:
        log_subjects = [
            s for s in writer_user(writer).permissions.publish if s.startswith("gpupool.log.")
        ]
        assert log_subjects == [writer_subject_filter(writer)]
    executor = writer_user(NODE_EXECUTOR, node="gpu.node.1")
    assert executor.name == "node-executor-gpu_node_1"
    assert [s for s in executor.permissions.publish if s.startswith("gpupool.log.")] == [
        "gpupool.log.gpu_node_1.node-executor"
    ]


def test_every_writer_of_the_layout_gets_a_user() -> None:
    names = {user.name for user in users(["n1", "n2"])}
    assert {w for w in WRITERS if w != NODE_EXECUTOR} <= names
    assert {"node-executor-n1", "node-executor-n2", "reader", "stream-admin"} <= names


def test_no_user_but_the_operator_is_allowed_to_purge_delete_or_update_the_stream() -> None:
    for user in users(["n1"]):
        if user.name == OPERATOR:
            continue  # below
        allowed = user.permissions.publish
        assert not [s for s in allowed if ".PURGE." in s or ".STREAM.DELETE." in s]
        assert not [s for s in allowed if s.endswith(">") and s.startswith("$JS.API.STREAM")]
        if user.name != "stream-admin":
            assert not [s for s in allowed if ".STREAM.UPDATE." in s]
        assert "$JS.API.STREAM.PURGE.>" in user.permissions.deny_publish
    (operator,) = [user for user in users(["n1"]) if user.name == OPERATOR]
    allowed = operator.permissions.publish
    assert [s for s in allowed if ".PURGE." in s] == ["$JS.API.STREAM.PURGE.GPUPOOL"]
    assert not [s for s in allowed if s.startswith("gpupool.log.") or ".STREAM.DELETE." in s]
    assert not [s for s in allowed if ".STREAM.UPDATE." in s or ".MSG.DELETE." in s]
    assert "$JS.API.STREAM.DELETE.>" in operator.permissions.deny_publish
    assert "$JS.API.STREAM.PURGE.>" not in operator.permissions.deny_publish


def test_an_executor_user_names_its_node_and_the_others_do_not() -> None:
    with pytest.raises(ValueError, match="one node"):
        writer_user(NODE_EXECUTOR)
    with pytest.raises(ValueError, match="every node"):
        writer_user("policy", node="n1")


def test_generate_writes_seeds_only_the_owner_can_read_and_the_servers_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "creds"
    assert main(["credentials", "generate", "--out", str(out), "--node", "gpu-node-1"]) == 0
    seed = out / "node-executor-gpu-node-1.nk"
    assert stat.S_IMODE(seed.stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca-key.pem").stat().st_mode) == 0o600
    key = public_key(seed.read_bytes().strip())
    assert nkeys.from_seed(bytearray(seed.read_bytes().strip())).public_key.decode() == key
    config = (out / "nats-auth.conf").read_text()
    assert f"nkey: {key}" in config
    assert config.count("nkey: U") == 7  # 3 services, 1 executor, reader, admin, operator
    assert key in capsys.readouterr().out
    assert connect_options(seed) == {"nkeys_seed": str(seed)}
    assert "tls" in connect_options(None, out / "ca.pem")


def test_a_file_that_is_no_credential_is_refused_clearly(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_text("hello")
    with pytest.raises(ValueError, match="neither an nkey user seed"):
        connect_options(junk)


def test_a_node_name_that_cannot_be_a_subject_token_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["credentials", "generate", "--out", str(tmp_path), "--node", "a b"])
    assert code != 0
    assert "cannot be a NATS subject token" in capsys.readouterr().err


def test_every_consumer_a_user_may_touch_is_its_own() -> None:
    """Consumer names in the JetStream API subjects: each user's grants name only its own
    durables and replay consumers; nobody gets the nameless create or another's delete."""
    every = users(["gpu-node-1", "gpu.node.2"])
    for user in every:
        consumer_grants = [
            grant
            for grant in user.permissions.publish
            if grant.startswith(("$JS.API.CONSUMER.", "$JS.ACK."))
        ]
        for grant in consumer_grants:
            tokens = grant.split(".")
            if tokens[:4] in (
                ["$JS", "API", "CONSUMER", "LIST"],
                ["$JS", "API", "CONSUMER", "NAMES"],
            ):
                # the stream's consumers listed (read only, no consumer named): the operator's,
                # to find the durables a purge must wait for
                assert user.name == OPERATOR and len(tokens) == 5, (user.name, grant)
                continue
            if grant.startswith("$JS.ACK."):
                name = tokens[3]  # $JS.ACK.<stream>.<consumer>.>
            elif grant.startswith("$JS.API.CONSUMER.MSG."):
                name = tokens[6]  # $JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>
            else:
                name = tokens[5]  # $JS.API.CONSUMER.<op>.<stream>.<consumer>[.filter]
            assert name.startswith(f"{user.name}-"), (user.name, grant)
            assert "*" not in name and ">" not in name, (user.name, grant)
        assert "$JS.API.CONSUMER.CREATE.GPUPOOL" not in user.permissions.publish
        assert "$JS.API.CONSUMER.DURABLE.CREATE.>" in user.permissions.deny_publish
        deletes = [g for g in consumer_grants if ".CONSUMER.DELETE." in g]
        assert all("-replay-" in g for g in deletes), deletes
