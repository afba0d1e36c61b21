# Sourced by the device scripts (device_prepare.sh, scale_cuda.sh): downloads into .whl/ the Python
# packages llmopt needs that the lent GPU machine's image lacks (as wheels for its Python 3.12, the
# versions installed here), and sets $install, the command that installs them there.
# Run from the repository root after `make install`.
PY=.venv/bin/python
for d in /.whl/ /.dev/; do grep -qxF "$d" .git/info/exclude || echo "$d" >> .git/info/exclude; done
rm -rf .whl && mkdir -p .whl
# gguf (the format), greenlet (staged quantization), pydantic (recipes, typer), typer and shellingham (the CLI,
# which benchmarks/scale.py runs), PyYAML (recipes): not in the image (KINDS.md's package list)
wanted=$($PY -m pip freeze | grep -iE '^(gguf|greenlet|pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|typer|shellingham|pyyaml)==')
# shellcheck disable=SC2086
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $wanted
install='python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1'
