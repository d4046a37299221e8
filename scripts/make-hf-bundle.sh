#!/usr/bin/env bash
# Packs HF transformers and its dependencies for the GPU machine (Python 3.12, no package registry, at
# most 64 MiB carried per call, ~50 MB of it IREE): the packages installed here, with the compiled ones
# taken from cp312 wheels, and transformers cut to the models of tests/models/hf_models.py. Writes
# .devcarry/hf-cp312.tar.xz (~7 MB). Unpack it next to IREE's bundle on the device:
#   tar -xJf .devcarry/hf-cp312.tar.xz -C /tmp/site
# Usage (from the project's root, with transformers installed): scripts/make-hf-bundle.sh
set -euo pipefail
root=$(git rev-parse --show-toplevel)
sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
site=$work/site; mkdir -p "$site"
for p in anyio attr attrs certifi click colorama h11 httpcore2 httpx2 huggingface_hub idna outcome packaging \
         sniffio sortedcontainers tqdm trio truststore typer; do      # pure Python
  [ -d "$sp/$p" ] && cp -r "$sp/$p" "$site/"
  cp -r "$sp/$p"-*.dist-info "$site/" 2>/dev/null || true
done
cp -r "$sp"/attrs-*.dist-info "$site/" 2>/dev/null || true
for p in regex pyyaml safetensors tokenizers charset-normalizer transformers; do     # wheels for cp312
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$work/whl" "$p==$(version $p)"
done
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$site/"; done
for m in "$site"/transformers/models/*/; do
  case $(basename "$m") in auto|bert|gpt2|llama|t5|bart|vit) ;; *) rm -rf "$m" ;; esac
done
find "$site" -name __pycache__ -type d -prune -exec rm -rf {} +
mkdir -p "$root/.devcarry"
grep -qxF '/.devcarry/' "$root/.git/info/exclude" 2>/dev/null || echo '/.devcarry/' >> "$root/.git/info/exclude"
tar -cf - -C "$site" . | xz -T0 -6 > "$root/.devcarry/hf-cp312.tar.xz"
ls -la "$root/.devcarry/hf-cp312.tar.xz"
