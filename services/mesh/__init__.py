"""Shared plumbing of the Weft services: logging, config, gRPC server, NATS bus,
metrics, retries, a local nats-server. Imports none of the services."""
