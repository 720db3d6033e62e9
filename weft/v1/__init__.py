"""Generated protobuf and gRPC code of the weft.v1 API (scripts/gen_protos.sh)."""
