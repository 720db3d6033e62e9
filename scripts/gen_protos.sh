#!/usr/bin/env bash
# Regenerate the Python code of protos/weft/v1/*.proto into weft/v1/.
# Usage: scripts/gen_protos.sh [OUT_DIR]   (OUT_DIR defaults to the repository root)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root}"
py="${PYTHON:-python}"
mkdir -p "$out/weft/v1"
cd "$root"
"$py" -m grpc_tools.protoc -Iprotos \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/weft/v1/*.proto
if [ ! -f "$out/weft/v1/__init__.py" ]; then
  printf '"""Generated protobuf and gRPC code of the weft.v1 API (scripts/gen_protos.sh)."""\n' > "$out/weft/v1/__init__.py"
fi
