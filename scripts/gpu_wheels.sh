# Sourced by the GPU scripts (repository root): the server's wheels for the device's Python 3.12, carried in
# .whl (the GPU image has no fastapi), with the Ray Serve kit of tools/ray_kit.py (.rayk) and pre-installed
# trees (.whl/*.tar.xz), installed into /tmp/site and put on PYTHONPATH and PATH. Nothing without .whl.
# The wheels were fetched on the dev machine with:
#   pip download 'fastapi>=0.110' 'uvicorn>=0.29' 'httptools>=0.6' 'prometheus-client>=0.20' 'pydantic>=2' \
#     'msgspec>=0.18' 'swagger-ui-bundle>=1.1' 'httpx>=0.27' --only-binary=:all: --python-version 3.12 \
#     --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
#     --platform any -d .whl
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .rayk/*.whl 2>/dev/null) && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH"
  for tree in .whl/*.tar.xz; do [ -e "$tree" ] && tar -xJf "$tree" -C /tmp/site; done
fi
