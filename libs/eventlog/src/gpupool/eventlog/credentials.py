"""Who may do what on NATS: one nkey user per service, permissions derived from the subject layout.

Authentication is by **nkeys** (Ed25519 key pairs): the server's configuration
holds only public keys, each service holds its own seed file, and nothing needs
an operator, accounts or JWTs (docs/security.md says why). :func:`permissions`
computes each user's publish/subscribe allow-list from :mod:`gpupool.eventlog.subjects`
(so the grants follow the layout if it changes); :func:`write_credentials` writes
the server's ``authorization`` block (``nats-auth.conf``, included by nats.conf),
one seed file per user, and optionally a small CA with a server certificate for
TLS. ``gpupool credentials generate`` is the command around it.

Users:

* ``policy``, ``admission-queue``, ``preemption``: append on their own writer's
  subjects of every node (``<prefix>.*.<writer>``), nothing else;
* ``node-executor-<node>``: append only on ``<prefix>.<node>.node-executor``;
* each of these may create, pull from and ack only its own durable consumers
  (``<user>-0`` … ``<user>-7``: :mod:`gpupool.eventlog.durables`), delete none, and
  read the log through its own replay consumers (``<user>-replay-<k>``,
  :mod:`gpupool.eventlog.named_replay`); nobody may use the nameless consumer create;
* ``reader``: the console and ``gpupool log``/``verify``: read the stream, never append;
* ``stream-admin``: the deployments' ensure-stream step: create and scale the stream;
* ``operator``: a person's, for retention (``gpupool log archive`` / ``purge``): reads the
  stream, lists its consumers and purges it; mounted into no service.

No user but ``operator`` may purge the stream; none may delete or restore it, nor
delete or edit its messages; none but ``stream-admin`` may change its configuration.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import os
import ssl
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nkeys

from gpupool.eventlog.durables import durable_base, durable_names
from gpupool.eventlog.named_replay import replay_names
from gpupool.eventlog.subjects import (
    DEFAULT_SUBJECT_PREFIX,
    WRITERS,
    writer_subject_filter,
)

DEFAULT_STREAM = "GPUPOOL"
NODE_EXECUTOR = "node-executor"
READER = "reader"
STREAM_ADMIN = "stream-admin"
OPERATOR = "operator"
CONTROL_PLANE_WRITERS = tuple(writer for writer in WRITERS if writer != NODE_EXECUTOR)
"""The writers that append for every node (the executors append for their own only)."""

AUTH_CONFIG = "nats-auth.conf"
CA_CERT = "ca.pem"
CA_KEY = "ca-key.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"
USERS_FILE = "users.json"
KUBERNETES_SECRETS = "kubernetes-secrets.yaml"
NODES_DIR = "nodes"
NAMESPACE = "gpupool-system"

DEFAULT_TLS_NAMES = (
    "localhost",
    "127.0.0.1",
    "nats",
    "gpupool-nats",
    "gpupool-nats.gpupool-system",
    "gpupool-nats.gpupool-system.svc",
    "*.gpupool-nats-headless",
    "*.gpupool-nats-headless.gpupool-system.svc",
)
"""Names the server certificate is valid for: compose's ``nats`` and the Kubernetes services."""

FORBIDDEN_TO_EVERY_USER = (
    "$JS.API.CONSUMER.DURABLE.CREATE.>",
    "$JS.API.STREAM.PURGE.>",
    "$JS.API.STREAM.DELETE.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.MSG.DELETE.>",
    "$JS.API.STREAM.PEER.REMOVE.>",
    "$JS.API.STREAM.LEADER.STEPDOWN.>",
    "$JS.API.META.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.SERVER.>",
    "$SYS.>",
)
"""Denied explicitly (they are not allowed either): a deny wins over any allow."""


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = FORBIDDEN_TO_EVERY_USER


