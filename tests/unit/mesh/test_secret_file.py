"""The mesh secret from a file (Docker secrets style): every service accepts
``--mesh-secret-file`` / ``WEFT_MESH_SECRET_FILE``, a bad file is a usage error naming the
option, and compose.yaml hands every Python service a secret."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.mesh import mesh_auth
from services.mesh.env_config import load_config
from services.mesh.mesh_auth import MeshSecurity

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _forget_configured_security():
    yield
    mesh_auth._current = None  # load_config fixed this process's settings: leave none behind


@pytest.fixture()
def secret_file(tmp_path):
    path = tmp_path / "mesh_secret"
    path.write_text("  s3cret-from-file\n")
    return path


def _services(tmp_path):
    """(config class, service name, argv) for each of the four services."""
    from services.cachestore.config import CacheStoreConfig
    from services.executor.config import ExecutorConfig
    from services.router.config import RouterConfig
    from services.scheduler.config import SchedulerConfig

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "tokenizer.json").write_text("{}")
    return [(CacheStoreConfig, "cachestore", ["--disk-dir", ""]), (SchedulerConfig, "scheduler", []),
            (ExecutorConfig, "executor", ["--model-dir", str(model)]),
            (RouterConfig, "router", ["--model-dir", str(model)])]


def test_the_secret_comes_from_the_file_stripped_and_the_flag_wins_over_the_environment(secret_file, tmp_path):
    assert MeshSecurity.from_environ({"WEFT_MESH_SECRET_FILE": str(secret_file)}).secret == "s3cret-from-file"
    other = tmp_path / "other"
    other.write_text("from-flag")
    assert MeshSecurity.from_environ({"WEFT_MESH_SECRET_FILE": str(secret_file)}, str(other)).secret == "from-flag"
    assert MeshSecurity.from_environ({"WEFT_MESH_SECRET": "from-env"}).secret == "from-env"


@pytest.mark.parametrize("content", [None, "", " \n\t\n"], ids=["missing", "empty", "whitespace"])
def test_an_unreadable_or_empty_file_is_an_error_naming_the_option(tmp_path, content):
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match="--mesh-secret-file \\(WEFT_MESH_SECRET_FILE\\)") as err:
        MeshSecurity.from_environ({}, str(path))
    assert str(path) in str(err.value)


def test_a_secret_given_both_ways_is_refused(secret_file):
    with pytest.raises(ValueError, match="either WEFT_MESH_SECRET or --mesh-secret-file"):
        MeshSecurity.from_environ({"WEFT_MESH_SECRET": "x", "WEFT_MESH_SECRET_FILE": str(secret_file)})


def test_every_service_takes_the_flag_and_configures_its_process(secret_file, tmp_path):
    for cls, service, argv in _services(tmp_path):
        mesh_auth._current = None
        config = load_config(cls, service, "test", [*argv, "--mesh-secret-file", str(secret_file)], environ={})
        assert config.mesh_secret_file == str(secret_file)
        assert mesh_auth.current().secret == "s3cret-from-file", service
        mesh_auth._current = None
        load_config(cls, service, "test", argv, environ={"WEFT_MESH_SECRET_FILE": str(secret_file)})
        assert mesh_auth.current().secret == "s3cret-from-file", service


def test_every_service_exits_with_a_usage_error_naming_the_option_for_a_bad_file(tmp_path, capsys):
    missing = tmp_path / "no-such-secret"
    for cls, service, argv in _services(tmp_path):
        with pytest.raises(SystemExit) as exc:
            load_config(cls, service, "test", [*argv, "--mesh-secret-file", str(missing)], environ={})
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--mesh-secret-file" in err and str(missing) in err, service


def test_every_service_documents_the_flag_in_its_help(tmp_path, capsys):
    for cls, service, _ in _services(tmp_path):
        with pytest.raises(SystemExit):
            load_config(cls, service, "test", ["--help"], environ={})
        out = capsys.readouterr().out
        assert "--mesh-secret-file" in out and "WEFT_MESH_SECRET_FILE" in out, service


def test_compose_gives_every_python_service_the_same_non_empty_mesh_secret():
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    secrets = {name: compose[name]["environment"].get("WEFT_MESH_SECRET")
               for name in ("router", "scheduler", "executor", "cachestore")}
    assert len(set(secrets.values())) == 1, secrets
    value = next(iter(secrets.values()))
    assert value == "${WEFT_MESH_SECRET:-" + mesh_auth.DEV_FALLBACK_SECRET + "}"  # services warn on it
