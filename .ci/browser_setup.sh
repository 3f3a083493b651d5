#!/usr/bin/env bash
# Install what the browser tests (tests/widgets, @pytest.mark.browser) need, from nothing.
# Idempotent: each step is skipped when its result is already there.
#   usage: .ci/browser_setup.sh VENV      (for example .ci/browser_setup.sh .venv)
# Installs Debian's chromium (driven by Playwright through executable_path) and pip-installs
# jupyterlab and playwright into VENV. It never runs `playwright install` (that downloads a
# browser of its own, which fails without general network access).
set -euo pipefail

venv="${1:?usage: $0 VENV (the virtual environment to install jupyterlab and playwright into)}"
if [ ! -x "$venv/bin/python" ]; then
    echo "browser_setup: $venv/bin/python not found; pass an existing virtual environment" >&2
    exit 2
fi

if ! command -v chromium >/dev/null 2>&1; then
    sudo=""
    if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
    $sudo apt-get update
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y chromium chromium-driver
fi

if ! "$venv/bin/python" -c "import jupyterlab, playwright" >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install --quiet jupyterlab playwright
fi

echo "browser_setup: chromium at $(command -v chromium); jupyterlab $("$venv/bin/python" -c 'import jupyterlab; print(jupyterlab.__version__)'); playwright $("$venv/bin/python" -m pip show playwright 2>/dev/null | sed -n 's/^Version: //p')"
