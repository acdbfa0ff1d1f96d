#!/usr/bin/env bash
# Installs headless Chromium for the viewer's browser test (tests/unit/test_viewer_browser.py):
# puppeteer-core and @sparticuz/chromium (a Chromium build shipped inside the npm package) into
# tools/browser/node_modules (git-ignored). Needs node and npm, and the npm registry.
set -euo pipefail
cd "$(dirname "$0")"
if [ -d node_modules/puppeteer-core ] && [ -d node_modules/@sparticuz/chromium ]; then
    exit 0
fi
npm ci --no-audit --no-fund --loglevel=error