class User(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    permissions: Permissions


def _reading(stream: str, base: str) -> tuple[str, ...]:
    """What reading the log needs: stream info, message get, and the user's own replay
    consumers (``replay_names(base)``: create, pull, delete). Not the nameless consumer
    create of ordered consumers: a request there may name, and so update, any consumer."""
    api = "$JS.API"
    grants = [f"{api}.INFO", f"{api}.STREAM.INFO.{stream}", f"{api}.STREAM.MSG.GET.{stream}"]
    for name in replay_names(base):
        grants += [
            f"{api}.CONSUMER.CREATE.{stream}.{name}.>",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"{api}.CONSUMER.DELETE.{stream}.{name}",
        ]
    return tuple(grants)


def _consuming(stream: str, base: str) -> tuple[str, ...]:
    """A service's own durable pull consumers (``durable_names(base)``, and no other): create,
    info, pull, ack; and the stream's idempotent create (a different configuration is
    refused by the server)."""
    api = "$JS.API"
    grants = [f"{api}.STREAM.CREATE.{stream}"]
    for durable in durable_names(base):
        grants += [
            f"{api}.CONSUMER.CREATE.{stream}.{durable}",
            f"{api}.CONSUMER.CREATE.{stream}.{durable}.>",
            f"{api}.CONSUMER.INFO.{stream}.{durable}",
            f"{api}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>",
        ]
    return tuple(grants)


def writer_user(
    writer: str,
    *,
    node: str | None = None,
    stream: str = DEFAULT_STREAM,
    prefix: str = DEFAULT_SUBJECT_PREFIX,
) -> User:
    """The user of a writer service: append on its own subjects (one node's, for an executor)."""
    if writer == NODE_EXECUTOR and node is None:
        raise ValueError("a node-executor user is for one node: name it")
    if writer != NODE_EXECUTOR and node is not None:
        raise ValueError(f"the {writer} user appends for every node, not one")
    name = durable_base(writer, node)
    own = writer_subject_filter(writer, node, prefix=prefix)
    return User(
        name=name,
        permissions=Permissions(
            publish=(own, *_reading(stream, name), *_consuming(stream, name)),
            subscribe=("_INBOX.>",),
        ),
    )


def reader_user(*, stream: str = DEFAULT_STREAM) -> User:
    """The console's and ``gpupool log``/``verify``'s user: reads the stream, appends nothing."""
    return User(
        name=READER,
        permissions=Permissions(publish=_reading(stream, READER), subscribe=("_INBOX.>",)),
    )


def stream_admin_user(*, stream: str = DEFAULT_STREAM) -> User:
    """The ensure-stream step: create the stream and set its replicas; never purge or delete it."""
    api = "$JS.API"
    return User(
        name=STREAM_ADMIN,
        permissions=Permissions(
            publish=(
                f"{api}.INFO",
                f"{api}.STREAM.INFO.{stream}",
                f"{api}.STREAM.CREATE.{stream}",
                f"{api}.STREAM.UPDATE.{stream}",
            ),
            subscribe=("_INBOX.>",),
        ),
    )


def operator_user(*, stream: str = DEFAULT_STREAM) -> User:
    """The operator's user (retention: ``gpupool log archive`` / ``purge``): read the stream,
    list its consumers, purge it. Appends nothing; the only user that may purge. Its seed
    goes to no Secret a service mounts (docs/security.md)."""
    api = "$JS.API"
    purge = f"{api}.STREAM.PURGE.>"
    return User(
        name=OPERATOR,
        permissions=Permissions(
            publish=(
                *_reading(stream, OPERATOR),
                f"{api}.CONSUMER.LIST.{stream}",
                f"{api}.CONSUMER.NAMES.{stream}",
                f"{api}.STREAM.PURGE.{stream}",
            ),
            subscribe=("_INBOX.>",),
            deny_publish=tuple(s for s in FORBIDDEN_TO_EVERY_USER if s != purge),
        ),
    )


def users(
    nodes: Iterable[str], *, stream: str = DEFAULT_STREAM, prefix: str = DEFAULT_SUBJECT_PREFIX
) -> list[User]:
    """Every user of a deployment with these nodes (one executor user per node)."""
    result = [writer_user(w, stream=stream, prefix=prefix) for w in CONTROL_PLANE_WRITERS]
    result += [
        writer_user(NODE_EXECUTOR, node=node, stream=stream, prefix=prefix)
        for node in sorted(set(nodes))
    ]
    result += [reader_user(stream=stream), stream_admin_user(stream=stream)]
    result.append(operator_user(stream=stream))
    return result


def new_user_seed() -> bytes:
    """A fresh nkey user seed (``SU…``)."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed


def public_key(seed: bytes) -> str:
    key: bytes = nkeys.from_seed(bytearray(seed)).public_key
    return key.decode()


def _quoted(items: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(item) for item in items) + "]"


def authorization_block(keyed: Sequence[tuple[User, str]]) -> str:
    """The nats-server ``authorization`` block: one nkey user per line, with its permissions."""
    lines = [
        "# Generated by `gpupool credentials generate`: one nkey user per gpupool service.",
        "# Do not edit; generate again (the permissions follow the log's subject layout).",
        "authorization {",
        "  users: [",
    ]
    for user, key in keyed:
        p = user.permissions
        lines += [
            f"    # {user.name}",
            f"    {{ nkey: {key}, permissions: {{",
            f"        publish: {{ allow: {_quoted(p.publish)}, deny: {_quoted(p.deny_publish)} }}",
            f"        subscribe: {{ allow: {_quoted(p.subscribe)} }}",
            "    } }",
        ]
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def _write_secret(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)


class Generated(msgspec.Struct, frozen=True, kw_only=True):
    directory: Path
    seeds: dict[str, Path]
    """User name -> its seed file."""
    public_keys: dict[str, str]
    auth_config: Path
    tls: bool


def write_credentials(
    directory: Path,
    *,
    nodes: Iterable[str],
    stream: str = DEFAULT_STREAM,
    prefix: str = DEFAULT_SUBJECT_PREFIX,
    tls_names: Sequence[str] | None = DEFAULT_TLS_NAMES,
    valid_days: int = 825,
) -> Generated:
    """Write ``nats-auth.conf``, ``<user>.nk`` for every user, ``users.json`` and (unless
    ``tls_names`` is None) ``ca.pem``/``ca-key.pem``/``server.pem``/``server-key.pem``,
    ``kubernetes-secrets.yaml`` (the Secrets deploy/base mounts) and ``nodes/<node>/``
    (``credentials.nk``, ``ca.pem``: each GPU node's ``/etc/gpupool/nats``)."""
    directory.mkdir(parents=True, exist_ok=True)
    keyed: list[tuple[User, str]] = []
    seeds: dict[str, Path] = {}
    for user in users(nodes, stream=stream, prefix=prefix):
        seed = new_user_seed()
        path = directory / f"{user.name}.nk"
        _write_secret(path, seed + b"\n")
        seeds[user.name] = path
        keyed.append((user, public_key(seed)))
    auth = directory / AUTH_CONFIG
    auth.write_text(authorization_block(keyed))
    public_keys = {user.name: key for user, key in keyed}
    (directory / USERS_FILE).write_text(
        json.dumps(
            {
                user.name: {"nkey": key, "permissions": msgspec.to_builtins(user.permissions)}
                for user, key in keyed
            },
            indent=2,
        )
        + "\n"
    )
    if tls_names is not None:
        _write_tls(directory, tls_names, valid_days=valid_days)
        _write_kubernetes(directory, seeds)
    return Generated(
        directory=directory,
        seeds=seeds,
        public_keys=public_keys,
        auth_config=auth,
        tls=tls_names is not None,
    )


def _write_kubernetes(directory: Path, seeds: dict[str, Path]) -> None:
    """The Secrets deploy/base mounts (``kubectl apply -f kubernetes-secrets.yaml``), and for
    each GPU node ``nodes/<node>/``: what goes into that node's ``/etc/gpupool/nats``."""
    ca = (directory / CA_CERT).read_bytes()

    def secret(name: str, files: dict[str, bytes]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": name,
                "namespace": NAMESPACE,
                "labels": {"app.kubernetes.io/part-of": "gpupool"},
            },
            "type": "Opaque",
            "data": {key: base64.b64encode(value).decode() for key, value in files.items()},
        }

    documents = [
        secret(
            "gpupool-nats-server",
            {
                AUTH_CONFIG: (directory / AUTH_CONFIG).read_bytes(),
                SERVER_CERT: (directory / SERVER_CERT).read_bytes(),
                SERVER_KEY: (directory / SERVER_KEY).read_bytes(),
                CA_CERT: ca,
            },
        )
    ]
    for user in (*CONTROL_PLANE_WRITERS, STREAM_ADMIN, READER):
        documents.append(
            secret(
                f"gpupool-nats-{user}", {"credentials.nk": seeds[user].read_bytes(), CA_CERT: ca}
            )
        )
    _write_secret(
        directory / KUBERNETES_SECRETS,
        "".join("---\n" + json.dumps(doc, indent=2) + "\n" for doc in documents).encode(),
    )
    for user, path in seeds.items():
        if user.startswith(f"{NODE_EXECUTOR}-"):
            node_dir = directory / NODES_DIR / user.removeprefix(f"{NODE_EXECUTOR}-")
            _write_secret(node_dir / "credentials.nk", path.read_bytes())
            (node_dir / CA_CERT).write_bytes(ca)


def _write_tls(directory: Path, names: Sequence[str], *, valid_days: int) -> None:
    """A CA of our own and a server certificate it signs, for nats-server's TLS."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    until = now + datetime.timedelta(days=valid_days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpupool NATS CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    alternative: list[x509.GeneralName] = []
    for name in names:
        try:
            alternative.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative.append(x509.DNSName(name))
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpupool-nats")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(until)
        .add_extension(x509.SubjectAlternativeName(alternative), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )

    def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    (directory / CA_CERT).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_secret(directory / CA_KEY, key_pem(ca_key))
    (directory / SERVER_CERT).write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_secret(directory / SERVER_KEY, key_pem(server_key))


# ---------------------------------------------------------------------- clients


def connect_options(credentials: Path | None = None, ca: Path | None = None) -> dict[str, Any]:
    """nats-py ``connect`` options for a credential file and a CA to trust.

    ``credentials``: an nkey seed file (``SU…``, what ``gpupool credentials generate``
    writes) or a NATS ``.creds`` file (user JWT and seed). ``ca``: the PEM of the
    CA that signed the server's certificate (TLS; the URL may say ``tls://``).
    Neither: no options (an unauthenticated local server)."""
    options: dict[str, Any] = {}
    if credentials is not None:
        text = Path(credentials).read_text()
        if "BEGIN NATS USER JWT" in text:
            options["user_credentials"] = str(credentials)
        elif text.strip().startswith("SU"):
            options["nkeys_seed"] = str(credentials)
        else:
            raise ValueError(
                f"{credentials}: neither an nkey user seed (SU…) nor a NATS .creds file"
            )
    if ca is not None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        options["tls"] = context
    return options
