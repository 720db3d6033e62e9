"""The cachestore's config takes the options every service shares from ServiceOptions and
keeps its own flags, environment names and defaults (an 8 MiB message cap)."""
from __future__ import annotations

import dataclasses

import pytest

from services.cachestore.config import CacheStoreConfig
from services.mesh.env_config import env_name, load_config
from services.mesh.service_options import ServiceOptions

# Every flag `python -m services.cachestore --help` listed before the config derived from
# ServiceOptions, with its environment variable: none may be lost or renamed.
FLAGS_AND_ENV = {
    "host": "WEFT_CACHESTORE_HOST", "port": "WEFT_CACHESTORE_PORT",
    "host_capacity_bytes": "WEFT_CACHESTORE_HOST_CAPACITY_BYTES", "disk_dir": "WEFT_CACHESTORE_DISK_DIR",
    "disk_capacity_bytes": "WEFT_CACHESTORE_DISK_CAPACITY_BYTES", "disk_fsync": "WEFT_CACHESTORE_DISK_FSYNC",
    "tier_policy": "WEFT_CACHESTORE_TIER_POLICY", "demotion_policy": "WEFT_CACHESTORE_DEMOTION_POLICY",
    "max_idle_s": "WEFT_CACHESTORE_MAX_IDLE_S", "sweep_interval_s": "WEFT_CACHESTORE_SWEEP_INTERVAL_S",
    "nats_url": "WEFT_NATS_URL", "name": "WEFT_CACHESTORE_NAME",
    "semantic_threshold": "WEFT_CACHESTORE_SEMANTIC_THRESHOLD",
    "semantic_max_entries": "WEFT_CACHESTORE_SEMANTIC_MAX_ENTRIES",
    "max_block_bytes": "WEFT_CACHESTORE_MAX_BLOCK_BYTES", "chunk_bytes": "WEFT_CACHESTORE_CHUNK_BYTES",
    "grace_s": "WEFT_CACHESTORE_GRACE_S", "max_message_bytes": "WEFT_CACHESTORE_MAX_MESSAGE_BYTES",
    "metrics_port": "WEFT_CACHESTORE_METRICS_PORT", "mesh_secret_file": "WEFT_MESH_SECRET_FILE",
    "log_level": "WEFT_LOG_LEVEL", "log_format": "WEFT_LOG_FORMAT",
}


def test_the_shared_options_come_from_service_options():
    assert issubclass(CacheStoreConfig, ServiceOptions)
    own = set(CacheStoreConfig.__annotations__)
    shared = {f.name for f in dataclasses.fields(ServiceOptions)}
    assert own & shared == {"max_message_bytes"}  # the one shared option whose default differs


def test_every_flag_keeps_its_name_and_environment_variable():
    fields = {f.name: env_name("cachestore", f) for f in dataclasses.fields(CacheStoreConfig)}
    assert fields == FLAGS_AND_ENV


def test_the_message_cap_stays_8_mib_and_the_shared_defaults_apply():
    cfg = load_config(CacheStoreConfig, "cachestore", "x", [], {})
    assert cfg.max_message_bytes == 8 << 20
    assert (cfg.host, cfg.grace_s, cfg.metrics_port, cfg.log_level) == ("127.0.0.1", 10.0, 0, "info")


@pytest.mark.parametrize(("field", "value"), [
    ("port", 70000), ("metrics_port", -1), ("grace_s", -1.0), ("max_message_bytes", 0),
    ("disk_capacity_bytes", -1), ("chunk_bytes", 8 << 20),
])
def test_a_bad_value_is_refused_naming_its_field(field, value):
    name = "max_message_bytes" if field == "chunk_bytes" else field
    with pytest.raises(ValueError, match=name):
        CacheStoreConfig(**{field: value})
