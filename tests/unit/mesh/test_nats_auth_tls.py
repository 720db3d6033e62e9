"""NATS over TLS with the mesh's certificate files (nats_auth.TlsFiles): the bus trusts the
mesh CA by default, and a client that does not trust it cannot connect."""
import asyncio
import shutil
import subprocess

import nats
import pytest

from services.mesh import mesh_auth, nats_auth
from services.mesh.nats_bus import EventBus
from services.mesh.nats_server import NatsServer


def _self_signed(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_with_the_mesh_tls_files_nats_requires_tls_and_the_bus_trusts_the_mesh_ca(tmp_path):
    cert, key = _self_signed(tmp_path)
    passwords = nats_auth.random_passwords()
    tls = nats_auth.TlsFiles.from_mesh(mesh_auth.MeshSecurity(tls_cert_path=str(cert), tls_key_path=str(key)))

    async def scenario(server: NatsServer) -> bool:
        with pytest.raises(Exception):  # system CAs do not know the mesh's certificate
            await nats.connect(server.url, user="scheduler", password=passwords["scheduler"],
                               allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
        bus = EventBus(server.url, "scheduler", auth=nats_auth.ClientAuth("scheduler", passwords["scheduler"]))
        await bus.start()
        try:
            return await bus.wait_connected(10)
        finally:
            await bus.close()

    mesh_auth.configure(environ={"WEFT_MESH_TLS_CA": str(cert)})
    try:
        with NatsServer(log_path=tmp_path / "nats.log", passwords=passwords, tls=tls) as server:
            assert asyncio.run(scenario(server))
    finally:
        mesh_auth._current = None
